"""On a Mac: the bundle on the Neural Engine through Core ML: load, prompt, decode, memory, a soak.

    python bench/ane.py BUNDLE [--compute-units cpu_and_ne] [--soak 3000]
    python bench/ane.py BUNDLE --quick     # short runs at the bundle's own context, never recorded

macOS only (Core ML prediction does not exist elsewhere); on Linux it says so and exits 2. The test
suite runs --quick through its Core ML stand-in (coremltools' own front-end over our executor), so
this script cannot arrive on a Mac broken; those figures say nothing about the Neural Engine.
Method:
- load: `gemma_ane.load(BUNDLE, backend="coreml")` twice in this process. The first load of a
  .mlpackage compiles it (Core ML caches the result), the second reads the cache;
- time to first token and prompt tok/s for every prompt path the bundle has (token-by-token
  `infer`, `prefill_b8`, KV-only `prefill_kv_b*`), on the same 256-token prompt from an empty cache;
- decode tok/s at context 256, 1024 and 2000: fill the cache to that position, time 64 steps;
  (--quick: a quarter and half of the bundle's context, 8 steps, a 200-step soak);
- phys_footprint (what iOS's memory limit counts) after loading and after decoding, read with
  proc_pid_rusage;
- soak: --soak decode steps (default 3000; coremltools#2716 reports crashes and drift in long
  stateful runs). The cache is reset whenever it fills, and every segment replays the same prompt
  and greedy steps, so any logits difference between segments is drift; an exception is a crash.
Appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402


def phys_footprint() -> int | None:
    """ri_phys_footprint of this process (bytes), via libproc's proc_pid_rusage(RUSAGE_INFO_V2);
    None where there is no libproc (the tests' stand-in runs this on Linux)."""

    class RUsageInfoV2(ctypes.Structure):
        _fields_ = [("ri_uuid", ctypes.c_uint8 * 16)] + [
            (n, ctypes.c_uint64)
            for n in (
                "user_time",
                "system_time",
                "pkg_idle_wkups",
                "interrupt_wkups",
                "pageins",
                "wired_size",
                "resident_size",
                "phys_footprint",
                "proc_start_abstime",
                "proc_exit_abstime",
                "child_user_time",
                "child_system_time",
                "child_pkg_idle_wkups",
                "child_interrupt_wkups",
                "child_pageins",
                "child_elapsed_abstime",
                "diskio_bytesread",
                "diskio_byteswritten",
            )
        ]

    info = RUsageInfoV2()
    try:
        libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
    except OSError:
        return None
    if libproc.proc_pid_rusage(os.getpid(), 2, ctypes.byref(info)) != 0:
        return None
    return int(info.phys_footprint)


def megabytes(n: int | None) -> str:
    return "n/a (no libproc)" if n is None else f"{n / 2**20:.0f} MB"


def timed_prompt(engine, ids, paths) -> float:
    """Seconds to process ids from an empty cache with only the given prompt functions."""
    saved = engine.prefill_batch, engine.kv_batches
    engine.prefill_batch, engine.kv_batches = paths
    try:
        engine.reset()
        t = time.perf_counter()
        engine.feed(ids)
        return time.perf_counter() - t
    finally:
        engine.prefill_batch, engine.kv_batches = saved


def random_ids(engine, rng, n: int) -> np.ndarray:
    """n random token ids, clear of the control tokens at the start of the vocabulary."""
    vocab = len(engine.host.embed_scales)
    return rng.integers(vocab // 100, vocab, n)


def decode_rate(engine, position: int, steps: int, rng) -> float:
    engine.reset()
    logits = engine.feed(random_ids(engine, rng, position))[-1]
    t = time.perf_counter()
    for _ in range(steps):
        logits = engine.feed([int(np.argmax(logits))])[-1]
    return steps / (time.perf_counter() - t)


def soak(engine, steps: int, prompt) -> tuple[int, float, str]:
    """(steps done, max |logits difference| between segments, error or '')."""
    reference, done, drift = [], 0, 0.0
    try:
        while done < steps:
            engine.reset()
            logits = engine.feed(prompt)[-1]
            for i in range(engine.context - len(prompt)):
                if done >= steps:
                    break
                if i < len(reference):
                    drift = max(drift, float(np.max(np.abs(np.asarray(logits, np.float32) - reference[i]))))
                elif i < 256:
                    reference.append(np.asarray(logits, np.float32))
                logits = engine.feed([int(np.argmax(logits))])[-1]
                done += 1
    except Exception as e:  # a crash is the finding, not the end of the report
        return done, drift, f"{type(e).__name__}: {e}"
    return done, drift, ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", nargs="?")
    p.add_argument("--compute-units", default="cpu_and_ne")
    p.add_argument("--soak", type=int, default=None, help="decode steps of the soak (default 3000; --quick 200)")
    p.add_argument("--quick", action="store_true", help="short runs at the bundle's context; nothing recorded")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    if platform.system() != "Darwin":
        print(
            f"bench/ane.py needs macOS: Core ML prediction (and the Neural Engine) does not exist on "
            f"{platform.system()}. Run it on a Mac with the bundle; on this machine use "
            "bench/executor_vs_transformers.py.",
            file=sys.stderr,
        )
        sys.exit(2)
    if not a.bundle:
        p.error("BUNDLE is required")
    import gemma_ane

    t = time.perf_counter()
    gemma_ane.load(a.bundle, backend="coreml", compute_units=a.compute_units)
    first = time.perf_counter() - t
    t = time.perf_counter()
    model = gemma_ane.load(a.bundle, backend="coreml", compute_units=a.compute_units)
    cached = time.perf_counter() - t
    engine = model.engine
    foot_loaded = phys_footprint()
    rng = np.random.default_rng(0)
    prompt = random_ids(engine, rng, min(256, engine.context // 2))
    positions, steps = ((engine.context // 4, engine.context // 2), 8) if a.quick else ((256, 1024, 2000), 64)
    soak_steps = a.soak if a.soak is not None else 200 if a.quick else 3000
    paths = {"infer": (None, ())}
    if engine.prefill_batch:
        paths[f"prefill_b{engine.prefill_batch}"] = (engine.prefill_batch, ())
    for T in engine.kv_batches:
        paths[f"prefill_kv_b{T} (+ smaller)"] = (None, tuple(b for b in engine.kv_batches if b <= T))
    lines = [
        f"Bundle `{a.bundle}`, compute units {a.compute_units}."
        + (" QUICK MODE: a smoke run; these figures mean nothing." if a.quick else ""),
        "",
        f"- load: {first:.1f} s first (compiles), {cached:.1f} s cached",
        "",
        f"| prompt path ({len(prompt)} tokens) | time to first token | prompt tok/s |",
        "|---|---:|---:|",
    ]
    for name, spec in paths.items():
        s = timed_prompt(engine, prompt, spec)
        lines.append(f"| {name} | {s:.2f} s | {len(prompt) / s:.1f} |")
    lines += ["", "| context | decode tok/s |", "|---:|---:|"]
    for n in positions:
        lines.append(f"| {n} | {decode_rate(engine, n, steps, rng):.1f} |")
    done, drift, error = soak(engine, soak_steps, prompt[:32])
    lines += [
        "",
        f"- phys_footprint: {megabytes(foot_loaded)} after load, {megabytes(phys_footprint())} after the runs",
        f"- soak: {done}/{soak_steps} steps, max logits drift between segments {drift:.3g}"
        + (f", CRASHED: {error}" if error else ""),
    ]
    publish("Neural Engine (Core ML)", "\n".join(lines), a)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
