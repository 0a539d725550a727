"""Where the drafter's centroid head runs: its cost on the host, three ways, at E2B's shapes.

    python bench/drafter_head.py            # E2B: 262,144 tokens, 2,048 clusters of 128, the best 32, width 256
    python bench/drafter_head.py --quick    # small shapes, for the test suite

Per draft step the head takes the 2,048 cluster scores (computed in the graph) and gives real logits to the
4,096 tokens of the best 32 clusters: a gather of 4,096 rows of a 262,144-row table, which the Neural Engine does
badly (CONTRACT §3), so the bundle leaves it to the host. This times the host's ways of doing it, each from a
sidecar of int8 rows read with pread (as the runtime reads every table):
- cluster order (the runtime's, `drafter.CentroidHead`): the table stored cluster by cluster, one 32 KB read per
  cluster, then the dot products with einsum on the int8 rows;
- token order: the table as the checkpoint orders it, one read per token (4,096 reads);
- cluster order with a BLAS matmul (the int8 rows cast to fp32) instead of einsum.
All three must give the same logits. The in-graph alternative (a 262,144-row gather on the Neural Engine) needs a
Mac to time; this machine has none.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

from gemma_ane.bundle import RowTable  # noqa: E402
from gemma_ane.runtime.drafter import CentroidHead  # noqa: E402

E2B = dict(vocab=262_144, clusters=2048, top_k=32, width=256)
QUICK = dict(vocab=4096, clusters=64, top_k=8, width=64)


def token_order(table: RowTable, head: CentroidHead, scores: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    top = np.argpartition(-scores, head.top_k - 1)[: head.top_k]
    q = table[head.clusters[top].ravel()]  # one pread per token
    return np.einsum("ij,j->i", q, hidden) * head.factors[top].ravel()


def blas(head: CentroidHead, scores: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    top, q = head.best(scores)
    return (q.astype(np.float32) @ hidden) * head.factors[top].ravel()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes, a few steps (figures mean nothing)")
    p.add_argument("--steps", type=int, default=300, help="draft steps timed per way")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    s = QUICK if a.quick else E2B
    steps = 20 if a.quick else a.steps
    V, C, H = s["vocab"], s["clusters"], s["width"]
    rng = np.random.default_rng(0)
    ordering = rng.permutation(V).astype(np.int64)  # cluster c holds tokens ordering[c * n : (c + 1) * n]
    q = rng.integers(-127, 128, (V, H), dtype=np.int8)  # row i: token ordering[i]
    factors = rng.uniform(0.5, 1.5, V).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "clustered.bin").write_bytes(q.tobytes())
        by_token = np.empty_like(q)
        by_token[ordering] = q
        (Path(d) / "tokens.bin").write_bytes(by_token.tobytes())
        del by_token
        head = CentroidHead(RowTable(Path(d) / "clustered.bin", np.int8, (V, H)), factors, ordering, C, s["top_k"])
        tokens = RowTable(Path(d) / "tokens.bin", np.int8, (V, H))
        inputs = [(rng.normal(size=C).astype(np.float32), rng.normal(size=H).astype(np.float32)) for _ in range(steps)]
        ways = {
            "cluster order, einsum (the runtime's)": lambda sc, h: head(sc, h).logits,
            "token order, one read per token": lambda sc, h: token_order(tokens, head, sc, h),
            "cluster order, BLAS matmul": lambda sc, h: blas(head, sc, h),
        }
        want = [head(sc, h).logits for sc, h in inputs[:3]]
        rows = []
        for name, way in ways.items():
            for (sc, h), w in zip(inputs, want):
                np.testing.assert_allclose(way(sc, h), w, rtol=1e-4, atol=1e-2)
            ms = []
            for sc, h in inputs:
                t0 = time.perf_counter()
                way(sc, h)
                ms.append(1e3 * (time.perf_counter() - t0))
            rows.append(f"| {name} | {np.median(ms):.3f} | {np.percentile(ms, 90):.3f} |")
    body = (
        f"Centroid head per draft step: {V:,} tokens in {C:,} clusters of {V // C}, the best {s['top_k']} "
        f"({s['top_k'] * V // C:,} tokens) scored in full, width {H}; int8 sidecar read with pread; "
        f"{steps} steps each\n\n"
        "| way | median ms | p90 ms |\n|---|---|---|\n" + "\n".join(rows)
    )
    if a.quick:
        body = "QUICK MODE: small shapes, these figures mean nothing\n\n" + body
    publish("drafter centroid head on the host", body, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
