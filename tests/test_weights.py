"""Loading GGUF tensors into backend buffers: values, type policy, ignored extras, errors.

Files come from ``scripts/gguf_models.py`` (tiny qwen35 models written with ``gguf.GGUFWriter``), so
the expected values are known exactly: F32/F16 must come back bit for bit, BF16 -> F16 must
equal numpy's round-to-nearest-even of the BF16 values, quantized types must equal ggml's
dequantization of the very bytes written.  The converter-made fixtures under
``tests/fixtures/qwen35`` are loaded too when present.
"""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from scripts.gguf_models import write_qwen35
from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.formats.gguf_meta import GGUFError
from pytrain.models.model_file import ModelFileError, open_model
from pytrain.models.weights import (BF16, F16, F32, WeightsError, is_elementwise, load_type,
                             load_weights)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "qwen35"


@pytest.fixture(scope="module")
def rt():
    r = ggml.Runtime("cpu", threads=1)
    yield r
    r.close()


def load(path, rt, policy="auto"):
    _arch, _meta, _infos, cfg = open_model(path)
    return load_weights(path, rt, cfg.tensor_shapes(), type_policy=policy)


def dequant(raw: np.ndarray, type_name: str, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    lib.ggml_get_type_traits(ggml.TYPES[type_name]).to_float(
        ffi.cast("void *", ffi.from_buffer(raw)), ffi.cast("float *", ffi.from_buffer(out)), n)
    return out


def bf16_values(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def file_values(model, name) -> np.ndarray:
    """What the file holds for ``name``, decoded independently of the loader."""
    t, raw, v = model.types[name], model.raw[name], model.values[name]
    if t == "f32":
        return raw.view(np.float32).reshape(v.shape)
    if t == "f16":
        return raw.view(np.float16).astype(np.float32).reshape(v.shape)
    if t == "bf16":
        return bf16_values(raw).reshape(v.shape)
    return dequant(raw, t, v.size).reshape(v.shape)


# --------------------------------------------------------------------------- values

@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_exact_types_round_trip(tmp_path, rt, dtype):
    m = write_qwen35(tmp_path / f"{dtype}.gguf", dtype)
    with load(m.path, rt) as w:
        assert set(w.tensors) == set(m.values)
        for name, t in w.tensors.items():
            assert ggml.name(t) == name
            assert w.report[name].file_type == w.report[name].loaded_type == m.types[name].upper()
            got = ggml.to_numpy(t)
            want = m.values[name].astype(np.float16 if m.types[name] == "f16" else np.float32)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        assert w.file_bytes == w.loaded_bytes == sum(r.nbytes for r in m.raw.values())
        assert w.total_bytes >= w.loaded_bytes


def test_bf16_becomes_f16_on_cpu(tmp_path, rt):
    m = write_qwen35(tmp_path / "bf16.gguf", "bf16")
    with load(m.path, rt) as w:
        n_matrices = 0
        for name, t in w.tensors.items():
            src = file_values(m, name)
            if m.types[name] == "bf16":
                n_matrices += 1
                assert t.type == F16 and w.report[name].loaded_type == "F16"
                want = src.astype(np.float16)
                np.testing.assert_array_equal(ggml.to_numpy(t), want)
                assert w.report[name].n_inexact == np.count_nonzero(want.astype(np.float32) != src)
                assert w.report[name].loaded_bytes == w.report[name].file_bytes
            else:
                assert t.type == F32
                np.testing.assert_array_equal(ggml.to_numpy(t), src)
        assert n_matrices == 32
        assert "BF16 -> F16" in w.summary()


def test_bf16_policies_f32_and_keep(tmp_path, rt):
    m = write_qwen35(tmp_path / "bf16.gguf", "bf16")
    with load(m.path, rt, "f32") as w:
        for name, t in w.tensors.items():
            assert t.type == F32
            np.testing.assert_array_equal(ggml.to_numpy(t), file_values(m, name))
        assert w.loaded_bytes == 2 * w.file_bytes - sum(
            r.file_bytes for r in w.report.values() if r.file_type == "F32")
    with load(m.path, rt, "keep") as w:
        t = w["blk.3.attn_q.weight"]
        assert t.type == BF16
        np.testing.assert_array_equal(ggml.to_numpy(t), file_values(m, "blk.3.attn_q.weight"))


def test_bf16_out_of_f16_range_stays_f32(tmp_path, rt):
    def values(name, shape, rng):
        v = 0.05 * rng.standard_normal(shape)
        if name == "blk.0.ffn_up.weight":
            v.flat[7] = 1.0e5            # beyond F16's 65504
        if name == "blk.0.ffn_down.weight":
            v.flat[:5] = [1e-7, -3e-6, 2e-8, 1e-5, 5e-5]   # F16 subnormal / zero range
        return v
    m = write_qwen35(tmp_path / "bf16.gguf", "bf16", values_fn=values)
    with load(m.path, rt) as w:
        up = w.report["blk.0.ffn_up.weight"]
        assert up.loaded_type == "F32" and "65504" in up.note
        np.testing.assert_array_equal(ggml.to_numpy(w["blk.0.ffn_up.weight"]),
                                      file_values(m, "blk.0.ffn_up.weight"))
        down = w.report["blk.0.ffn_down.weight"]
        assert down.loaded_type == "F16" and down.n_inexact >= 4
        got = ggml.to_numpy(w["blk.0.ffn_down.weight"]).astype(np.float32)
        np.testing.assert_array_equal(got, file_values(m, "blk.0.ffn_down.weight")
                                      .astype(np.float16).astype(np.float32))
        assert got.flat[2] == 0.0          # 2e-8 is below F16's smallest subnormal / 2
        assert "not exact" in w.summary()


# Bound on |dequantized - original| / absmax of the tensor: a loose check that the bytes
# belong to the right tensor (exactness is checked against ggml's own dequantization).
QUANT = {"q8_0": 0.01, "q4_0": 0.15, "q4_K": 0.15, "q5_K": 0.08, "q6_K": 0.04}


@pytest.mark.parametrize("dtype", sorted(QUANT))
def test_quantized_kept_on_cpu_and_dequantized_by_f32_policy(tmp_path, rt, dtype):
    m = write_qwen35(tmp_path / f"{dtype}.gguf", dtype)
    quantized = [n for n, t in m.types.items() if t == dtype]
    assert len(quantized) == 32
    with load(m.path, rt) as w:
        for name in quantized:
            t = w[name]
            assert t.type == ggml.TYPES[dtype]
            got = ggml.to_numpy(t)
            np.testing.assert_array_equal(got, file_values(m, name))
            v = m.values[name]
            assert 0 < np.abs(got - v).max() <= QUANT[dtype] * np.abs(v).max()
        assert w.loaded_bytes == w.file_bytes
    with load(m.path, rt, "f32") as w:
        for name in quantized:
            assert w[name].type == F32
            np.testing.assert_array_equal(ggml.to_numpy(w[name]), file_values(m, name))
        assert w.loaded_bytes > 3 * w.file_bytes


def test_cuda_policy_keeps_matrices_in_their_file_type(tmp_path, rt):
    """The policy follows ``runtime.device``; a CPU runtime posing as CUDA checks it here
    (the allocation itself stays on the CPU).  With patch 0003 ggml-cuda's OUT_PROD takes
    quantized and BF16 weights, so matrices keep the file's bytes; element-wise tensors are
    F32 (exactly the file's values)."""
    m = write_qwen35(tmp_path / "q8.gguf", "q8_0")
    fake = SimpleNamespace(device="cuda", alloc=rt.alloc, free=rt.free)
    q8 = ggml.TYPES["q8_0"]
    with load(m.path, fake) as w:
        assert {t.type for t in w.tensors.values()} == {F32, q8}
        for name, r in w.report.items():
            if r.file_type == "Q8_0":
                assert r.loaded_type == "Q8_0" and r.loaded_bytes == r.file_bytes, name
        assert w["blk.3.attn_q.weight"].type == q8
        for name in ("blk.3.attn_q.weight", "token_embd.weight", "blk.0.ssm_a"):
            np.testing.assert_array_equal(ggml.to_numpy(w[name]), file_values(m, name))


def test_load_type_table():
    q4k = ggml.TYPES["q4_K"]
    mat, vec = (512, 256), (256,)
    assert load_type("blk.0.ffn_up.weight", mat, BF16, "cpu") == F16
    assert load_type("blk.0.ffn_up.weight", mat, F16, "cpu") == F16
    assert load_type("blk.0.ffn_up.weight", mat, q4k, "cpu") == q4k
    assert load_type("blk.0.ffn_up.weight", mat, F32, "cpu") == F32
    iq2 = ggml.TYPES["iq2_xxs"]
    assert load_type("blk.0.ffn_up.weight", mat, iq2, "cuda") == F32     # not kept on CUDA
    for t in (BF16, F16, q4k, F32):
        assert load_type("blk.0.ffn_up.weight", mat, t, "cuda") == t
        assert load_type("blk.0.ffn_up.weight", mat, t, "cuda", "f32") == F32
        assert load_type("blk.0.attn_norm.weight", vec, t, "cuda") == F32
        assert load_type("blk.0.ffn_up.weight", mat, t, "cpu", "f32") == F32
        assert load_type("blk.0.ffn_up.weight", mat, t, "cuda", "keep") == t
        assert load_type("blk.0.attn_norm.weight", vec, t, "cpu") == F32
        assert load_type("blk.0.ssm_conv1d.weight", (512, 4), t, "cpu") == F32
    assert is_elementwise("blk.0.ssm_a", (2,)) and not is_elementwise("blk.0.attn_q.weight", mat)
    for t in (BF16, F16, F32):              # train.compute_type = "bf16"
        assert load_type("blk.0.ffn_up.weight", mat, t, "cpu", "bf16") == BF16
        assert load_type("blk.0.attn_norm.weight", vec, t, "cpu", "bf16") == F32
    assert load_type("blk.0.ffn_up.weight", mat, q4k, "cpu", "bf16") == q4k
    with pytest.raises(ValueError, match="type_policy"):
        load_type("x", mat, F32, "cpu", "f16")


# --------------------------------------------------------------------------- extras

def test_mtp_blocks_and_extra_tensors_are_ignored(tmp_path, rt):
    extra = {"rope_freqs.weight": np.ones(16, np.float32),
             "blk.9.ffn_up.weight": np.zeros((8, 256), np.float32)}
    m = write_qwen35(tmp_path / "mtp.gguf", "q8_0", n_nextn=1, extra=extra)
    _arch, _meta, infos, cfg = open_model(m.path)
    assert cfg.n_layer == 4 and cfg.n_nextn == 1
    with load_weights(m.path, rt, cfg.tensor_shapes()) as w:
        assert not any(n.startswith(("blk.4.", "blk.9.")) for n in w.tensors)
        assert "rope_freqs.weight" not in w.tensors
        assert set(w.ignored) == set(infos) - set(w.tensors)
        assert "blk.4.nextn.eh_proj.weight" in w.ignored and "blk.4.attn_q.weight" in w.ignored
        assert len(w.tensors) == len(cfg.tensor_shapes())


def test_close_frees_buffer_and_tolerates_closed_runtime(tmp_path):
    m = write_qwen35(tmp_path / "f32.gguf", "f32")
    r = ggml.Runtime("cpu", threads=1)
    w = load(m.path, r)
    assert w.buffer in r._buffers
    w.close()
    assert r._buffers == [] and w.tensors == {}
    w2 = load(m.path, r)
    r.close()
    w2.close()          # the runtime freed the buffer already: no double free


# --------------------------------------------------------------------------- errors

def test_not_a_gguf(tmp_path, rt):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip file" * 10)
    with pytest.raises(GGUFError, match="not a GGUF") as e:
        load_weights(p, rt, {"token_embd.weight": (64, 256)})
    assert str(p) in str(e.value)
    with pytest.raises(GGUFError, match=str(p)):
        open_model(p)


def test_truncated_in_data_section_names_the_tensor(tmp_path, rt):
    m = write_qwen35(tmp_path / "full.gguf", "f32")
    data = m.path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 300_000])
    with pytest.raises(WeightsError) as e:
        load_weights(cut, rt, {"token_embd.weight": (64, 256)})
    msg = str(e.value)
    assert str(cut) in msg and "truncated" in msg and "tensor 'blk." in msg
    with pytest.raises(WeightsError, match="truncated"):
        open_model(cut)


