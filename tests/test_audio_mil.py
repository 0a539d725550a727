"""The audio tower as an ML Program: the MIL executor's ops it needs (pad, conv, layer_norm) against torch, then the
tiny tower converted by coremltools and run by the executor against transformers, at fp32 and fp16."""

import json
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from gemma_ane.convert.audio import convert_audio_tower
from gemma_ane.convert.models.audio import AudioSpec, load_audio_tower
from gemma_ane.mil.executor import MILModel
from gemma_ane.oracle.tiny import build_model
from gemma_ane.runtime import audio

FP32 = types.fp32


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two busy cores: a second torch thread only spin-waits
    yield
    torch.set_num_threads(before)


def run(prog, path: Path, **inputs) -> np.ndarray:
    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT32,
        skip_model_load=True,
    )
    model.save(str(path))
    (out,) = MILModel(path, precision="fp32").predict(inputs).values()
    return out


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad(tmp_path, mode):
    x = randn(2, 3, 5)

    @mb.program(input_specs=[mb.TensorSpec(shape=x.shape, dtype=FP32)], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.pad(x=x, pad=np.array([1, 2, 0, 3], np.int32), mode=mode, constant_val=1.5)

    torch_mode = {"constant": "constant", "reflect": "reflect", "replicate": "replicate"}[mode]
    t = torch.from_numpy(x)
    want = (
        F.pad(t, (0, 3, 1, 2), mode=torch_mode, value=1.5) if mode == "constant" else F.pad(t, (0, 3, 1, 2), torch_mode)
    )
    assert np.array_equal(run(prog, tmp_path / "p.mlpackage", x=x), want.numpy())


CONVS = {  # name: (x shape, weight shape, MIL conv arguments, torch conv arguments)
    "2d stride 2 pad 1": ((1, 1, 11, 16), (6, 1, 3, 3), dict(strides=[2, 2], pad_type="custom", pad=[1, 1, 1, 1])),
    "2d groups 2 bias": ((1, 4, 7, 9), (6, 2, 3, 2), dict(groups=2, pad_type="valid", bias=True)),
    "2d same dilated": ((1, 3, 8, 8), (2, 3, 3, 3), dict(pad_type="same", dilations=[2, 1])),
    "1d depthwise": ((1, 5, 13), (5, 1, 4), dict(groups=5, pad_type="custom", pad=[3, 0])),
    "1d same_lower stride 2": ((1, 2, 10), (3, 2, 4), dict(pad_type="same_lower", strides=[2])),
}


def torch_conv(x, w, bias, strides=None, pad_type="valid", pad=None, dilations=None, groups=1):
    n = x.dim() - 2
    strides, dilations = strides or [1] * n, dilations or [1] * n
    if pad_type == "custom":
        widths = pad
    else:  # MIL's same: the total padding split evenly, the odd one after (same_lower: before)
        widths = []
        for size, st, k, d in zip(x.shape[2:], strides, w.shape[2:], dilations):
            total = max((-(-size // st) - 1) * st + (k - 1) * d + 1 - size, 0)
            lo, hi = total // 2, total - total // 2
            widths += [lo, hi] if pad_type == "same" else [hi, lo]
        widths = widths if pad_type != "valid" else [0] * 2 * n
    flat = [v for i in reversed(range(n)) for v in widths[2 * i : 2 * i + 2]]  # torch pads the last axis first
    conv = F.conv2d if n == 2 else F.conv1d
    return conv(F.pad(x, flat), w, bias, stride=strides, dilation=dilations, groups=groups)


@pytest.mark.parametrize("name", list(CONVS))
def test_conv(tmp_path, name):
    xs, ws, args = CONVS[name]
    x, w = randn(*xs), randn(*ws, seed=1)
    args = dict(args)
    bias = randn(ws[0], seed=2) if args.pop("bias", False) else None

    @mb.program(input_specs=[mb.TensorSpec(shape=xs, dtype=FP32)], opset_version=ct.target.iOS18)
    def prog(x):
        kw = {k: np.array(v, np.int32) if isinstance(v, list) else v for k, v in args.items()}
        return mb.conv(x=x, weight=w, bias=bias, **kw)

    want = torch_conv(
        torch.from_numpy(x), torch.from_numpy(w), None if bias is None else torch.from_numpy(bias), **args
    )
    got = run(prog, tmp_path / "p.mlpackage", x=x)
    assert got.shape == tuple(want.shape)
    assert np.abs(got - want.numpy()).max() < 1e-5


@pytest.mark.parametrize("axes", [[1], [-1], [2, 3]])
def test_layer_norm(tmp_path, axes):
    x = randn(2, 6, 5, 4) * 3 + 1
    shape = [x.shape[a] for a in axes]
    gamma, beta = randn(*shape, seed=1), randn(*shape, seed=2)

    @mb.program(input_specs=[mb.TensorSpec(shape=x.shape, dtype=FP32)], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.layer_norm(x=x, axes=axes, gamma=gamma, beta=beta, epsilon=1e-3)

    t = torch.from_numpy(x).double()
    dims = [a % 4 for a in axes]
    d = t - t.mean(dims, keepdim=True)
    want = d / torch.sqrt((d * d).mean(dims, keepdim=True) + 1e-3)
    bshape = [x.shape[i] if i in dims else 1 for i in range(4)]
    want = want * torch.from_numpy(gamma).double().reshape(bshape) + torch.from_numpy(beta).double().reshape(bshape)
    assert np.abs(run(prog, tmp_path / "p.mlpackage", x=x) - want.numpy()).max() < 1e-5


# -- the tower --------------------------------------------------------------------------------------------------

FRAMES = 96
LENGTHS = [161, 7919, 15200]  # 1, 13 and 24 soft tokens: one frame, mid-block, the bucket filled


@pytest.fixture(scope="module")
def tower():
    oracle = build_model("e2b-audio-mini")
    spec = AudioSpec.from_config(oracle.config.to_dict())
    state = {k: v.numpy() for k, v in oracle.state_dict().items() if "audio" in k}
    return oracle, load_audio_tower(state, spec, FRAMES)


def clip(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    t = np.arange(n) / audio.SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * (150 + 400 * t) * t) + 0.05 * rng.standard_normal(n)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("precision,max_err,min_cos", [("fp32", 1e-5, 0.999999), ("fp16", 5e-3, 0.99999)])
def test_converted_tower_equals_transformers(tower, tmp_path, precision, max_err, min_cos):
    """fp16 on the executor (fp16 between ops, fp32 inside them) measured on the tiny tower: relative error
    1.2e-3 .. 4.2e-3 over six clip lengths, row cosine >= 0.99999."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    oracle, model = tower
    path = convert_audio_tower(model, tmp_path / "audio.mlpackage", precision)
    mil = MILModel(path, precision=precision)
    dtype = np.float16 if precision == "fp16" else np.float32
    for n in LENGTHS:
        x = clip(n)
        f = Gemma4AudioFeatureExtractor()([x], return_tensors="pt")
        with torch.no_grad():
            out = oracle.model.get_audio_features(f["input_features"], f["input_features_mask"])
        want = out.pooler_output[out.attention_mask].numpy()
        p = audio.preprocess(x, frames=FRAMES)
        inputs = {"input_features": p.features[None].astype(dtype), "input_features_mask": p.mask[None].astype(dtype)}
        got = mil.predict(inputs)["audio_embeds"][0, : p.soft_tokens].astype(np.float32)
        assert got.shape == want.shape
        assert np.abs(got - want).max() / np.abs(want).max() < max_err, n
        cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
        assert cos.min() > min_cos, n


def test_spec_reads_e2b_config():
    config = json.loads((Path(__file__).parent / "fixtures" / "e2b_config.json").read_text())
    spec = AudioSpec.from_config(config)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.head_dim) == (1024, 12, 8, 128)
    assert (spec.chunk, spec.past, spec.context, spec.conv_channels) == (12, 12, 24, (128, 32))
    assert (spec.output_proj_dims, spec.text_hidden_size, spec.clipped) == (1536, 1536, True)
