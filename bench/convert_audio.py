"""The audio model (audio.mlpackage) at E2B's real shapes, on random weights: parameters, package size per bit
width, MACs per second of audio, conversion time and peak memory, the Neural Engine audit, and how far the width
moves the soft tokens (MIL executor against the fp32 PyTorch model, one clip).

    python bench/convert_audio.py /tmp/e2b-audio              # 8 bits, one 10 s bucket
    python bench/convert_audio.py /tmp/e2b-audio --bits 16 8  # more widths
    python bench/convert_audio.py /tmp/e2b-audio --quick      # the tiny preset's tower, for a smoke run

The tower: /work/shared's E2B audio_config (tests/fixtures/e2b_config.json, the same file) into E2B's text width
(1536), built in memory at random weights of trained-like scales (tiny.py's _randomize_audio rules, clip bounds
that bite rarely), no checkpoint written: the weights are the only input the converter reads from one. It converts
through the converter's own path (convert.audio.trace, coreml.save_functions: what `convert` runs per bucket) with
one bucket, since the cost is linear in the frames (the attention is local). Each conversion and executor run is a
child process, so its time and peak RSS are its own.
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

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 10.0  # the bucket converted: options.AUDIO_BUCKET_SECONDS' middle one
GiB = 2**30


def spec_of(quick: bool):
    from gemma_ane.convert.models.audio import AudioSpec
    from gemma_ane.oracle.tiny import AUDIO

    config = json.loads((ROOT / "tests" / "fixtures" / "e2b_config.json").read_text())
    if quick:
        config["audio_config"].update(AUDIO)
    return AudioSpec.from_config(config)


def frames_of(spec) -> int:
    from gemma_ane.convert.audio import buckets

    return buckets(spec, [SECONDS])[0]


def tower(quick: bool, seed: int = 0):
    """The AudioModel at one bucket, its weights random at tiny.py's scales (fan-in-scaled projections, norm
    weights 0.5..2, an output bias) with clip bounds at 5..10 (activations are ~unit scale: they bite rarely)."""
    import torch

    from gemma_ane.convert.models.audio import AudioModel, load_audio_tower

    spec = spec_of(quick)
    frames = frames_of(spec)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in AudioModel(spec, frames).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            value = torch.rand(shape, generator=g) * 1.5 + 0.5
        elif name.endswith("per_dim_scale"):
            value = torch.randn(shape, generator=g)
        elif name.endswith(("_min", "_max")):
            value = math.copysign(float(torch.rand((), generator=g)) * 5 + 5, 1 if name.endswith("_max") else -1)
            value = torch.tensor(value)
        elif name.endswith("bias"):
            value = torch.randn(shape, generator=g) * 0.5
        else:
            value = torch.randn(shape, generator=g) / math.sqrt(max(1, int(np.prod(shape[1:]))))
        state["model." + name] = value.numpy()
    model = load_audio_tower(state, spec, frames)
    del state
    return model, spec, frames


def test_clip(spec, frames: int):
    """A chirp with noise filling the bucket: the encoder's inputs and the clip's soft-token count."""
    from gemma_ane.runtime import audio

    n = round(SECONDS * audio.SAMPLE_RATE)
    t = np.arange(n) / audio.SAMPLE_RATE
    x = 0.4 * np.sin(2 * np.pi * (150 + 200 * t) * t) + 0.05 * np.random.default_rng(0).standard_normal(n)
    p = audio.preprocess(x.astype(np.float32), frames)
    inputs = {"input_features": p.features[None], "input_features_mask": p.mask[None].astype(np.float32)}
    return inputs, p.soft_tokens


def child(out: str, bits: int, quick: bool) -> None:
    """One conversion, and the fp32 reference of test_clip; its figures as a JSON line on stdout."""
    import torch

    from gemma_ane.bundle import schema
    from gemma_ane.convert import ConvertOptions, StageTimer, coreml
    from gemma_ane.convert.audio import trace
    from gemma_ane.files import tree_size
    from gemma_ane.mil.package import Package, macs, weight_bytes
    from gemma_ane.runtime.audit import audit_package

    timer, t0 = StageTimer(), time.perf_counter()
    model, spec, frames = tower(quick)
    inputs, tokens = test_clip(spec, frames)
    with torch.no_grad():
        (ref,) = model(*(torch.from_numpy(inputs[n]) for n in model.input_names))
    np.save(Path(out).with_suffix(".npy"), ref[0, :tokens].numpy())
    params = sum(p.numel() for p in model.parameters())
    function = schema.audio_function(frames, [frames])
    Path(out).mkdir(parents=True)
    path = coreml.save_functions(
        [(function, trace(model, timer))], function, schema.AUDIO, ConvertOptions(bits=bits), Path(out), timer, False
    )
    del model
    fn = Package.open(path).program().functions[function]
    audit = audit_package(path)
    findings = audit["functions"][function]["findings"]
    violations = "; ".join(f"{f['rule']}: {f['detail']}" for f in findings if f["verdict"] == "violation")
    figures = {
        "seconds": time.perf_counter() - t0,
        "stages": timer.seconds,
        "peak_rss": max(timer.peak_rss.values(), default=0),
        "size": tree_size(path),
        "params": params,
        "frames": frames,
        "function": function,
        "macs": macs(fn),
        "weight_bytes": weight_bytes(fn),
        "audit": audit["verdict"],
        "violations": violations,
    }
    print(json.dumps(figures))


def quality(package: str, function: str, quick: bool) -> None:
    """One executor run of test_clip against the child's fp32 reference: row cosines, time, peak RSS."""
    from gemma_ane.runtime.backend import MILBackend

    spec = spec_of(quick)
    inputs, tokens = test_clip(spec, frames_of(spec))
    t0 = time.perf_counter()
    out = MILBackend(Path(package), "fp16").predict(function, inputs, None)["audio_embeds"][0, :tokens]
    seconds = time.perf_counter() - t0
    a, b = out.astype(np.float64), np.load(Path(package).parent.with_suffix(".npy")).astype(np.float64)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"min": cos.min(), "mean": cos.mean(), "rel": rel, "seconds": seconds, "peak_rss": rss}))


