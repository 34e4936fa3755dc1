"""`pytrain export --merge`: the merged GGUF computes what base + adapter computes.

Adapter used throughout: rank 4, alpha 8 (scale 2) on q/k/v/o of the attention layers, the
FFN up/down projections of every layer and the DeltaNet ``attn_qkv``/``ssm_out``, A and B ~
N(0, 0.05): an update of RMS ~0.01 on weights of RMS ~0.06-0.13 (a large but realistic trained
LoRA) that moves the logits (magnitude ~10) by ~7.

Measured on this machine (2 CPU threads), max |Δ logits| between the merged model and base +
adapter (``lora=adapter.hook``), token seeds 0-2 and 7 (the tests' draw), T = 40 / 100; "rms ratio" is
rms(merged − (base + adapter)) / rms((base + adapter) − base), the share of the adapter's
effect that the merge gets wrong:

    base        merged type  load policy  max|Δ|            rms ratio    bound (max, ratio)
    gqa-f32     keep (F32)   auto         1.5e-5 .. 1.9e-5  —            5e-4
    untied-f32  keep (F32)   auto         4e-5 .. 1.4e-4    —            5e-4
    gqa-q8_0    f32          f32          1.5e-5 .. 4.6e-5  —            5e-4
    gqa-bf16    f32          f32          1.9e-5 .. 6.8e-5  —            5e-4
    gqa-bf16    keep (BF16)  auto         0.12 .. 0.26      0.015-0.018  4 x BF16 noise
    gqa-q8_0    keep (Q8_0)  auto         0.49 .. 1.41      0.07-0.09    4 x Q8_0 noise
    gqa-q8_0    f16          f32          0.016 .. 0.06     —            4 x F16 noise

The float32 rows are rounding only ((W + ΔW)·x against W·x + ΔW·x, amplified by depth and the
DeltaNet recurrence of these tiny random nets).  BF16/Q8_0 "keep" round the merged weights back
to the base's type: the second rounding of a weight that was already rounded.  For scale, the
base's own rounding moves the same logits by 0.21 (BF16 vs the F32 original) and 0.69 (Q8_0);
an adapter merged with the wrong scale or orientation gives a ratio ≥ 0.5.  "noise" is that
type's own rounding noise on the same tokens, measured in the test (``type_noise``: gqa with
its weights in the type against gqa-f32, both loaded as float32; bounds.rounding_bounds says
why 4x its max, and 4x its rms over the adapter effect's rms for the ratio).  Exactness is
checked at the tensor level instead: merged F32 = float32(W + (alpha/r)·B·A) to 1 ulp, merged
BF16/Q8_0 bytes = gguf-py's (numpy) conversion/quantization of the exact float32 merge, and
their values within the type's rounding bound of the float64 merge.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_check import llama_cpp_compatible, run_llama
from gguf import GGUFReader

import pytrain
from pytrain import cli, ggml
from pytrain.models import lora
from pytrain.formats import merge as merge_mod
from pytrain.formats.adapter_gguf import write_lora_gguf
from pytrain.models.lora_targets import select_targets
from pytrain.formats.merge import MERGE_KEY, MergeError, merge_adapter
from pytrain.models.model_file import open_model

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"
TARGETS = "attn_q,attn_k,attn_v,attn_output,ffn_up,ffn_down,attn_qkv,ssm_out"
RANK, ALPHA, SD = 4, 8.0, 0.05
ATOL_F32 = 5e-4              # float32 merges (see the table)
LLAMA_ATOL = 1e-3            # llama.cpp vs pytrain, as in test_llama_cpp_adapter.py
# A merge kept in BF16/Q8_0/F16 rounds W + ΔW to that type once more: bounded by that type's
# own rounding noise on the same tokens (bounds.rounding_bounds), measured by type_noise.
NOISE_MODEL = {"F32": "gqa-f32.gguf", "BF16": "gqa-bf16.gguf", "Q8_0": "gqa-q8_0.gguf"}
_NOISE: dict = {}

pytestmark = pytest.mark.slow   # merges and logits of several fixtures, llama.cpp runs: minutes


def type_noise(type_name: str, toks) -> dict:
    """``bounds.weight_noise`` of ``type_name`` on ``toks``: gqa with its weights in that type
    (the committed BF16/Q8_0 conversions; F16: the F32 file re-encoded) loaded as float32,
    against gqa-f32."""
    from bounds import weight_noise
    key = (type_name, tuple(int(t) for t in toks))
    if key not in _NOISE:
        path = FIX / NOISE_MODEL.get(type_name, "gqa-f32.gguf")
        if type_name == "F16":
            import tempfile

            from scripts.gguf_models import retyped_copy
            with tempfile.TemporaryDirectory() as tmp:
                path = retyped_copy(FIX / "gqa-f32.gguf", Path(tmp) / "f16.gguf", "f32", "f16")
                rounded = logits(path, toks, policy="f32")
        else:
            rounded = logits(path, toks, policy="f32")
        _NOISE[key] = weight_noise(rounded, logits(FIX / "gqa-f32.gguf", toks, policy="f32"))
    return _NOISE[key]


def kept_bounds(type_name: str, toks, ref, base) -> tuple[float, float]:
    """(max |Δ|, rms ratio) allowed for a merge kept in ``type_name``, against the adapter's
    effect ref - base (``bounds.rounding_bounds``)."""
    from bounds import rounding_bounds
    e = np.asarray(ref, np.float64) - np.asarray(base, np.float64)
    return rounding_bounds(type_noise(type_name, toks), float(np.sqrt(np.mean(e * e))))


def config_of(path):
    return open_model(path)[3]


def make_adapter(config, targets=TARGETS, seed=1, sd=SD, rank=RANK) -> dict:
    names = select_targets(config, targets, skip_ssm=False)
    shapes = config.tensor_shapes()
    rng = np.random.default_rng(seed)
    out = {}
    for n in names:
        n_out, n_in = shapes[n]
        out[n + ".lora_a"] = rng.normal(0, sd, (rank, n_in)).astype(np.float32)
        out[n + ".lora_b"] = rng.normal(0, sd, (n_out, rank)).astype(np.float32)
    return out


def tokens(T=40, seed=7):
    return np.random.default_rng(seed).integers(0, 480, T)


def logits(path, toks, tensors=None, alpha=ALPHA, policy="auto", base_too=False):
    """pytrain logits of ``path`` (with the adapter ``tensors`` through the LoRA hook)."""
    m = pytrain.load_model(path, device="cpu", threads=2, type_policy=policy)
    try:
        ad = None
        if tensors is not None:
            names = sorted({k.rsplit(".", 1)[0] for k in tensors})
            ad = lora.create(m.runtime, m.config, names, RANK, alpha)
            ad.set(tensors)
        out = m.logits(toks, lora=ad.hook if ad else None)
        base = m.logits(toks) if base_too else None
    finally:
        m.close()
    return (out, base) if base_too else out


def compare(merged, ref, base):
    d, e = merged - ref, ref - base
    return float(np.abs(d).max()), float(np.sqrt(np.mean(d ** 2) / np.mean(e ** 2))), \
        float(np.abs(e).max())


def tensor_f32(reader, name) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    raw = np.asarray(reader.data[t.data_offset: t.data_offset + t.n_bytes])
    n = int(t.n_elements)
    return ggml.decode(raw, int(t.tensor_type), n).reshape(list(reversed(
        [int(d) for d in t.shape])))


def field_bytes(reader, f) -> bytes:
    return bytes(reader.data[f.offset: f.offset + sum(int(p.nbytes) for p in f.parts)])


# --------------------------------------------------------------------------- logits

@pytest.mark.parametrize("fixture", ["gqa-f32.gguf", "untied-f32.gguf"])
def test_float32_merge_matches_base_plus_adapter(tmp_path, fixture):
    base = FIX / fixture
    t = make_adapter(config_of(base))
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf")
    assert len(rep.tensors) == len(t) // 2 and all(r.out_type == "F32" for r in rep.tensors)
    assert all(r.round_max == 0 for r in rep.tensors)
    toks = tokens()
    ref, plain = logits(base, toks, t, base_too=True)
    d, _ratio, effect = compare(logits(tmp_path / "m.gguf", toks), ref, plain)
    print(f"\n{fixture}: max|Δ| {d:.3g}, adapter effect {effect:.3g}")
    assert effect > 2.0
    assert d < ATOL_F32


def test_bf16_base_keep_type(tmp_path):
    base = FIX / "gqa-bf16.gguf"
    t = make_adapter(config_of(base))
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf")
    assert {r.out_type for r in rep.tensors} == {"BF16"}
    assert all(0 < r.round_rms < r.delta_rms for r in rep.tensors)
    toks = tokens()
    ref, plain = logits(base, toks, t, base_too=True)
    d, ratio, effect = compare(logits(tmp_path / "m.gguf", toks), ref, plain)
    max_d, max_ratio = kept_bounds("BF16", toks, ref, plain)
    print(f"\nBF16 keep: max|Δ| {d:.3g} (bound {max_d:.3g}), rms ratio {ratio:.3g} (bound "
          f"{max_ratio:.3g}), adapter effect {effect:.3g}")
    assert d < max_d and ratio < max_ratio


def test_q8_0_base_keep_type_requantizes(tmp_path):
    base = FIX / "gqa-q8_0.gguf"
    t = make_adapter(config_of(base))
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf")
    assert {r.out_type for r in rep.tensors} == {"Q8_0"}
    for r in rep.tensors:
        # Q8_0 rounds each value to a step of (block max)/127: error ≤ half a step, and here
        # well below the update it would otherwise drown
        assert 0 < r.round_rms < 0.2 * r.delta_rms, r
    assert "requantization error rms" in rep.summary()
    toks = tokens()
    ref, plain = logits(base, toks, t, base_too=True)
    d, ratio, effect = compare(logits(tmp_path / "m.gguf", toks), ref, plain)
    max_d, max_ratio = kept_bounds("Q8_0", toks, ref, plain)
    print(f"\nQ8_0 keep: max|Δ| {d:.3g} (bound {max_d:.3g}), rms ratio {ratio:.3g} (bound "
          f"{max_ratio:.3g}), adapter effect {effect:.3g}")
    assert d < max_d and ratio < max_ratio


@pytest.mark.parametrize("fixture", ["gqa-q8_0.gguf", "gqa-bf16.gguf"])
def test_merged_f32_matches_dequantized_base_plus_adapter(tmp_path, fixture):
    """merged_type f32: the adapted tensors are the exact float32 merge of the dequantized
    base, so with every weight loaded as F32 on both sides the logits agree to rounding."""
    base = FIX / fixture
    t = make_adapter(config_of(base))
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf", merged_type="f32")
    assert {r.out_type for r in rep.tensors} == {"F32"}
    toks = tokens()
    ref, plain = logits(base, toks, t, policy="f32", base_too=True)
    d, _r, effect = compare(logits(tmp_path / "m.gguf", toks, policy="f32"), ref, plain)
    print(f"\n{fixture} merged f32: max|Δ| {d:.3g}, adapter effect {effect:.3g}")
    assert d < ATOL_F32
    types = {x.name: x.tensor_type.name for x in GGUFReader(tmp_path / "m.gguf").tensors}
    base_types = {x.name: x.tensor_type.name for x in GGUFReader(base).tensors}
    assert types["blk.3.attn_q.weight"] == "F32"                   # adapted
    assert types["blk.3.ffn_gate.weight"] == base_types["blk.3.ffn_gate.weight"] != "F32"


def test_q8_0_merged_f16(tmp_path):
    base = FIX / "gqa-q8_0.gguf"
    t = make_adapter(config_of(base))
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf", merged_type="f16")
    assert {r.out_type for r in rep.tensors} == {"F16"}
    toks = tokens()
    ref, plain = logits(base, toks, t, policy="f32", base_too=True)
    d, ratio, effect = compare(logits(tmp_path / "m.gguf", toks, policy="f32"), ref, plain)
    max_d, max_ratio = kept_bounds("F16", toks, ref, plain)
    print(f"\nQ8_0 -> F16: max|Δ| {d:.3g} (bound {max_d:.3g}), rms ratio {ratio:.3g} (bound "
          f"{max_ratio:.3g}), adapter effect {effect:.3g}")
    assert d < max_d and ratio < max_ratio


# --------------------------------------------------------------------------- tensors, metadata

@pytest.mark.parametrize("fixture, merged_type", [
    ("gqa-f32.gguf", "keep"), ("gqa-bf16.gguf", "keep"), ("gqa-q8_0.gguf", "keep"),
    ("gqa-q8_0.gguf", "f16"), ("gqa-bf16.gguf", "f32")])
def test_metadata_and_untouched_tensors_byte_identical(tmp_path, fixture, merged_type):
    base = FIX / fixture
    t = make_adapter(config_of(base))
    out = tmp_path / "m.gguf"
    rep = merge_adapter(base, t, ALPHA, out, merged_type=merged_type, adapter_name="ad.gguf")
    a, b = GGUFReader(base), GGUFReader(out)
    keys_a = [k for k in a.fields if not k.startswith("GGUF.")]
    keys_b = [k for k in b.fields if not k.startswith("GGUF.")]
    assert keys_b == keys_a + [MERGE_KEY]                 # same order, one key appended
    for k in keys_a:
        assert field_bytes(a, a.fields[k]) == field_bytes(b, b.fields[k]), k
    rec = json.loads(b.fields[MERGE_KEY].contents()[0])
    assert rec == {"adapter": "ad.gguf", "alpha": ALPHA, "rank": RANK,
                   "tensors": len(t) // 2, "merged_type": merged_type,
                   "sha256": merge_mod.adapter_fingerprint(t, ALPHA)}
    adapted = {k.rsplit(".", 1)[0] for k in t}
    assert [x.name for x in a.tensors] == [x.name for x in b.tensors]
    n_same = 0
    for ta, tb in zip(a.tensors, b.tensors):
        assert list(ta.shape) == list(tb.shape)
        if ta.name in adapted:
            continue
        assert ta.tensor_type == tb.tensor_type
        assert bytes(a.data[ta.data_offset: ta.data_offset + ta.n_bytes]) == \
            bytes(b.data[tb.data_offset: tb.data_offset + tb.n_bytes]), ta.name
        n_same += 1
    assert n_same == rep.n_copied == len(a.tensors) - len(adapted)
    assert rep.bytes_written == out.stat().st_size


@pytest.mark.parametrize("fixture", ["gqa-f32.gguf", "gqa-bf16.gguf", "gqa-q8_0.gguf"])
def test_adapted_tensors_are_the_exact_merge(tmp_path, fixture):
    """Stored value = the base type's encoding of float32(W + (alpha/r)·B·A), checked without
    pytrain's or ggml's converters: W is decoded and the expected bytes are encoded by gguf-py's
    own numpy code (gguf.quants, llama.cpp's Python package; its BF16 and Q8_0 quantizers are
    written to be bit-exact with ggml's reference ones), and the stored values, decoded by
    gguf-py, are within the type's worst-case rounding of the float64 merge:
      BF16: round to nearest with 8 significant bits, |error| <= 2^-8 |x|;
      Q8_0: per block of 32, d = fp16(amax / 127), q = round(x / d) in [-127, 127], so
            |q·d - x| <= d/2 + 127·|fp16 error of d| <= (1/2 + 127·2^-11)·amax/127 < 0.57·amax/127.
    Measured: every byte equal; worst |error| / bound 0.996 (BF16), 0.949 (Q8_0), while the
    LoRA update itself is 20-93x the bound (a merge that dropped or mis-scaled it would fail)."""
    from gguf.quants import dequantize, quantize
    base = FIX / fixture
    t = make_adapter(config_of(base))
    merge_adapter(base, t, ALPHA, tmp_path / "m.gguf")
    a, b = GGUFReader(base), GGUFReader(tmp_path / "m.gguf")

    def stored(reader, name):
        x = next(x for x in reader.tensors if x.name == name)
        n_rows = int(np.prod([int(d) for d in x.shape[1:]]))
        raw = np.asarray(reader.data[x.data_offset: x.data_offset + x.n_bytes]).reshape(n_rows, -1)
        return x.tensor_type, raw, dequantize(raw, x.tensor_type).astype(np.float64)

    for name in sorted({k.rsplit(".", 1)[0] for k in t}):
        _, _, w = stored(a, name)
        A, B = t[name + ".lora_a"].astype(np.float64), t[name + ".lora_b"].astype(np.float64)
        delta = (ALPHA / RANK) * B @ A
        exact = w + delta
        want = exact.astype(np.float32)
        qtype, got_raw, got = stored(b, name)
        if fixture == "gqa-f32.gguf":
            assert qtype.name == "F32"
            np.testing.assert_array_max_ulp(got.astype(np.float32), want, maxulp=1)
            continue
        assert qtype == next(x.tensor_type for x in a.tensors if x.name == name)   # kept
        assert got_raw.tobytes() == quantize(want, qtype).tobytes(), name
        if qtype.name == "BF16":
            bound = (2.0 ** -8 + 2.0 ** -23) * np.abs(exact)
        else:
            assert qtype.name == "Q8_0"
            amax = np.abs(exact.reshape(-1, 32)).max(axis=1, keepdims=True)
            bound = np.broadcast_to(0.57 * amax / 127, (amax.size, 32)).reshape(exact.shape)
        err = np.abs(got - exact)
        assert (err <= bound).all(), (name, float((err / bound).max()))
        assert np.abs(delta).max() > 10 * bound.max(), name     # the update is visible


def test_f16_base_keep(tmp_path):
    """An F16 base tensor stays F16: ggml's round-to-nearest-even of the exact merge.  (No F16
    fixture: a first merge with merged_type f16 makes one.)"""
    base = FIX / "gqa-f32.gguf"
    t = make_adapter(config_of(base), "attn_q,attn_output")
    merge_adapter(base, t, ALPHA, tmp_path / "f16.gguf", merged_type="f16")
    t2 = make_adapter(config_of(base), "attn_q,attn_output", seed=2)
    rep = merge_adapter(tmp_path / "f16.gguf", t2, ALPHA, tmp_path / "m.gguf")
    assert {r.out_type for r in rep.tensors} == {"F16"} and all(r.round_max > 0
                                                               for r in rep.tensors)
    a, b = GGUFReader(tmp_path / "f16.gguf"), GGUFReader(tmp_path / "m.gguf")
    for name in sorted({k.rsplit(".", 1)[0] for k in t2}):
        w = tensor_f32(a, name).astype(np.float64)
        want = (w + (ALPHA / RANK) * t2[name + ".lora_b"].astype(np.float64)
                @ t2[name + ".lora_a"].astype(np.float64)).astype(np.float32)
        tb = next(x for x in b.tensors if x.name == name)
        assert tb.tensor_type.name == "F16"
        assert bytes(b.data[tb.data_offset: tb.data_offset + tb.n_bytes]) == \
            want.astype(np.float16).tobytes(), name
    big = {k: v * 1e3 for k, v in t2.items()}
    with pytest.raises(MergeError, match="beyond F16's range"):
        merge_adapter(tmp_path / "f16.gguf", big, ALPHA, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_token_embd_lora_untied(tmp_path):
    """llama.cpp's embedding LoRA (A [n_vocab, r], B [n_embd, r]: B·get_rows(A, tok)) merges
    as W + (alpha/r)·A·Bᵀ; refused for tied models, where token_embd is also the head."""
    base = FIX / "untied-f32.gguf"
    cfg = config_of(base)
    V, E = cfg.tensor_shapes()["token_embd.weight"]
    rng = np.random.default_rng(3)
    t = {"token_embd.weight.lora_a": rng.normal(0, 0.1, (V, 2)).astype(np.float32),
         "token_embd.weight.lora_b": rng.normal(0, 0.1, (E, 2)).astype(np.float32)}
    merge_adapter(base, t, 4.0, tmp_path / "m.gguf")
    w = tensor_f32(GGUFReader(base), "token_embd.weight").astype(np.float64)
    want = (w + 2.0 * t["token_embd.weight.lora_a"].astype(np.float64)
            @ t["token_embd.weight.lora_b"].astype(np.float64).T).astype(np.float32)
    np.testing.assert_array_max_ulp(tensor_f32(GGUFReader(tmp_path / "m.gguf"),
                                               "token_embd.weight"), want, maxulp=1)
    with pytest.raises(MergeError, match="tied embeddings"):
        merge_adapter(FIX / "gqa-f32.gguf", {
            "token_embd.weight.lora_a": np.ones((V, 2), np.float32),
            "token_embd.weight.lora_b": np.ones((E, 2), np.float32)}, 4.0, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_remerge_appends_record(tmp_path):
    base = FIX / "gqa-f32.gguf"
    t = make_adapter(config_of(base))
    merge_adapter(base, t, ALPHA, tmp_path / "m1.gguf", adapter_name="one")
    merge_adapter(tmp_path / "m1.gguf", t, ALPHA, tmp_path / "m2.gguf", adapter_name="two")
    recs = GGUFReader(tmp_path / "m2.gguf").fields[MERGE_KEY].contents()
    assert [json.loads(r)["adapter"] for r in recs] == ["one", "two"]


# --------------------------------------------------------------------------- refusals

def test_refuses_adapter_for_another_base(tmp_path):
    """Adapters made for ``untied`` (DeltaNet layers 0-2, value heads 2) on ``gqa``: its
    blk.1.attn_qkv does not exist in gqa (layer 1 is softmax attention there), and its
    blk.0.attn_qkv is [96, 64] where gqa's is [128, 64]."""
    other = make_adapter(config_of(FIX / "untied-f32.gguf"), "attn_qkv")
    base = FIX / "gqa-f32.gguf"
    missing = {k: v for k, v in other.items() if k.startswith("blk.1.")}
    with pytest.raises(MergeError, match=r"'blk\.1\.attn_qkv\.weight' does not exist in the "
                       r"base model .*refusing to merge it into .*gqa-f32\.gguf"):
        merge_adapter(base, missing, ALPHA, tmp_path / "m.gguf", source="untied-adapter")
    shape = {k: v for k, v in other.items() if k.startswith("blk.0.")}
    with pytest.raises(MergeError, match=r"'blk\.0\.attn_qkv\.weight' is \(128, 64\) in the base "
                       r"model but the adapter has A \(4, 64\) and B \(96, 4\)"):
        merge_adapter(base, shape, ALPHA, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    assert list(tmp_path.iterdir()) == []


def test_refuses_other_bad_input(tmp_path):
    base = FIX / "gqa-f32.gguf"
    t = make_adapter(config_of(base), "attn_q")
    with pytest.raises(MergeError, match="merged_type"):
        merge_adapter(base, t, ALPHA, tmp_path / "m.gguf", merged_type="q4_0")
    with pytest.raises(MergeError, match="alpha"):
        merge_adapter(base, t, 0.0, tmp_path / "m.gguf")
    bad = dict(t)
    k = next(iter(bad))
    bad[k] = bad[k].copy()
    bad[k][0, 0] = np.nan
    with pytest.raises(MergeError, match="NaN"):
        merge_adapter(base, bad, ALPHA, tmp_path / "m.gguf")
    conv = {"blk.0.ssm_conv1d.weight.lora_a": np.ones((2, 4), np.float32),
            "blk.0.ssm_conv1d.weight.lora_b": np.ones((128, 2), np.float32)}
    with pytest.raises(MergeError, match="not used as a matrix product"):
        merge_adapter(base, conv, ALPHA, tmp_path / "m.gguf")
    copy = tmp_path / "base.gguf"
    shutil.copyfile(base, copy)
    with pytest.raises(MergeError, match="refusing to overwrite the base model"):
        merge_adapter(copy, t, ALPHA, copy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf"]


def test_refuses_requantizing_to_imatrix_type(tmp_path, monkeypatch):
    """A base tensor whose quantizer needs an importance matrix is refused under 'keep'
    (ggml would abort the process) with the f16/f32 hint."""
    base = FIX / "gqa-q8_0.gguf"
    t = make_adapter(config_of(base), "attn_q")
    T = ggml.TYPES
    assert merge_mod.requantize_problem(T["q8_0"]) is None
    assert merge_mod.requantize_problem(T["q4_K"]) is None
    assert merge_mod.requantize_problem(T["bf16"]) is None
    assert "importance matrix" in merge_mod.requantize_problem(T["iq2_xxs"])
    assert "no quantizer" in merge_mod.requantize_problem(T["q8_K"])
    monkeypatch.setattr(merge_mod, "requantize_problem",
                        lambda ty: "its quantizer needs an importance matrix")
    with pytest.raises(MergeError, match="importance matrix.*'f16' or 'f32'"):
        merge_adapter(base, t, ALPHA, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- atomicity

def test_failure_mid_write_leaves_no_file(tmp_path, monkeypatch):
    base = FIX / "gqa-q8_0.gguf"
    t = make_adapter(config_of(base))
    out = tmp_path / "m.gguf"
    calls = []
    real = merge_mod._encode

    def failing(arr, ty, row_len):
        calls.append(1)
        if len(calls) == 3:                       # after some tensors are on disk
            raise OSError("disk full (simulated)")
        return real(arr, ty, row_len)

    monkeypatch.setattr(merge_mod, "_encode", failing)
    with pytest.raises(OSError, match="simulated"):
        merge_adapter(base, t, ALPHA, out)
    assert list(tmp_path.iterdir()) == []         # neither the final name nor a temp file

    out.write_bytes(b"previous good model")       # an earlier export stays intact
    calls.clear()
    with pytest.raises(OSError, match="simulated"):
        merge_adapter(base, t, ALPHA, out)
    assert out.read_bytes() == b"previous good model"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]

    monkeypatch.setattr(merge_mod, "_encode", real)
    merge_adapter(base, t, ALPHA, out)
    GGUFReader(out)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


# --------------------------------------------------------------------------- CLI

def test_cli_export_merge_end_to_end(tmp_path, capsys):
    from pytrain.formats.adapter_peft import write_peft_adapter
    base = FIX / "gqa-f32.gguf"
    cfg = config_of(base)
    t = make_adapter(cfg)
    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", ALPHA, t)
    peft = write_peft_adapter(tmp_path / "peft", t, ALPHA, RANK, model_config=cfg)

    assert cli.main(["export", str(base), "--adapter", str(ad), "--merge",
                     "-o", str(tmp_path / "m.gguf")]) == 0
    out = capsys.readouterr().out
    assert f"merged {len(t) // 2} tensors into" in out and "blk.3.attn_q.weight" in out
    toks = tokens()
    ref = logits(base, toks, t)
    assert np.abs(logits(tmp_path / "m.gguf", toks) - ref).max() < ATOL_F32

    # a PEFT folder gives the same tensors
    assert cli.main(["export", str(base), "--adapter", str(peft), "--merge",
                     "-o", str(tmp_path / "p.gguf"), "--merged-type", "f32"]) == 0
    capsys.readouterr()
    a, b = GGUFReader(tmp_path / "m.gguf"), GGUFReader(tmp_path / "p.gguf")
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name
    assert json.loads(b.fields[MERGE_KEY].contents()[0])["adapter"] == "peft"

    # without --merge: the one supported export is named
    assert cli.main(["export", str(base), "--adapter", str(ad), "-o",
                     str(tmp_path / "x.gguf")]) == 2
    assert "error: pass --merge" in capsys.readouterr().err
    # an adapter for another base: one clear line, exit 1, no file
    other = write_lora_gguf(tmp_path / "other.gguf", "qwen35", ALPHA,
                            make_adapter(config_of(FIX / "untied-f32.gguf"), "attn_qkv"))
    assert cli.main(["export", str(base), "--adapter", str(other), "--merge", "-o",
                     str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "refusing to merge it into" in err
    # an adapter for another architecture
    llama = write_lora_gguf(tmp_path / "llama.gguf", "llama", ALPHA, t)
    assert cli.main(["export", str(base), "--adapter", str(llama), "--merge", "-o",
                     str(tmp_path / "x.gguf")]) == 1
    assert "architecture 'llama'" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_cli_subprocess(tmp_path):
    """The installed entry point path: ``python -m pytrain export ...``."""
    base = FIX / "gqa-q8_0.gguf"
    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", ALPHA,
                         make_adapter(config_of(base), "attn_q,attn_v"))
    r = subprocess.run([sys.executable, "-m", "pytrain", "export", str(base), "--adapter",
                        str(ad), "--merge", "-o", str(tmp_path / "m.gguf")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "Q8_0" in r.stdout and "requantization error rms" in r.stdout
    assert {x.tensor_type.name for x in GGUFReader(tmp_path / "m.gguf").tensors
            if x.name.endswith(("attn_q.weight", "attn_v.weight"))} == {"Q8_0"}


# --------------------------------------------------------------------------- llama.cpp

# llama.cpp on the merged file against llama.cpp on the base with the adapter (--lora): the
# merge's own rounding, bounded by the rounding noise of the type that dominates it
# (kept_bounds): BF16 and Q8_0 keep round into their own type; a Q8_0 base merged as F16 is
# near exact, and what is left is llama.cpp rounding the --lora run's activations to Q8_0's
# 8 bits.  Measured (token seeds 7, 0): BF16 keep 0.21-0.22 (ratio 0.022); Q8_0 keep
# 0.73-0.83 (ratio 0.072-0.079); Q8_0 -> F16 0.63-0.73 (ratio 0.062-0.066).
LLAMA_VS_LORA_NOISE = {"BF16": "BF16", "Q8_0": "Q8_0", "F16": "Q8_0"}
# llama.cpp and pytrain on the *same* merged file: F32 is one float32 function (the f32
# cross-implementation bound); Q8_0 and F16 the same ggml kernels, each rounding the
# activations to the weight's type, so within that rounding's own noise on these tokens
# (bounds.assert_same_rounding: llama.cpp's fused DeltaNet ops group float32 sums otherwise
# upstream of each rounding).  BF16: pytrain keeps BF16 weights as F16 on the CPU and rounds
# activations to F16, llama.cpp to BF16 (8 bits, the step of BF16 weights on the other factor
# of each product; unmerged gqa-bf16: 0.156): BF16's own weight noise (bounds.KEPT_SPREAD).


@pytest.mark.parametrize("fixture, merged_type", [
    ("gqa-f32.gguf", "keep"), ("untied-f32.gguf", "keep"), ("gqa-q8_0.gguf", "keep"),
    ("gqa-q8_0.gguf", "f16"), ("gqa-bf16.gguf", "keep")])
def test_llama_cpp_loads_merged_model(llama_logits_exe, tmp_path, fixture, merged_type):
    """llama.cpp loads the merged GGUF as a plain model; its logits match its own base +
    --lora adapter and pytrain's logits of the same file (bounds per type above); for F32
    bases also pytrain's base + adapter, tightly."""
    base = llama_cpp_compatible(FIX / fixture, tmp_path)
    t = make_adapter(config_of(base))
    merged = tmp_path / "merged.gguf"
    rep = merge_adapter(base, t, ALPHA, merged, merged_type=merged_type)
    out_type = rep.tensors[0].out_type
    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", ALPHA, t)
    toks = tokens()
    ours = logits(merged, toks)
    V = ours.shape[-1]
    cpp = run_llama(llama_logits_exe, merged, None, toks, tmp_path / "m.f32", V)
    cpp_lora = run_llama(llama_logits_exe, base, ad, toks, tmp_path / "l.f32", V)
    cpp_base = run_llama(llama_logits_exe, base, None, toks, tmp_path / "b.f32", V)
    d_ours = float(np.abs(cpp - ours).max())
    d_lora, ratio, effect = compare(cpp, cpp_lora, cpp_base)
    print(f"\n{fixture} {merged_type}: llama.cpp merged vs pytrain merged {d_ours:.3g}; vs "
          f"llama.cpp base + --lora {d_lora:.3g} (rms ratio {ratio:.3g}, effect {effect:.3g})")
    assert effect > 2.0
    if out_type == "F32":
        assert d_lora < LLAMA_ATOL
    else:
        max_lora, max_ratio = kept_bounds(LLAMA_VS_LORA_NOISE[out_type], toks, cpp_lora,
                                          cpp_base)
        print(f"  bounds: max|Δ| {max_lora:.3g}, rms ratio {max_ratio:.3g}")
        assert d_lora < max_lora and ratio < max_ratio
    if out_type in ("Q8_0", "F16"):
        from bounds import assert_same_rounding, log_softmax
        assert_same_rounding(log_softmax(ours), log_softmax(cpp),
                             log_softmax(logits(merged, toks, policy="f32")))
    elif out_type == "BF16":
        from bounds import KEPT_SPREAD
        bound = KEPT_SPREAD * type_noise("BF16", toks)["max"]
        print(f"  llama.cpp vs pytrain on the merged BF16 file: bound {bound:.3g}")
        assert d_ours < bound
    else:
        assert d_ours < LLAMA_ATOL
    if out_type == "F32":
        d_ref = float(np.abs(cpp - logits(base, toks, t)).max())
        print(f"  llama.cpp merged vs pytrain base + adapter: {d_ref:.3g}")
        assert d_ref < LLAMA_ATOL


def test_warns_when_requantizing_erases_the_update(tmp_path):
    """A LoRA update finer than the base's 4-bit grid does not survive requantization: the
    report of a ``keep`` merge names the tensors (error >= half the update, rms) and the
    summary says to merge as F16; with F16 nothing is lost.  (SmolLM2's Q4_1 after make
    demo-real: all 120; the default merge, ``auto``, writes them as F16: below.)"""
    from scripts.gguf_models import quantized_copy
    base = quantized_copy(FIX / "gqa-f32.gguf", FIX / "gqa-q8_0.gguf", tmp_path / "q4.gguf",
                          "q4_0")
    t = make_adapter(config_of(base))
    t = {k: v * (0.01 if k.endswith("lora_b") else 1.0) for k, v in t.items()}   # a small update
    rep = merge_adapter(base, t, ALPHA, tmp_path / "m.gguf", merged_type="keep")
    lost = rep.lost_updates()
    assert lost and set(lost) <= {r.name for r in rep.tensors}
    assert all(r.round_rms >= 0.5 * r.delta_rms for r in rep.tensors if r.name in lost)
    assert f"at least half the update (rms) in {len(lost)} of {len(rep.tensors)}" in rep.summary()
    assert "--merged-type f16" in rep.summary()
    ok = merge_adapter(base, t, ALPHA, tmp_path / "m16.gguf", merged_type="f16")
    assert ok.lost_updates() == [] and "warning" not in ok.summary()
    big = merge_adapter(FIX / "gqa-q8_0.gguf", make_adapter(config_of(FIX / "gqa-q8_0.gguf")),
                        ALPHA, tmp_path / "q8.gguf")
    assert big.lost_updates() == []


def test_default_merge_keeps_an_update_requantizing_would_erase(tmp_path, capsys):
    """A LoRA update finer than a Q4_0 base's grid: requantized (``keep``), the merged model
    computes the base's logits, not base + adapter's.  The default merge writes those tensors
    as F16 instead, so its logits are base + adapter's within F16's own rounding noise
    (``kept_bounds``, as test_q8_0_merged_f16), and it says which type it wrote, why, what it
    costs and the option that writes the base's type anyway; ``keep`` still writes the
    requantized model when asked for, with its warning."""
    from scripts.gguf_models import quantized_copy
    base = quantized_copy(FIX / "gqa-f32.gguf", FIX / "gqa-q8_0.gguf", tmp_path / "q4.gguf",
                          "q4_0")
    t = make_adapter(config_of(base))
    t = {k: v * (0.1 if k.endswith("lora_b") else 1.0) for k, v in t.items()}
    toks = tokens()
    ref, plain = logits(base, toks, t, policy="f32", base_too=True)
    kept = merge_adapter(base, t, ALPHA, tmp_path / "keep.gguf", merged_type="keep")
    lost = set(kept.lost_updates())
    assert lost
    _d, keep_ratio, effect = compare(logits(tmp_path / "keep.gguf", toks, policy="f32"), ref,
                                     plain)
    max_d, max_ratio = kept_bounds("F16", toks, ref, plain)

    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", ALPHA, t)
    capsys.readouterr()
    assert cli.main(["export", str(base), "--adapter", str(ad), "--merge",
                     "-o", str(tmp_path / "m.gguf")]) == 0
    said = capsys.readouterr().out
    d, ratio, _e = compare(logits(tmp_path / "m.gguf", toks, policy="f32"), ref, plain)
    print(f"\nQ4_0 base, small update (effect {effect:.3g}): keep rms ratio {keep_ratio:.3g}; "
          f"default max|Δ| {d:.3g} (bound {max_d:.3g}), rms ratio {ratio:.3g} (bound "
          f"{max_ratio:.3g})\n{said}")
    assert keep_ratio > 0.5 > max_ratio               # keep's model is measurably the base
    assert d < max_d and ratio < max_ratio            # the default's is base + adapter
    types = {x.name: x.tensor_type.name for x in GGUFReader(tmp_path / "m.gguf").tensors}
    assert {types[n] for n in lost} == {"F16"}
    assert {types[r.name] for r in kept.tensors if r.name not in lost} <= {"Q4_0"}
    assert f"{len(lost)} of {len(kept.tensors)} tensors written as F16" in said
    assert "--merged-type keep" in said and "warning" not in said
    rec = json.loads(GGUFReader(tmp_path / "m.gguf").fields[MERGE_KEY].contents()[0])
    assert rec["merged_type"] == "auto"
    # keep, asked for: the base's type, and the warning that says what it costs
    assert cli.main(["export", str(base), "--adapter", str(ad), "--merge", "--merged-type",
                     "keep", "-o", str(tmp_path / "k.gguf")]) == 0
    said = capsys.readouterr().out
    assert "may behave like the base model" in said and "--merged-type auto" in said
    assert {x.tensor_type.name for x in GGUFReader(tmp_path / "k.gguf").tensors
            if x.name in lost} == {"Q4_0"}
