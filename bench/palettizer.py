"""Our k-means LUT palettizer vs coremltools' kmeans palettization, on E2B-shaped weights.

    python bench/palettizer.py            # one weight of each E2B projection shape + the LM head
    python bench/palettizer.py --quick    # small shapes, for the test suite

Prints time and reconstruction SNR for both and their ratio, extrapolates both to the whole model,
and, with --record, appends the table to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402

from gemma_ane.convert.palettize import kmeans_lut, lut_to_dense, snr_db  # noqa: E402

# (name, [out, in], how many in E2B): layers 0-14 MLP 6144, 15-34 double-wide 12288
E2B = [
    ("q_proj sliding", (2048, 1536), 28),
    ("q_proj full", (4096, 1536), 7),
    ("k/v_proj sliding", (256, 1536), 24),
    ("k/v_proj full", (512, 1536), 6),
    ("o_proj sliding", (1536, 2048), 28),
    ("o_proj full", (1536, 4096), 7),
    ("gate/up_proj", (6144, 1536), 30),
    ("gate/up_proj wide", (12288, 1536), 40),
    ("down_proj", (1536, 6144), 15),
    ("down_proj wide", (1536, 12288), 20),
    ("per_layer_input_gate", (256, 1536), 35),
    ("per_layer_projection", (1536, 256), 35),
    ("per_layer_model_projection", (8960, 1536), 1),
    ("lm_head", (262144, 1536), 1),
]
QUICK = [("small", (256, 512), 1), ("wide", (512, 1536), 1)]


def coremltools_kmeans(w, nbits, group):
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    return palettize_weights.decompress(palettize_weights.grouped_channelwise_compress(w, "KMEANS", nbits, 0, group))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument(
        "--ct-rows",
        type=int,
        default=512,
        help="coremltools is timed on the first N rows of each weight and scaled (it is ~per group)",
    )
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    coremltools_kmeans(rng.standard_normal((a.group_size, 64)).astype(np.float32), a.bits, a.group_size)  # imports
    rows, ours_total, ct_total = [], 0.0, 0.0
    for name, shape, count in QUICK if a.quick else E2B:
        # trained-weight-like: heavy tails, per-row scales around std 0.02-0.05
        w = (
            (rng.standard_t(5, size=shape) * rng.uniform(0.01, 0.03, size=(shape[0], 1)))
            .astype(np.float16)
            .astype(np.float32)
        )
        kmeans_lut(w[: a.group_size], a.bits, a.group_size)  # warm-up
        t = time.perf_counter()
        lut, idx = kmeans_lut(w, a.bits, a.group_size)
        t_ours = time.perf_counter() - t
        sub = w[: min(a.ct_rows, shape[0])]
        t = time.perf_counter()
        dense = coremltools_kmeans(sub, a.bits, a.group_size)
        t_ct = (time.perf_counter() - t) * shape[0] / sub.shape[0]
        snr_ours = snr_db(sub, lut_to_dense(lut, idx)[: sub.shape[0]])
        snr_ct = snr_db(sub, dense)
        ours_total += t_ours * count
        ct_total += t_ct * count
        rows.append(
            f"| {name} | {shape[0]}x{shape[1]} | {t_ours:.3f} | {t_ct:.2f} | {t_ct / t_ours:.1f}x | "
            f"{snr_ours:.2f} | {snr_ct:.2f} | {snr_ours - snr_ct:+.2f} |"
        )
    table = "\n".join(
        [
            f"bits {a.bits}, group {a.group_size}; coremltools timed on {a.ct_rows} rows per weight and scaled",
            "",
            "| weight | shape | ours s | coremltools s | speed-up | ours SNR dB | coremltools SNR dB | diff |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"whole model ({'quick shapes' if a.quick else 'E2B'}): ours {ours_total:.1f} s, "
            f"coremltools {ct_total:.1f} s, "
            f"speed-up {ct_total / ours_total:.1f}x",
        ]
    )
    publish("palettizer", table, a)


if __name__ == "__main__":
    main()