def test_truncated_in_header(tmp_path, rt):
    m = write_qwen35(tmp_path / "full.gguf", "f32")
    cut = tmp_path / "head.gguf"
    cut.write_bytes(m.path.read_bytes()[:700])
    with pytest.raises(GGUFError, match="truncated") as e:
        load_weights(cut, rt, {"token_embd.weight": (64, 256)})
    assert str(cut) in str(e.value)


def test_missing_tensor(tmp_path, rt):
    m = write_qwen35(tmp_path / "m.gguf", "f32", drop=("blk.3.attn_k.weight",))
    _arch, _meta, _infos, cfg = open_model(m.path)
    with pytest.raises(WeightsError, match=r"missing tensor: blk\.3\.attn_k\.weight") as e:
        load_weights(m.path, rt, cfg.tensor_shapes())
    assert str(m.path) in str(e.value)


def test_shape_mismatch_in_numpy_order(tmp_path, rt):
    m = write_qwen35(tmp_path / "m.gguf", "f32", shapes={"blk.0.ffn_down.weight": (256, 128)})
    _arch, _meta, _infos, cfg = open_model(m.path)
    with pytest.raises(WeightsError) as e:
        load_weights(m.path, rt, cfg.tensor_shapes())
    msg = str(e.value)
    assert str(m.path) in msg and "'blk.0.ffn_down.weight'" in msg
    assert "(256, 128) in the file" in msg and "ne [128, 256]" in msg
    assert "expected (256, 256)" in msg


