"""Where a MIL-executor decode step spends its time: matmuls (linear + matmul ops) vs the rest.

    python bench/executor.py BUNDLE [--steps 20]     # a converted bundle, e.g. of `gemma-ane tiny --preset e2b-wide`
    python bench/executor.py --quick [BUNDLE]        # a tiny e2b-mini bundle is converted if none is given

Runs decode steps (T=1, all chunks) through the step driver, times every executor op by type, and
prints the share of matmul time in the whole step. Appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, tiny_bundle  # noqa: E402

from gemma_ane.bundle import open_bundle  # noqa: E402
from gemma_ane.runtime.backend import open_engine  # noqa: E402
from gemma_ane.runtime.device import Device  # noqa: E402

MATMUL = {"linear", "matmul"}


def instrument(engine, seconds: dict):
    for chunk in engine.chunks:
        for model in chunk.package.functions.values():
            wrapped = []
            for step, kind in zip(model._steps, model.step_kinds):

                def timed(*args, step=step, kind=kind):
                    t = time.perf_counter()
                    step(*args)
                    seconds[kind] += time.perf_counter() - t

                timed.needs_state = getattr(step, "needs_state", False)
                wrapped.append(timed)
            model._steps = wrapped


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if not a.bundle and not a.quick:
            p.error("give a BUNDLE, or --quick")
        bundle = Path(a.bundle) if a.bundle else tiny_bundle(Path(tmp), bits=4)
        engine = open_engine(open_bundle(bundle, check=False), Device.of("mil"))
        rng = np.random.default_rng(0)
        vocab = engine.host.embed_q.shape[0]
        engine.feed(rng.integers(0, vocab, 4))  # warm-up (first calls touch every weight)
        seconds = defaultdict(float)
        instrument(engine, seconds)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.feed(rng.integers(0, vocab, 1))
        total = time.perf_counter() - t0
    ops = sum(seconds.values())
    mm = sum(v for k, v in seconds.items() if k in MATMUL)
    top = sorted(seconds.items(), key=lambda kv: -kv[1])[:8]
    table = "\n".join(
        [
            f"bundle `{bundle.name if a.bundle else 'e2b-mini (quick)'}`, "
            f"{a.steps} decode steps (chunk_1 + chunk_2 + chunk_3 each)",
            "",
            f"- step: {1000 * total / a.steps:.1f} ms; inside executor ops: {1000 * ops / a.steps:.1f} ms",
            f"- matmul share of the step: **{mm / total:.1%}** (linear + matmul ops), of op time {mm / ops:.1%}",
            "",
            "| op | ms / step | share of step |",
            "|---|---|---|",
            *[f"| {k} | {1000 * v / a.steps:.2f} | {v / total:.1%} |" for k, v in top],
        ]
    )
    print(table)
    if a.record:
        record("executor decode profile", table)


if __name__ == "__main__":
    main()
