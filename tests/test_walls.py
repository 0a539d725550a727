"""The three walls: the runtime runs without torch or transformers, and the executor never
touches our graph code (it must stand on the saved program alone)."""

import subprocess
import sys

SCRIPT = r'''
import sys, importlib.abc

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors"):
            raise ImportError(f"{name} is walled off")
        return None

sys.meta_path.insert(0, Block())
import gemma_ane
model = gemma_ane.load(sys.argv[1], backend="mil")
result = model.generate("hello", max_tokens=3, temperature=0)
assert result.finish_reason == "length" and len(result.tokens) == 3
banned = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
          or m in ("gemma_ane.graph", "gemma_ane.convert", "gemma_ane.verify", "gemma_ane.tiny")]
assert not banned, banned
print("OK")
'''


def test_runtime_and_executor_stand_alone(tiny_bundle16):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_bundle16)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
