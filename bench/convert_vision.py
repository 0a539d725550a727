"""The vision model (vision.mlpackage) at E2B's real shapes, on random weights: parameters, package size per bit
width, MACs per image, conversion time and peak memory, the Neural Engine audit, and how far each width moves the
soft tokens (MIL executor against the fp32 PyTorch model, one image).

    python bench/convert_vision.py /tmp/e2b-vision            # ~20 min; the checkpoint is written there once
    python bench/convert_vision.py /tmp/e2b-vision --bits 8   # one width
    python bench/convert_vision.py /tmp/e2b-vision --quick    # a toy vision tower, for a smoke run

The checkpoint: the Hub's E2B config.json with its vision_config as it is, no audio tower, and the text model at
make_full_checkpoint's --quick widths but E2B's hidden size (1536, what the projection writes into); random weights
at trained scales, bf16. Each conversion and each executor run is a child process, so its time and peak RSS are its
own (the executor needs ~14 GiB at E2B's shapes).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import publish  # noqa: E402
from make_full_checkpoint import QUICK, hub_config, scale_of  # noqa: E402

BUDGET = 280  # E2B's default soft-token budget
GiB = 2**30


def write_checkpoint(out: Path, quick: bool) -> None:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from gemma_ane.oracle.tiny import VISION, _save, checkpoint_dir

    config = hub_config("e2b", quick=False)
    config["text_config"].update(QUICK, hidden_size=1536 if not quick else 64)
    config.pop("audio_config", None)
    if quick:
        config["vision_config"].update(VISION)  # tiny.py's tower
    model = Gemma4ForConditionalGeneration(Gemma4Config(**{**config, "audio_config": None})).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("_min", "_max")):  # clip bounds: wide enough to bite rarely
                t.fill_(math.copysign(float(torch.rand((), generator=g)) * 5 + 5, 1 if name.endswith("_max") else -1))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # The attention scale is 1.0: with these near 1, q.k over 64 dims has a std of ~8 and the softmax
                # over 2,520 patches is nearly one-hot, chaotic under any rounding (PyTorch itself in fp16: cosine
                # 0.87 against fp32). A trained tower runs in bf16, so it cannot be that sensitive.
                t.copy_(torch.rand(t.shape, generator=g) * 0.2 + 0.3)
            elif t.is_floating_point() and "rotary_emb" not in name and "embed_scale" not in name:
                kind, a, b = scale_of(name)
                t.copy_(
                    torch.rand(t.shape, generator=g) * (b - a) + a
                    if kind == "uniform"
                    else torch.randn(t.shape, generator=g) * a
                )
    with checkpoint_dir(out, config["text_config"]["vocab_size"]) as tmp:
        _save(model, tmp, torch.bfloat16, 1)


def child(ckpt: str, out: str, bits: int) -> None:
    """One conversion; its figures as a JSON line on stdout."""
    from gemma_ane.bundle.layout import VISION_POSITION_TABLE
    from gemma_ane.convert import ConvertOptions, StageTimer
    from gemma_ane.convert.vision import convert_vision
    from gemma_ane.files import tree_size
    from gemma_ane.mil.package import Package, macs, weight_bytes
    from gemma_ane.runtime.audit import audit_package

    timer, t0 = StageTimer(), time.perf_counter()
    Path(out).mkdir(parents=True)
    path = convert_vision(ckpt, ConvertOptions(bits=bits), Path(out), timer, image_tokens=BUDGET)
    figures = {
        "seconds": time.perf_counter() - t0,
        "stages": timer.seconds,
        "peak_rss": max(timer.peak_rss.values(), default=0),
        "size": tree_size(path),
        "table": (Path(out) / VISION_POSITION_TABLE).stat().st_size,
    }
    fn = Package.open(path).program().functions["encode"]
    audit = audit_package(path)
    findings = audit["functions"]["encode"]["findings"]
    violations = "; ".join(f"{f['rule']}: {f['detail']}" for f in findings if f["verdict"] == "violation")
    figures.update(macs=macs(fn), weight_bytes=weight_bytes(fn), audit=audit["verdict"], violations=violations)
    print(json.dumps(figures))


def run_child(ckpt: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, str(ckpt), *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_image(ckpt: Path):
    """One 640x480 picture (smooth colour fields and noise) as `encode`'s inputs, and its Patches."""
    from PIL import Image

    from gemma_ane.convert.vision import open_vision
    from gemma_ane.runtime.encoder import encoder_inputs
    from gemma_ane.runtime.images import preprocess

    spec, c = open_vision(ckpt, BUDGET)
    try:
        table = c["model.vision_tower.patch_embedder.position_embedding_table"]
    finally:
        c.close()
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640] / 640
    base = np.stack([np.sin(9 * x + k) * np.cos(6 * y - k) for k in range(3)], axis=-1)
    pixels = np.clip(127.5 * (1 + 0.8 * base) + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    p = preprocess(Image.fromarray(pixels), BUDGET, spec.patch_size, spec.pooling_kernel_size)
    return encoder_inputs(p, table, spec.head_dim, spec.rope_theta, spec.pooling_kernel_size), p


def reference(ckpt: Path, path: Path) -> None:
    """The fp32 PyTorch model's soft tokens for test_image, saved for the executor runs to compare with."""
    import torch

    from gemma_ane.convert.models.vision import load_vision
    from gemma_ane.convert.vision import open_vision

    inputs, p = test_image(ckpt)
    spec, c = open_vision(ckpt, BUDGET)
    try:
        model = load_vision(c, spec, BUDGET)
    finally:
        c.close()
    with torch.no_grad():
        (out,) = model(*(torch.from_numpy(np.asarray(inputs[n], np.float32)) for n in model.input_names))
    np.save(path, out[0, : p.soft_tokens].numpy())


def quality(ckpt: Path, package: str, ref: str) -> None:
    """One executor run of test_image against the reference, in its own process: cosines, time, peak RSS."""
    from gemma_ane.runtime.backend import MILBackend

    inputs, p = test_image(ckpt)
    t0 = time.perf_counter()
    out = MILBackend(Path(package), "fp16").predict("encode", inputs, None)["image_embeds"][0, : p.soft_tokens]
    seconds, a, b = time.perf_counter() - t0, out.astype(np.float64), np.load(ref)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"min": cos.min(), "mean": cos.mean(), "seconds": seconds, "peak_rss": rss, "grid": p.grid}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", help="directory for the checkpoint (written once) and the packages")
    p.add_argument("--quick", action="store_true", help="a toy vision tower instead of E2B's")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # convert into this directory
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4], help="bit widths to convert (default 16 8 4)")
    p.add_argument("--quality", nargs=2, help=argparse.SUPPRESS)  # run this package, compare with this reference
    a = p.parse_args(argv)
    if a.child:
        return child(a.work, a.child, a.bits[0])
    if a.quality:
        return quality(a.work, *a.quality)
    work = Path(a.work)
    ckpt = work / ("ckpt-quick" if a.quick else "ckpt")
    if not ckpt.exists():
        t0 = time.perf_counter()
        write_checkpoint(ckpt, a.quick)
        print(f"checkpoint written in {time.perf_counter() - t0:.0f} s: {ckpt}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = {
        bits: run_child(ckpt, "--child", str(work / f"vision{bits}-{stamp}"), "--bits", str(bits)) for bits in a.bits
    }
    reference(ckpt, work / f"reference-{stamp}.npy")
    for bits, r in runs.items():
        package = work / f"vision{bits}-{stamp}" / "vision.mlpackage"
        r["quality"] = run_child(ckpt, "--quality", str(package), str(work / f"reference-{stamp}.npy"))

    from gemma_ane.convert.checkpoint import Checkpoint

    c = Checkpoint(ckpt)
    shapes = {
        n: e["shape"] for n, (_, e) in c.entries.items() if n.startswith(("model.vision_tower", "model.embed_vision"))
    }
    c.close()
    params = sum(int(np.prod(s)) for n, s in shapes.items() if not n.endswith(("_min", "_max")))
    table = int(np.prod(shapes["model.vision_tower.patch_embedder.position_embedding_table"]))
    first = next(iter(runs.values()))
    grid = first["quality"]["grid"]
    lines = [
        f"{'toy' if a.quick else 'E2B'} vision tower, budget {BUDGET} soft tokens ({BUDGET * 9} patches), "
        f"a 640x480 image: {grid[0]}x{grid[1]} patches -> {grid[0] * grid[1] // 9} soft tokens",
        f"- parameters: {params:,} ({params - table:,} in the package, {table:,} in the position table, of which "
        f"the host's sidecar keeps the rows a budget reaches)",
        f"- MACs per image: {first['macs'] / 1e9:.1f} G",
    ]
    for bits, r in runs.items():
        stages, q = ", ".join(f"{k} {v:.0f} s" for k, v in r["stages"].items()), r["quality"]
        lines += [
            f"- {bits} bits: vision.mlpackage {r['size'] / 1e6:.1f} MB, weights {r['weight_bytes'] / 1e6:.1f} MB "
            f"(+ position sidecar {r['table'] / 1e6:.1f} MB)",
            f"  - converted in {r['seconds']:.0f} s ({stages}), peak RSS {r['peak_rss'] / GiB:.2f} GiB",
            f"  - ANE audit: {r['audit']}" + (f" ({r['violations']})" if r["violations"] else ""),
            f"  - soft tokens vs fp32 PyTorch: min cosine {q['min']:.5f}, mean {q['mean']:.5f} (MIL executor: "
            f"{q['seconds']:.0f} s, peak RSS {q['peak_rss'] / GiB:.1f} GiB)",
        ]
    publish("vision model at E2B's shapes", "\n".join(lines), a)


if __name__ == "__main__":
    main()