def test_unsupported_tensor_type(tmp_path, rt):
    m = write_qwen35(tmp_path / "m.gguf", "f32", types={"blk.1.ffn_up.weight": "i32"})
    _arch, _meta, _infos, cfg = open_model(m.path)
    with pytest.raises(WeightsError, match=r"'blk\.1\.ffn_up\.weight' has type I32") as e:
        load_weights(m.path, rt, cfg.tensor_shapes())
    assert str(m.path) in str(e.value)


def test_unknown_type_id_names_the_tensor(tmp_path, rt):
    """A type id gguf-py cannot parse (here 4, the removed Q4_2) makes ``GGUFReader`` fail
    with a bare enum error; the loader traces it to the tensor."""
    m = write_qwen35(tmp_path / "m.gguf", "f32")
    data = bytearray(m.path.read_bytes())
    name = b"blk.2.ffn_gate.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 0   # F32
    data[type_at:type_at + 4] = (4).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"'blk\.2\.ffn_gate\.weight' has unknown type id 4"):
        load_weights(bad, rt, {})


def test_unsupported_architecture(tmp_path):
    m = write_qwen35(tmp_path / "mamba.gguf", "f32", arch="mamba")
    from pytrain import models
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'; supported: "
                                             + ", ".join(models.names())) as e:
        open_model(m.path)
    assert str(m.path) in str(e.value)


