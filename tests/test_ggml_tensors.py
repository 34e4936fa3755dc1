"""Round trips numpy -> backend tensor -> numpy for every type pytrain moves.

Exact types must come back bit for bit.  BF16 must equal round-to-nearest-even of the float32
input (computed here independently with integer arithmetic).  Quantized types come back
through ggml's own dequantization; the bound is a fraction of each block's largest magnitude,
chosen from the format's bit width (Q8_0: 1/127 of the block max, Q4_0: 1/7, ...) with a
little slack, and the test also checks the error is not zero (the data really was quantized).
"""
import numpy as np
import pytest

from pytrain import ggml
from pytrain.ggml import ffi, lib

EXACT = {"f32": np.float32, "f16": np.float16, "i32": np.int32}
# type -> max |error| / block absmax (block = 32 values; K-quants use 256-value super-blocks).
# Q4_0/Q5_0 map the block max to -8/-16 and clip the other side at +7/+15: up to one step.
QUANT_BOUND = {"q8_0": 0.6 / 127, "q4_0": 1.05 / 8, "q4_1": 0.6 / 7.5, "q5_0": 1.05 / 16,
               "q5_1": 0.6 / 15.5, "q2_K": 0.6, "q3_K": 0.3, "q4_K": 0.15, "q5_K": 0.075,
               "q6_K": 0.04}


@pytest.fixture(scope="module")
def rt():
    return ggml.Runtime("cpu", threads=1)


def roundtrip(rt, arr, type_name):
    ctx = ggml.Context(n_tensors=1)
    ne = ffi.new("int64_t[]", list(reversed(arr.shape)))
    t = lib.ggml_new_tensor(ctx.ptr, ggml.TYPES[type_name], arr.ndim, ne)
    buf = rt.alloc(ctx)
    try:
        ggml.from_numpy(t, arr)
        assert ggml.shape(t) == arr.shape
        return ggml.to_numpy(t)
    finally:
        rt.free(buf)
        ctx.close()


@pytest.mark.parametrize("type_name", sorted(EXACT))
def test_exact_types(rt, rng, type_name):
    dt = EXACT[type_name]
    if dt is np.int32:
        arr = rng.integers(-2**31, 2**31 - 1, (3, 5, 64), dtype=np.int64).astype(np.int32)
    else:
        arr = rng.normal(0, 3, (3, 5, 64)).astype(dt)
    out = roundtrip(rt, arr, type_name)
    assert out.dtype == dt and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def test_bf16(rt, rng):
    arr = rng.normal(0, 3, (4, 96)).astype(np.float32)
    out = roundtrip(rt, arr, "bf16")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, bf16_rne(arr))
    assert not np.array_equal(out, arr)


@pytest.mark.parametrize("type_name", sorted(QUANT_BOUND))
def test_quantized_types(rt, rng, type_name):
    arr = rng.normal(0, 1, (6, 512)).astype(np.float32)
    out = roundtrip(rt, arr, type_name)
    assert out.shape == arr.shape and out.dtype == np.float32
    block = 256 if type_name.endswith("K") else 32
    err = np.abs(out - arr).reshape(-1, block).max(1)
    amax = np.abs(arr).reshape(-1, block).max(1)
    worst = float((err / amax).max())
    assert worst <= QUANT_BOUND[type_name], f"{type_name}: relative block error {worst:.4f}"
    assert err.max() > 0


def test_shape_mismatch_is_an_error(rt):
    ctx = ggml.Context(n_tensors=1)
    t = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, 4, 3)
    buf = rt.alloc(ctx)
    with pytest.raises(ValueError, match="shape"):
        ggml.from_numpy(t, np.zeros((5, 4), np.float32))
    rt.free(buf)
