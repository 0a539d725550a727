"""What each weight compression costs, measured with `gemma-ane eval` on a tiny preset and on its q4_0-grid variant.

    python bench/quant_quality.py [--preset e2b-mini] [--work DIR] [--record]
    python bench/quant_quality.py --quick            # one mode on a short text, for the test suite

The q4_0-grid variant is the preset's checkpoint with its weights moved onto the grids a lossless conversion needs,
as quantization-aware training leaves them (`move_onto_grid`): every 2-D weight on llama.cpp's q4_0 grid (blocks of
32 inputs, integers -8..7, one bf16 scale a block, the block's largest weight at -8), the per-layer embedding table on
the bundle's int8 row grid, the token embedding (the LM head too: Gemma ties them) on both at once, everything else
rounded to bf16. Each checkpoint is converted at `lut` 4 and 6 bits and `block` 4 and 8 bits, and each bundle is
evaluated against transformers in fp32 arithmetic (`eval --precision fp32`: what is left is the weights').
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

BLOCK = 32  # q4_0's block of inputs
MODES = [("lut", 4), ("block", 4), ("lut", 6), ("block", 8)]
WORDS = (
    "the river ran past the old mill where the miller kept his bread and his dog slept in the sun while "
    "children counted boats and the wind turned every sail toward the sea"
).split()


def bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bfloat16 (to nearest, ties to even)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _pow2(x: np.ndarray) -> np.ndarray:
    """The power of two nearest x (per element, x > 0), at least fp16's smallest normal."""
    return np.exp2(np.maximum(np.rint(np.log2(np.maximum(x, 1e-30))), -14)).astype(np.float32)


