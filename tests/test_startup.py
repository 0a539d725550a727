"""bench/startup.py, the runtime path's start-up (import, load, one token in a fresh process): it runs, it names
the heavy modules the runtime path imported, and it leaves BENCHMARKS.md alone unless --record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from startup import banned_imports  # noqa: E402


def test_banned_imports_read_from_importtime():
    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       120 |        120 |   numpy.core",
            "import time:    206536 |   10019607 |     torch",
            "import time:       428 |    5217490 |       sklearn",
            "import time:        12 |         12 |   torch.nn",  # a submodule: torch's own entry counts
            "warning: not an importtime line",
        ]
    )
    assert banned_imports(stderr) == {"torch": 10.019607, "scikit-learn": 5.21749}
    assert banned_imports("import time:       120 |        120 | numpy") == {}


@pytest.mark.slow
def test_startup_bench_runs_and_records_only_when_asked(tiny_bundle16):
    benchmarks = BENCH.parent / "BENCHMARKS.md"
    before = benchmarks.read_bytes()
    r = subprocess.run(
        [sys.executable, str(BENCH / "startup.py"), str(tiny_bundle16), "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| import gemma_ane | load | first token | in all |" in r.stdout
    assert "torch, transformers, scikit-learn or the coremltools package imported on the way:" in r.stdout
    assert benchmarks.read_bytes() == before
