"""The cost of converting the full-size checkpoint, and the bundle's sizes against the published ones.

    python bench/make_full_checkpoint.py /work/full/e2b-random
    python bench/convert_full.py /work/full/e2b-random /work/full/bundle4          # ~25 min on 2 cores
    python bench/convert_full.py CKPT OUT --quick                                 # tiny checkpoint, for CI
    python bench/convert_full.py CKPT OUT --assistant DRAFTER                     # also the drafter, verify_b4

Runs `gemma-ane convert CKPT OUT --bits 4 --stats ...` as a child process and records:
- wall time per stage (load, trace, convert, palettize, merge, sidecars) and in total;
- peak resident memory per stage: the converter's own VmHWM, reset at each stage entry, so exact
  rather than sampled (the converter runs in one process, so the maximum over stages is the peak
  of the whole run; the reset also resets the child's ru_maxrss, which is used only without stats);
- every file of the bundle against CONTRACT §2's published sizes: chunks within 5 %, sidecars exact.
Targets on 2 cores / 24 GiB (issue 30: a conversion that fits a 16 GB laptop): E2B <= 4 min and peak RSS
<= 6 GiB; E4B <= 12 min and peak RSS <= 10 GiB. A checkpoint that is not E2B (E4B) has no published build to
compare with: its chunks are held against the ~1 GB package size above which the Neural Engine is reported to hand
a model to the GPU instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

GiB = 2**30
# issue 30's goals, (minutes, peak GiB): E2B's and E4B's 4-bit conversions fit a 16 GB laptop
TARGETS = {"E2B": (4, 6), "E4B": (12, 10)}
ANE_PACKAGE_LIMIT = 1e9  # CoreML-LLM's notes: packages past ~1-1.4 GB silently fall back to the GPU
# CONTRACT §2: the published 4-bit E2B build.
PUBLISHED_CHUNKS = {"chunk_1": 155e6, "chunk_2": 459e6, "chunk_3": 527e6}
PUBLISHED_SIDECARS = {
    "embed_tokens_q8.bin": 262144 * 1536,
    "embed_tokens_scales.bin": 262144 * 2,
    "embed_tokens_per_layer_q8.bin": 262144 * 8960,
    "embed_tokens_per_layer_scales.bin": 262144 * 2,
    "per_layer_projection.bin": 8960 * 1536 * 2,
    "per_layer_norm_weight.bin": 256 * 2,
    # npy v1.0 with a 128-byte header; the published tables have 8192 rows
    "cos_sliding.npy": 128 + 8192 * 256 * 2,
    "sin_sliding.npy": 128 + 8192 * 256 * 2,
    "cos_full.npy": 128 + 8192 * 512 * 2,
    "sin_full.npy": 128 + 8192 * 512 * 2,
}
WHY = {
    "cos_sliding.npy": "we store max(context, 4096) rows, not 8192: rows past the context are never read",
    "sin_sliding.npy": "as cos_sliding.npy",
    "cos_full.npy": "as cos_sliding.npy",
    "sin_full.npy": "as cos_sliding.npy",
}


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def run_convert(ckpt: str, out: str, bits: int, stats: Path, extra: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes of the process tree, exit code)."""
    cmd = [
        sys.executable,
        "-m",
        "gemma_ane.cli",
        "convert",
        ckpt,
        out,
        "--bits",
        str(bits),
        "--force",
        "--quiet",
        "--stats",
        str(stats),
        *extra,
    ]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, proc.returncode


def size_table(out: Path) -> tuple[str, list[str]]:
    rows, misses = ["| file | ours | published | difference |", "|---|---:|---:|---|"], []
    for name, want in PUBLISHED_CHUNKS.items():
        path = next(out.glob(f"{name}.mlmodelc"), None) or out / f"{name}.mlpackage"
        got = tree_size(path) if path.exists() else 0
        delta = got / want - 1
        ok = abs(delta) <= 0.05
        verdict = "(within 5 %)" if ok else "MISSED"
        rows.append(f"| {path.name} | {got / 1e6:.1f} MB | {want / 1e6:.0f} MB | {delta:+.1%} {verdict} |")
        if not ok:
            misses.append(f"{name} {delta:+.1%}")
    for name, want in PUBLISHED_SIDECARS.items():
        got = (out / name).stat().st_size if (out / name).exists() else 0
        note = "byte-exact" if got == want else f"{got - want:+,} B: {WHY.get(name, 'UNEXPLAINED')}"
        rows.append(f"| {name} | {got:,} B | {want:,} B | {note} |")
        if got != want and name not in WHY:
            misses.append(name)
    return "\n".join(rows), misses