def q4_0_grid(w: np.ndarray) -> np.ndarray:
    """w moved onto q4_0's grid: per block of 32 inputs, scale d = bf16(peak / -8) (at least fp16's smallest normal,
    so fp16 holds it), integers round(w / d) in -8..7 with the peak at -8. Every value k * d is exact in fp16."""
    out, cols = w.shape
    b = w.reshape(out, cols // BLOCK, BLOCK)
    at = np.abs(b).argmax(-1)[..., None]
    peak = np.take_along_axis(b, at, -1)
    d = bf16(peak / -8.0)
    d = np.where(np.abs(d) < 2.0**-14, np.where(peak > 0, -(2.0**-14), 2.0**-14), d).astype(np.float32)
    k = np.clip(np.rint(b / d), -8, 7)
    np.put_along_axis(k, at, -8, -1)
    return (k * d).reshape(out, cols).astype(np.float32)


def int8_row_grid(w: np.ndarray) -> np.ndarray:
    """w moved onto the bundle's int8 row grid (host.quantize_rows: scale = fp16(max|row|), q = w * 127 / scale):
    each row integers times a power of two u, its largest at +-127 u, so the fp16 scale is 127 u exactly."""
    u = _pow2(np.abs(w).max(axis=1, keepdims=True) / 127)
    q = np.clip(np.rint(w / u), -127, 127)
    at = np.abs(w).argmax(axis=1)
    q[np.arange(len(q)), at] = np.where(w[np.arange(len(q)), at] < 0, -127, 127)
    return (q * u).astype(np.float32)


def both_grids(w: np.ndarray) -> np.ndarray:
    """w on the int8 row grid and on q4_0's grid at once (a tied embedding is both the host's int8 table and the LM
    head). Per row, a unit u (a power of two): the block holding the row's largest weight has only 0 and that weight's
    sign times 127 u (its q4_0 scale 127 u / 8 is exact in fp16, its integers -8 and 0); every other block has a
    scale j u, j in 1..15, and integers -8..7, so each value is an integer of at most 120 times u."""
    out, cols = w.shape
    u = _pow2(np.abs(w).max(axis=1, keepdims=True) / 127)[..., None]  # [out, 1, 1]
    b = w.reshape(out, cols // BLOCK, BLOCK)
    at = np.abs(b).argmax(-1)[..., None]
    peak = np.take_along_axis(b, at, -1)
    j = np.clip(np.rint(np.abs(peak) / (8 * u)), 1, 15)
    d = np.where(peak > 0, -j, j) * u
    k = np.clip(np.rint(b / d), -8, 7)
    np.put_along_axis(k, at, -8, -1)
    grid = k * d
    rows = np.arange(out)
    top = np.abs(w).argmax(axis=1)
    top_block, sign = top // BLOCK, np.sign(w[rows, top])
    big = b[rows, top_block] * sign[:, None] > 0.5 * np.abs(w[rows, top])[:, None]  # same sign, at least half
    big[rows, top % BLOCK] = True
    grid[rows, top_block] = np.where(big, sign[:, None] * 127 * u[:, 0], 0.0)
    return grid.reshape(out, cols).astype(np.float32)


def move_onto_grid(src: Path, dst: Path) -> Path:
    """Copy the checkpoint directory `src` to `dst` with its weights on the grids (see the module's docstring)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            shutil.copyfile(f, dst / f.name)
            continue
        state = {}
        for name, t in load_file(f).items():
            t = t.astype(np.float32) if t.dtype != np.float32 else t
            if name.endswith("language_model.embed_tokens.weight"):
                t = both_grids(t)
            elif name.endswith("embed_tokens_per_layer.weight"):
                t = int8_row_grid(t)
            elif t.ndim == 2 and t.shape[1] % BLOCK == 0:
                t = q4_0_grid(t)
            else:
                t = bf16(t)
            state[name] = np.ascontiguousarray(t)
        save_file(state, dst / f.name, metadata={"format": "pt"})
    return dst


def corpus(path: Path, words: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(rng.choice(WORDS, words)) + ".")
    return path


def measure(ckpt: Path, out: Path, text: Path, quant: str, bits: int, context: int) -> dict:
    from gemma_ane.convert import ConvertOptions, convert
    from gemma_ane.files import tree_size
    from gemma_ane.oracle.evaluate import evaluate

    t0 = time.perf_counter()
    convert(str(ckpt), str(out), ConvertOptions(context=context, bits=bits, quant=quant, vision=False), progress=False)
    seconds = time.perf_counter() - t0
    report = evaluate(ckpt, out, text, context=context, stride=context // 2, precision="fp32")
    chunks = sum(tree_size(p) for p in out.glob("chunk_*"))
    return {**report, "quant": quant, "bits": bits, "chunk_bytes": chunks, "convert_seconds": seconds}


def table(rows: list[dict]) -> str:
    lines = [
        "| checkpoint | mode | chunks MB | KLD mean | KLD p99 | KLD max | top-1 | ppl ref | ppl bundle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = "fp16" if r["bits"] == 16 else f"{r['quant']} {r['bits']}-bit"
        lines.append(
            f"| {r['checkpoint']} | {mode} | {r['chunk_bytes'] / 1e6:.2f} | {r['kld_mean']:.3g} | {r['kld_p99']:.3g} "
            f"| {r['kld_max']:.3g} | {r['top1_agreement']:.4f} | {r['ppl_reference']:.4g} | {r['ppl_bundle']:.4g} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="e2b-mini")
    p.add_argument("--work", help="keep checkpoints and bundles here (default: a temporary directory)")
    p.add_argument("--words", type=int, default=120, help="words of text evaluated (default 120: 333 tokens)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quick", action="store_true", help="block 4-bit on the grid checkpoint only, a short text")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md")
    args = p.parse_args(argv)

    from gemma_ane.oracle.tiny import write_tiny

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        plain = work / f"{args.preset}"
        if not plain.exists():
            write_tiny(plain, preset=args.preset)
        grid = work / f"{args.preset}-q4_0-grid"
        if not grid.exists():
            move_onto_grid(plain, grid)
        text = corpus(work / "text.txt", 60 if args.quick else args.words)
        cases = [(grid, "block", 4)] if args.quick else [(c, q, b) for c in (plain, grid) for q, b in MODES]
        rows = []
        for ckpt, quant, bits in cases:
            out = work / f"{ckpt.name}.{quant}{bits}"
            if out.exists():
                import shutil

                shutil.rmtree(out)
            rows.append({"checkpoint": ckpt.name, **measure(ckpt, out, text, quant, bits, args.context)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    r = rows[0]
    body = (
        f"`gemma-ane eval --precision fp32` over {r['tokens']} tokens (context {r['context']}, stride "
        f"{r['stride']}); chunks MB: the three chunk packages on disk.\n\n{table(rows)}"
    )
    publish(f"What each weight compression costs ({args.preset} and its q4_0-grid variant)", body, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
