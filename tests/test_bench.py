"""The benchmark scripts' --quick modes, so they cannot rot (the real runs are not CI's job)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script, *args):
    r = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--no-record", *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_palettizer_quick():
    out = run("palettizer.py")
    assert "speed-up" in out and "| wide | 512x1536 |" in out


def test_executor_profile_quick():
    out = run("executor.py")
    assert "matmul share of the step" in out


def test_host_overhead_quick():
    out = run("host_overhead.py")
    assert "host overhead per token: median" in out and "resident memory" in out


def test_server_load_quick():
    out = run("server_load.py")
    assert "| 20/20 |" in out and "p99 latency" in out