def limit_table(out: Path) -> tuple[str, list[str]]:
    rows, misses = ["| file | size | under ~1 GB |", "|---|---:|---|"], []
    for path in sorted(out.glob("chunk_*.mlpackage")) + sorted(out.glob("chunk_*.mlmodelc")):
        got = tree_size(path)
        ok = got < ANE_PACKAGE_LIMIT
        rows.append(f"| {path.name} | {got / 1e6:.1f} MB | {'yes' if ok else 'NO'} ({got / ANE_PACKAGE_LIMIT:.1%}) |")
        if not ok:
            misses.append(f"{path.name} {got / 1e9:.2f} GB")
    return "\n".join(rows), misses


def is_e2b(ckpt: str) -> bool:
    config = json.loads((Path(ckpt) / "config.json").read_text())
    text = config.get("text_config", config)
    return text.get("hidden_size") == 1536 and text.get("num_hidden_layers") == 35


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--assistant", metavar="DIR", help="also convert this drafter (gemma-ane convert --assistant)")
    p.add_argument("--draft-tokens", type=int, metavar="K", help="with --assistant: verify_b{K+1} (default 3)")
    p.add_argument("--max-chunk-mb", type=float, metavar="MB", help="chunks planned to this budget (gemma-ane convert)")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint: skip the size comparison")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        stats_path = Path(tmp) / "stats.json"
        extra = ["--assistant", a.assistant] if a.assistant else []
        extra += ["--draft-tokens", str(a.draft_tokens)] if a.draft_tokens is not None else []
        extra += ["--max-chunk-mb", f"{a.max_chunk_mb:g}"] if a.max_chunk_mb is not None else []
        wall, tree_peak, rc = run_convert(a.ckpt, a.out, a.bits, stats_path, extra)
        if rc != 0:
            sys.exit(f"error: gemma-ane convert exited with {rc}")
        stats = json.loads(stats_path.read_text())
    peak = max(stats["peak_rss_bytes"].values(), default=0) or tree_peak
    minutes, peak_gib = wall / 60, peak / GiB
    lines = [
        f"`gemma-ane convert {a.ckpt} OUT --bits {a.bits}{' ' + ' '.join(extra) if extra else ''}`: "
        f"**{minutes:.1f} min** wall, "
        f"peak RSS **{peak_gib:.2f} GiB**",
        "",
        "| stage | seconds | share | peak RSS |",
        "|---|---:|---:|---:|",
    ]
    total = sum(stats["seconds"].values())
    for stage, sec in sorted(stats["seconds"].items(), key=lambda kv: -kv[1]):
        peak = stats["peak_rss_bytes"].get(stage)
        lines.append(
            f"| {stage} | {sec:.1f} | {sec / total:.0%} | {peak / GiB:.2f} GiB |"
            if peak
            else f"| {stage} | {sec:.1f} | {sec / total:.0%} | - |"
        )
    if not a.quick:
        model = "E2B" if is_e2b(a.ckpt) else "E4B"
        want_min, want_gib = TARGETS[model]
        lines += [
            "",
            f"- {model} target <= {want_min} min: "
            + ("met" if minutes <= want_min else f"missed by {minutes - want_min:.1f} min"),
            f"- {model} target <= {want_gib} GiB: "
            + ("met" if peak_gib <= want_gib else f"missed by {peak_gib - want_gib:.2f} GiB"),
        ]
    if not a.quick and not is_e2b(a.ckpt):
        table, misses = limit_table(Path(a.out))
        lines += ["", "Chunk sizes against the Neural Engine's ~1 GB package limit:", "", table]
        if misses:
            lines += ["", "Over the limit: " + ", ".join(misses)]
    elif not a.quick:
        table, misses = size_table(Path(a.out))
        lines += ["", "Sizes against the published 4-bit build (CONTRACT §2):", "", table]
        if misses:
            lines += ["", "Outside the bounds: " + ", ".join(misses)]
    drafter = Path(a.out) / "assistant.mlpackage"
    if not a.quick and drafter.exists():
        lines += ["", f"- {drafter.name}: {tree_size(drafter) / 1e6:.1f} MB (no published build to compare with)"]
    publish("full-size conversion", "\n".join(lines), a)


if __name__ == "__main__":
    main()