def run_child(work: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, str(work), *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", help="directory for the packages")
    p.add_argument("--quick", action="store_true", help="the tiny preset's audio tower instead of E2B's")
    p.add_argument("--record", action="store_true", help="append the figures to BENCHMARKS.md (default: print only)")
    p.add_argument("--bits", type=int, nargs="+", default=[8], help="bit widths to convert (default 8)")
    p.add_argument("--no-quality", action="store_true", help="skip the executor run against fp32")
    p.add_argument("--child", help=argparse.SUPPRESS)  # convert into this directory
    p.add_argument("--quality", nargs=2, help=argparse.SUPPRESS)  # run this package's function
    a = p.parse_args(argv)
    quick = ["--quick"] if a.quick else []
    if a.child:
        return child(a.child, a.bits[0], a.quick)
    if a.quality:
        return quality(*a.quality, a.quick)
    work, stamp = Path(a.work), time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    for bits in a.bits:
        out = work / f"audio{bits}-{stamp}"
        runs[bits] = r = run_child(work, "--child", str(out), "--bits", str(bits), *quick)
        if not a.no_quality:
            r["quality"] = run_child(work, "--quality", str(out / "audio.mlpackage"), r["function"], *quick)
    first = next(iter(runs.values()))
    seconds = first["frames"] / 100  # 10 ms a mel frame
    lines = [
        f"{'tiny' if a.quick else 'E2B'} audio tower, one bucket of {first['frames']} mel frames ({seconds:.2f} s), "
        f"random weights",
        f"- parameters: {first['params']:,}",
        f"- MACs: {first['macs'] / 1e9:.3g} G a bucket, {first['macs'] / seconds / 1e9:.3g} G per second of audio",
    ]
    for bits, r in runs.items():
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stages"].items())
        lines += [
            f"- {bits} bits: audio.mlpackage {r['size'] / 1e6:.1f} MB, weights {r['weight_bytes'] / 1e6:.1f} MB",
            f"  - converted in {r['seconds']:.0f} s ({stages}), peak RSS {r['peak_rss'] / GiB:.2f} GiB",
            f"  - ANE audit: {r['audit']}" + (f" ({r['violations']})" if r["violations"] else ""),
        ]
        if "quality" in r:
            q = r["quality"]
            lines.append(
                f"  - soft tokens vs fp32 PyTorch: min cosine {q['min']:.5f}, mean {q['mean']:.5f}, max error "
                f"{q['rel']:.2e} of the largest (MIL executor: {q['seconds']:.0f} s, peak RSS "
                f"{q['peak_rss'] / GiB:.2f} GiB)"
            )
    publish("audio model at E2B's shapes", "\n".join(lines), a)


if __name__ == "__main__":
    main()
