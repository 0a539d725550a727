"""Soak: thousands of greedy decode steps through the MIL executor; memory must stay flat and the
output must equal a fresh run's.

    python bench/soak.py [--work DIR]     # 2,000 steps on an e2b-narrow bundle (window 512, context 2048),
                                          # converted once into DIR (chat_reuse.py's layout: one --work serves both)
    python bench/soak.py --bundle PATH    # an existing bundle
    python bench/soak.py --quick [--bundle PATH]   # 300 steps on an e2b-mini bundle (context 128); never recorded

Method: one short raw prompt, then greedy steps through `engine.feed`, one token each, the argmax
of chunk_3's fp16 logits. When the context is full the caches are reset and the prompt is fed again
(as bench/ane.py's soak does), so a run longer than the context crosses it; at 2,000 steps and
context 2048 it never has to. Resident memory (RSS, /proc/self/statm) is read every --every steps,
each time after glibc's malloc_trim(0) hands the allocator's free memory back to the system: without
it, RSS creeps up by ~1 MB at each of the first few resets and then stays put (measured on the
e2b-narrow bundle: the heap keeps freed cache arrays and settles after 3-4 resets): not a leak.
Then the caches are reset and the same run is made again from scratch: its whole token sequence
and its last logits must equal the first run's, bit for bit (a cache, ring or snapshot that kept
anything of the first run would show here).

Flat memory: after a warm-up (the first 10 % of the first run's steps), no reading of either run may
exceed the reading at the end of the warm-up by --tolerance MB (default 5). A leak of 1.4 KB per
step over the 3,800 steps that follow crosses 5 MB. The caches are allocated whole, but their pages
may only become resident as positions fill them: the table states their size, which bounds what
filling them can add. Exits 1 if memory is not flat or the output differs. Appends the table to
BENCHMARKS.md with --record (never with --quick).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_reuse import bundle_for  # noqa: E402
from common import publish  # noqa: E402

import gemma_ane  # noqa: E402

PROMPT = "The soak test starts from this short prompt and decodes greedily"


try:
    _trim = ctypes.CDLL(None).malloc_trim  # glibc only
except (OSError, AttributeError):
    _trim = None


def rss_mb() -> float:
    if _trim is not None:
        _trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # no procfs (macOS): the peak instead, which a leak raises as well
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


def run(engine, prompt: list[int], steps: int, every: int) -> tuple[list[int], np.ndarray, list[tuple], int]:
    """(tokens, last logits, [(step, position, RSS MB)] every `every` steps, segments) of `steps`
    greedy steps from an empty cache, starting over from the prompt whenever the context is full."""
    tokens, readings, segments = [], [], 0
    for step in range(1, steps + 1):
        if step == 1 or engine.position >= engine.context:
            engine.reset()
            logits = engine.feed(prompt)[-1]
            segments += 1
        tokens.append(int(np.argmax(logits)))
        logits = engine.feed(tokens[-1:])[-1]
        if step % every == 0 or step == steps:
            readings.append((step, engine.position, rss_mb()))
    return tokens, np.asarray(logits), readings, segments


def state_mb(engine) -> float:
    """What every chunk's states hold (the KV caches and rings), in MB."""
    return (
        sum(
            np.prod(s["shape"]) * np.dtype(s["dtype"]).itemsize
            for chunk in engine.chunks
            for s in chunk.interfaces["infer"]["states"].values()
        )
        / 2**20
    )


def report(about: str, engine, steps: int, first, fresh, tolerance: float) -> tuple[str, bool]:
    (tokens, logits, readings, segments), (tokens2, logits2, readings2, _) = first, fresh
    warm = next(r for r in readings if r[0] >= max(steps // 10, 1))
    later = [r[2] for r in readings if r[0] > warm[0]] + [r[2] for r in readings2]
    growth = max(later, default=warm[2]) - warm[2]
    flat, same = growth < tolerance, tokens == tokens2 and np.array_equal(logits, logits2)
    lines = [
        f"{about}; MIL executor, context {engine.context}, window {engine.window}. {steps} greedy decode steps "
        f"in {segments} segment(s) (the caches reset and the prompt fed again whenever the context fills), "
        f"then the same run again from reset caches. The states hold {state_mb(engine):.1f} MB at full context.",
        "",
        "| step | position | RSS, first run | RSS, fresh run |",
        "|---:|---:|---:|---:|",
    ]
    for (step, position, a), (_, _, b) in zip(readings, readings2):
        lines.append(f"| {step} | {position} | {a:.1f} MB | {b:.1f} MB |")
    lines += [
        "",
        f"- memory flat: {'yes' if flat else 'NO'} (growth after the warm-up to step {warm[0]}: "
        f"{growth:+.1f} MB, tolerance {tolerance:g} MB)",
        f"- output identical to a fresh run: {'yes' if same else 'NO'} ({len(tokens)} tokens, "
        f"{sum(a == b for a, b in zip(tokens, tokens2))} equal; last logits "
        f"{'bit-identical' if np.array_equal(logits, logits2) else 'differ'})",
        f"- RSS at the end, fresh run minus first run: {readings2[-1][2] - readings[-1][2]:+.1f} MB "
        f"(a leak of 1 KB per step would make it about {steps / 1024:+.1f} MB)",
    ]
    return "\n".join(lines), flat and same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="an existing bundle (default: convert a narrow one with the real window/context)")
    p.add_argument("--work", help="where the built bundle is cached (default: a temporary directory)")
    p.add_argument("--steps", type=int, help="decode steps (default 2000; --quick 300)")
    p.add_argument("--every", type=int, help="steps between memory readings (default 100; --quick 25)")
    p.add_argument("--tolerance", type=float, default=5.0, help="MB of growth after the warm-up still flat")
    p.add_argument("--quick", action="store_true", help="300 steps at the bundle's context; never recorded")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    steps = a.steps if a.steps is not None else 300 if a.quick else 2000
    every = a.every if a.every is not None else 25 if a.quick else 100
    if steps < 1 or every < 1:
        p.error("--steps and --every must be >= 1")

    with tempfile.TemporaryDirectory() as tmp:
        bundle, about = bundle_for(a, tmp)
        model = gemma_ane.load(bundle, backend="mil")
        prompt = model.prompt_ids(PROMPT, raw=True)
        if len(prompt) >= model.context:
            p.error(f"the prompt's {len(prompt)} tokens leave no room in the context of {model.context}")
        print(f"soak: {steps} steps ...", file=sys.stderr, flush=True)
        first = run(model.engine, prompt, steps, every)
        print("fresh run ...", file=sys.stderr, flush=True)
        fresh = run(model.engine, prompt, steps, every)
        table, ok = report(about, model.engine, steps, first, fresh, a.tolerance)
    publish("Soak: decode steps through the MIL executor", table, a)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
