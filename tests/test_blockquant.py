"""Block-wise linear quantization (`gemma_ane.convert.blockquant`): a weight already on q4_0's grid comes back bit
for bit, any other weight within half a step, and the MIL op it is stored as runs in our executor as numpy
dequantizes it."""

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from gemma_ane.convert.blockquant import blockwise_weight, dequantize_blockwise, quantize_blockwise
from gemma_ane.mil.executor import MILModel


def bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bfloat16 (to nearest, ties to even), as a bf16 checkpoint stores them."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def on_grid(out: int, cols: int, nbits: int, group_size: int, seed: int):
    """A weight as q4_0 (q8_0 for 8 bits, with its most negative integer) leaves it: integers in the signed range,
    each block holding its scale's owner at the most negative integer, times one scale a block of either sign
    (bf16 values within fp16's normal range, as a QAT checkpoint's scales are)."""
    rng = np.random.default_rng(seed)
    low, high = -(1 << (nbits - 1)), (1 << (nbits - 1)) - 1
    k = rng.integers(low, high + 1, size=(out, cols // group_size, group_size))
    owner = rng.integers(0, group_size, (out, cols // group_size))
    k[np.arange(out)[:, None], np.arange(cols // group_size), owner] = low
    scale = bf16(rng.choice([-1, 1], (out, cols // group_size)) * 10 ** rng.uniform(-4, -1, (out, cols // group_size)))
    return k.reshape(out, cols), scale


@pytest.mark.parametrize("nbits", [4, 8])
def test_a_weight_on_the_grid_round_trips_bit_exactly(nbits):
    k, d = on_grid(64, 256, nbits, 32, seed=nbits)
    w = k * np.repeat(d, 32, axis=1)  # exact in fp32: a bf16 scale times an integer of at most 8 bits
    q, scale = quantize_blockwise(w, nbits, 32)
    assert q.dtype == np.int8 and q.shape == (64, 256) and scale.dtype == np.float16 and scale.shape == (64, 8)
    np.testing.assert_array_equal(q, k)
    np.testing.assert_array_equal(scale.view(np.uint16), d.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(dequantize_blockwise(q, scale), w)
    # the QAT checkpoint stores k * d rounded to bf16: the same integers and scales come back
    q, scale = quantize_blockwise(bf16(w), nbits, 32)
    np.testing.assert_array_equal(q, k)
    np.testing.assert_array_equal(scale.view(np.uint16), d.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("nbits", [4, 8])
def test_any_weight_lands_within_half_a_step(nbits):
    rng = np.random.default_rng(3)
    w = (rng.standard_t(5, size=(48, 128)) * rng.uniform(0.01, 0.05, (48, 1))).astype(np.float16).astype(np.float32)
    q, scale = quantize_blockwise(w, nbits, 16)
    assert q.min() >= -(1 << (nbits - 1)) and q.max() <= (1 << (nbits - 1)) - 1
    step = np.abs(np.repeat(scale.astype(np.float32), 16, axis=1))
    err = np.abs(dequantize_blockwise(q, scale) - w)
    # rounding: half a step; only a weight of the peak's magnitude and opposite sign is clipped, by one step
    clipped = q == (1 << (nbits - 1)) - 1
    assert (err[~clipped] <= 0.5 * step[~clipped] * (1 + 1e-3)).all()
    assert (err <= step * (1 + 1e-3)).all()
    # every block spends its most negative integer on its largest-magnitude weight
    blocks = np.abs(w).reshape(48, 8, 16).argmax(-1)
    assert (np.take_along_axis(q.reshape(48, 8, 16), blocks[..., None], -1) == -(1 << (nbits - 1))).all()


def test_edge_cases_and_refusals():
    w = np.zeros((4, 64), np.float32)
    w[0, :32] = np.linspace(-1, 1, 32)
    q, scale = quantize_blockwise(w)
    assert (scale[1:] == 0).all() and scale[0, 1] == 0 and scale[0, 0] != 0
    np.testing.assert_array_equal(q[1:], 0)
    assert np.isfinite(dequantize_blockwise(q, scale)).all()
    with pytest.raises(ValueError, match="not divisible by group_size 32"):
        quantize_blockwise(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_blockwise(np.full((4, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="nbits=6: choose 4 or 8"):
        quantize_blockwise(np.zeros((4, 32), np.float32), nbits=6)
    with pytest.raises(ValueError, match=r"shape \(32,\): expected \[out, in\]"):
        quantize_blockwise(np.zeros(32, np.float32))


@pytest.mark.parametrize("nbits", [4, 8])
def test_the_mil_op_runs_in_our_executor_as_numpy_dequantizes(tmp_path, nbits):
    from coremltools.converters.mil.frontend.milproto.load import load

    rng = np.random.default_rng(nbits)
    w = rng.standard_normal((48, 64)).astype(np.float32) * 0.05
    q, scale = quantize_blockwise(w, nbits, 32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(64, 64), dtype=types.fp16)], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.linear(x=x, weight=blockwise_weight(q, scale, nbits, name="w"), name="y")

    path = tmp_path / "block.mlpackage"
    ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    ).save(str(path))
    spec = ct.utils.load_spec(str(path))
    saved = load(spec, spec.specificationVersion, str(path / "Data/com.apple.CoreML/weights"))
    (op,) = [o for o in saved.functions["main"].operations if o.op_type == "constexpr_blockwise_shift_scale"]
    assert types.builtin_to_string(op.data.dtype) == f"int{nbits}" and op.offset is None
    np.testing.assert_array_equal(op.data.val, q)
    np.testing.assert_array_equal(op.scale.val, scale)
    # x = I: row i of y is column i of the weight Core ML decompresses (fp16, the scale's type), exactly
    y = MILModel(path).predict({"x": np.eye(64, dtype=np.float16)})["y"]
    np.testing.assert_array_equal(y, dequantize_blockwise(q, scale).astype(np.float16).T)
