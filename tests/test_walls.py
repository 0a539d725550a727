"""The three walls: the runtime runs without torch or transformers, and the executor never
touches our graph code (it must stand on the saved program alone)."""

import ast
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
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
"""


def test_runtime_and_executor_stand_alone(tiny_bundle16):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_bundle16)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# -- the same walls, read off the source: every import, at module level or inside a function --------

PACKAGE = Path(__file__).parent.parent / "gemma_ane"
RUNTIME = {
    "audit",
    "backend",
    "bundle",
    "chat",
    "engine",
    "files",
    "host",
    "mil",
    "package",
    "prompt_cache",
    "runtime",
    "sampling",
    "server",
    "tokens",
    "tools",
    "grammar",
    "drafter",
    "images",
    "encoder",
}
CONVERTER_SIDE = {"graph", "convert", "verify", "tiny", "palettize", "tokenizer_files", "assistant", "vision"}


def imports(module: str) -> set[str]:
    """Top-level package names a module imports, with our own modules as "gemma_ane.<name>"."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from . import x
                names = [node.module] if node.module else [a.name for a in node.names]
                found |= {f"gemma_ane.{n.split('.')[0]}" for n in names}
            else:
                found.add(node.module.split(".")[0])
    return found


def test_runtime_side_never_imports_torch_transformers_or_the_converter():
    for module in RUNTIME:
        banned = imports(module) & (
            {"torch", "transformers", "safetensors"} | {f"gemma_ane.{m}" for m in CONVERTER_SIDE}
        )
        assert not banned, f"{module}.py imports {sorted(banned)}"


def test_executor_stands_on_the_saved_program_alone():
    for module in ("mil", "package"):
        ours = {m for m in imports(module) if m.startswith("gemma_ane.")}
        assert ours <= {"gemma_ane.package", "gemma_ane.files"}, f"{module}.py imports {sorted(ours)}"


def test_transformers_is_imported_only_by_the_oracle_side():
    users = {p.stem for p in PACKAGE.glob("*.py") if "transformers" in imports(p.stem)}
    # evaluate: measures a bundle against the oracle, as verify does (through verify's oracle_model)
    assert users <= {"verify", "tiny", "evaluate"}, sorted(users)