def test_bad_policy(tmp_path, rt):
    m = write_qwen35(tmp_path / "m.gguf", "f32")
    with pytest.raises(ValueError, match="type_policy must be one of auto, f32, keep, bf16"):
        load_weights(m.path, rt, {}, type_policy="f16")


# --------------------------------------------------------------------------- real fixtures

REAL = sorted(FIXTURES.glob("*.gguf"))


@pytest.mark.skipif(not REAL, reason="no converter-made fixtures in tests/fixtures/qwen35")
@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_converter_fixture_loads(path, rt):
    arch, _meta, infos, cfg = open_model(path)
    assert arch == "qwen35" and cfg.n_layer == 4
    shapes = cfg.tensor_shapes()
    assert set(shapes) == set(infos)      # --no-mtp files: nothing extra, nothing missing
    with load_weights(path, rt, shapes) as w:
        for name, r in w.report.items():
            assert ggml.shape(w[name]) == shapes[name]
            if len(shapes[name]) == 1 or name.endswith("ssm_conv1d.weight"):
                assert r.loaded_type == "F32"
            else:
                assert r.loaded_type == {"BF16": "F16"}.get(r.file_type, r.file_type)
        f32_path = path.with_name(path.name.split("-")[0] + "-f32.gguf")
        if path != f32_path and f32_path.exists():
            with load_weights(f32_path, rt, shapes) as ref:
                for name in shapes:
                    a = ggml.to_numpy(w[name]).astype(np.float32)
                    b = ggml.to_numpy(ref[name])
                    scale = np.abs(b).max() + 1e-12
                    tol = 2.0 ** -8 if "bf16" in path.name else 1 / 127
                    assert np.abs(a - b).max() <= tol * scale, name


def test_direct_copy_makes_no_python_copy(tmp_path, rt):
    """Types that stay as they are go from the memory map to the backend: Python's peak
    allocation during the load is a small fraction of the model's bytes."""
    import tracemalloc
    m = write_qwen35(tmp_path / "f32.gguf", "f32")
    _arch, _meta, _infos, cfg = open_model(m.path)
    tracemalloc.start()
    try:
        w = load_weights(m.path, rt, cfg.tensor_shapes())
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with w:
        assert w.loaded_bytes > 7_000_000
        assert peak < w.loaded_bytes / 4, peak     # a full copy would be > loaded_bytes


def test_one_row_matrix_is_still_a_matrix(tmp_path, rt):
    """With one value head ``ssm_beta`` is [1, n_embd] (GGUF ne [n_embd, 1]): the policy
    must treat it as a matrix (F16 from BF16), not as a 1-D norm (F32)."""
    m = write_qwen35(tmp_path / "one.gguf", "bf16", ssm_v_heads=1, ssm_v_dim=256)
    _arch, _meta, infos, cfg = open_model(m.path)
    assert cfg.tensor_shapes()["blk.0.ssm_beta.weight"] == (1, 256)
    assert infos["blk.0.ssm_beta.weight"].ne == (256, 1)
    with load_weights(m.path, rt, cfg.tensor_shapes()) as w:
        t = w["blk.0.ssm_beta.weight"]
        assert t.type == F16 and (t.ne[0], t.ne[1]) == (256, 1)
        np.testing.assert_array_equal(ggml.to_numpy(t).reshape(1, 256),
                                      file_values(m, "blk.0.ssm_beta.weight").astype(np.float16))
        assert w["blk.0.ssm_a"].type == F32
