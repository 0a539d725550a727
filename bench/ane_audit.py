"""The Neural Engine audit (`gemma-ane inspect --ane`) of a bundle, and the sizes of what prefix
reuse keeps, read off its declared states.

    python bench/ane_audit.py BUNDLE            # e.g. the full-size 4-bit E2B bundle
    python bench/ane_audit.py BUNDLE --quick    # a tiny bundle: never recorded

Both are static (nothing runs): the audit reads every saved program; the sizes are the rings (one
snapshot, per prompt end or turn end kept) and a prompt cache file's arrays for a 1,000-token
system prompt (the full caches' first 1,000 slots plus the rings).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

from gemma_ane.bundle import chunk_paths  # noqa: E402
from gemma_ane.mil.package import Package  # noqa: E402
from gemma_ane.runtime.audit import audit_bundle, format_audit  # noqa: E402
from gemma_ane.runtime.engine import RING  # noqa: E402


def state_bytes(root: Path, tokens: int) -> tuple[int, int]:
    """(ring bytes, prompt cache bytes for `tokens` cached tokens) over every chunk's states."""
    rings = cache = 0
    for path in chunk_paths(root):
        for name, t in Package.open(path).interface()["states"].items():
            size = np.dtype(t["dtype"]).itemsize * int(np.prod(t["shape"]))
            rings += size if name == RING else 0
            cache += size if name == RING else size * min(tokens, t["shape"][2]) // t["shape"][2]
    return rings, cache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--tokens", type=int, default=1000, help="system prompt length for the cache file size")
    p.add_argument("--quick", action="store_true", help="a tiny bundle: print, never record")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    t = time.perf_counter()
    report = audit_bundle(a.bundle)
    seconds = time.perf_counter() - t
    rings, cache = state_bytes(Path(a.bundle), a.tokens)
    body = "\n".join(
        [
            f"`gemma-ane inspect {a.bundle} --ane`: **{report['verdict']}** ({seconds:.0f} s)",
            "",
            "```",
            format_audit(report),
            "```",
            "",
            f"- ring snapshot (every `{RING}` state): {rings / 1e6:.3f} MB",
            f"- prompt cache file arrays for a {a.tokens}-token prefix: {cache / 1e6:.3f} MB",
        ]
    )
    publish("Neural Engine audit and reuse state sizes", body, a)
    return 0 if report["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
