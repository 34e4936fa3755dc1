"""Qwen2, Qwen3 (dense) and Gemma 3 against HF transformers' ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` and ``Gemma3ForCausalLM``, PEFT and llama.cpp, on GGUFs the pinned
llama.cpp converter wrote (tests/fixtures/{qwen2,qwen3,gemma3}, made by
``python -m scripts.make_llama_fixtures --family qwen2,qwen3,gemma3``).

Models: ``qwen2`` (4 q / 2 kv heads x 16, tied, q/k/v biases, rope base 1e6; F32, F16, Q8_0),
``qwen3`` (4 q / 2 kv heads x 32 on hidden 64, per-head q/k norms, untied; F32, Q8_0),
``gemma3`` (6 layers: 0-4 with a sliding window of 8 positions and rope base 1e4, 5 global
with 1e6; 2 q / 1 kv heads x 32, q/k norms, pre- and post-norms, GELU-tanh, embeddings
scaled by sqrt(hidden), tied; F32, Q8_0).  Unlike Llama's, these converters keep HF's q/k row
order and llama.cpp rotates with NEOX rope: the tests would fail if pytrain ran NORM rope,
permuted a PEFT adapter's rows, or skipped a bias, a q/k norm or the window.

Bounds, as for the Llama fixtures (tests/test_llama_parity.py says why;
``llama_family.f32_bound``): each file loaded as F32 vs a float64 forward of its own weights
F32_SPREAD times the larger of HF float32's distance from the float64 forward of the F32 file
(1.05e-5 / 6.7e-6 / 9.5e-6 in the goldens) and pytrain's own rounding measured now, at least 8
ulps; F32 vs HF float32 that plus HF's distance; kept F16 / Q8_0 weights against the float64
forward that rounds the activations as ggml does, and against llama.cpp on the same file,
within that rounding's own noise on these tokens (``bounds.assert_same_rounding``); PEFT
gradients as the Llama ones.  llama.cpp's CPU GELU reads an F16 table (its input and output
rounded to F16), so Gemma 3 against llama.cpp is bounded the same way, by the float64
forward with that table (``llama_ref.gelu_f16_table``) as the rounding llama.cpp adds.
"""
import dataclasses
import json

import numpy as np
import pytest

import pytrain
from llama_family import (ALPHA, FIXTURES, RANK, assert_kv_cache_matches, f32_bound,
                          log_softmax, max_error, padded_seg, assert_step_matches_peft, peft_step)
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets

FAMILIES = ["qwen2", "qwen3", "gemma3"]
FILES = ["qwen2-f32", "qwen2-f16", "qwen2-q8_0", "qwen3-f32", "qwen3-q8_0", "gemma3-f32",
         "gemma3-q8_0"]
KEPT = ["qwen2-f16", "qwen2-q8_0", "qwen3-q8_0", "gemma3-q8_0"]
ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TARGETS = {"qwen2": ALL[:4], "qwen3": ALL, "gemma3": ALL}


def fixture(name: str):
    """(the family's folder, its golden) of a file name like ``qwen3-q8_0``."""
    family = name.split("-")[0]
    return FIXTURES / family, np.load(FIXTURES / family / f"{family}.npz")


def load(name: str, **kw):
    return pytrain.load_model(FIXTURES / name.split("-")[0] / f"{name}.gguf", device="cpu",
                              threads=2, **kw)


@pytest.mark.parametrize("name", [f"{f}-f32" for f in FAMILIES])
def test_f32_logits_match_hf(name, measured):
    _, gold = fixture(name)
    m = load(name)
    try:
        assert m.arch.name == name.split("-")[0]
        err = max_error(m, gold, gold["logprobs"])
    finally:
        m.close()
    bound, hf_rounding = f32_bound(FIXTURES / name.split("-")[0], name.split("-")[0], gold)
    measured(f"{name} vs HF float32, max |Δ log-softmax|", err, bound + hf_rounding)
    assert err <= bound + hf_rounding, (err, bound, hf_rounding)


@pytest.mark.parametrize("name", FILES)
def test_f32_loading_matches_float64_of_the_file(name, measured):
    fix, gold = fixture(name)
    want = np.load(fix / f"{name}.f64.npz")["logprobs64"]
    m = load(name, type_policy="f32")
    try:
        err = max_error(m, gold, want)
    finally:
        m.close()
    bound, _ = f32_bound(fix, name.split("-")[0], gold)
    measured(f"{name} loaded as F32 vs float64 of its weights", err, bound)
    assert err <= bound, (err, bound)


def kept_and_f32(name: str, tokens, seg) -> dict:
    out = {}
    for policy in ("auto", "f32"):
        m = load(name, type_policy=policy)
        try:
            out[policy] = log_softmax(m.logits(tokens, seg=seg))
        finally:
            m.close()
    return out


@pytest.mark.parametrize("name", KEPT)
def test_kept_weights_round_activations_as_ggml_does(name, measured):
    from bounds import assert_same_rounding
    from scripts.llama_ref import forward, gguf_contents, gguf_types
    fix, gold = fixture(name)
    tokens, lengths = gold["tokens"], gold["lengths"]
    got = kept_and_f32(name, tokens, padded_seg(gold))
    W, F = gguf_contents(fix / f"{name}.gguf")
    types = gguf_types(fix / f"{name}.gguf")
    worst = 0.0
    for i, n in enumerate(lengths):
        emulated = forward(W, F, tokens[i, :n], types)
        worst = max(worst, float(np.abs(got["auto"][i, :n] - emulated).max()))
        assert_same_rounding(got["auto"][i, :n], emulated, got["f32"][i, :n])
    measured(f"{name} kept vs float64 rounding activations as ggml does", worst,
             "the type's own noise")


def test_neox_rope_the_qk_norms_and_the_window_are_what_makes_the_match(monkeypatch):
    """The same files run with Llama's NORM rope, Qwen3's without its q/k norms, or Gemma 3's
    with every layer global are far from HF: the parity above is not a coincidence of small
    random weights."""
    from pytrain.models import gemma3, llama, qwen2
    errs = {}
    for name in ("qwen2-f32", "qwen3-f32", "gemma3-f32"):
        _, gold = fixture(name)
        m = load(name)
        try:
            with monkeypatch.context() as mp:
                for graph in (qwen2.Qwen2Graph, gemma3.Gemma3Graph):
                    mp.setattr(graph, "rope_mode", llama.ROPE_NORM)
                errs[name, "norm rope"] = max_error(m, gold, gold["logprobs"])
            if name.startswith("qwen3"):
                m.graph.c = dataclasses.replace(m.config, qk_norm=False)
                errs[name, "no q/k norms"] = max_error(m, gold, gold["logprobs"])
            if name.startswith("gemma3"):
                m.graph.c = dataclasses.replace(m.config, swa_layers=(False,) * 6)
                errs[name, "no window"] = max_error(m, gold, gold["logprobs"])
        finally:
            m.close()
    print(errs)
    assert all(e > 0.1 for e in errs.values()), errs


def test_config_from_the_converter_keys():
    from pytrain.models.model_file import open_model
    _, _, _, c = open_model(FIXTURES / "qwen2" / "qwen2-q8_0.gguf")
    assert (c.arch, c.n_layer, c.n_head, c.n_head_kv, c.head_dim) == ("qwen2", 2, 4, 2, 16)
    assert c.biases == {"attn_q", "attn_k", "attn_v"} and c.tied_embeddings and not c.qk_norm
    assert c.rope.base == 1e6 and c.rope.scaling == "none"
    _, _, _, c = open_model(FIXTURES / "qwen3" / "qwen3-f32.gguf")
    assert (c.arch, c.n_head, c.n_head_kv, c.head_dim, c.n_embd) == ("qwen3", 4, 2, 32, 64)
    assert c.qk_norm and not c.biases and not c.tied_embeddings


def test_qwen_yarn_is_refused_by_name(tmp_path):
    from scripts.gguf_models import with_keys
    from pytrain.models.model_file import open_model
    path = with_keys(FIXTURES / "qwen2" / "qwen2-f32.gguf", tmp_path / "yarn.gguf",
                     {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="qwen2.rope.scaling.type is 'yarn'"):
        open_model(path)


# --------------------------------------------------------------------------- Gemma 3

def test_gemma3_config_from_the_converter_keys():
    """The converter writes the window and both rope bases but no layer pattern and no
    query_pre_attn_scalar: every 6th layer is global and the scale is 1/sqrt(head_dim), as
    llama.cpp reads them."""
    from pytrain.models.model_file import open_model
    _, _, _, c = open_model(FIXTURES / "gemma3" / "gemma3-f32.gguf")
    assert (c.arch, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_embd) == \
        ("gemma3", 6, 2, 1, 32, 64)
    assert c.n_swa == 8 and c.swa_layers == (True,) * 5 + (False,)
    assert c.rope.base == 1e6 and c.rope_swa.base == 1e4
    assert c.attn_scale == pytest.approx(32 ** -0.5) and c.qk_norm and c.tied_embeddings
    assert "blk.5.post_ffw_norm.weight" in c.tensor_shapes()


def test_gemma3_token_beyond_the_window_has_exactly_zero_effect():
    """With every layer sliding (window 8: a query sees itself and the 7 keys before it),
    position t sees tokens back to t - 6·7 through the 6 layers and nothing before: changing
    token 0 leaves the logits of positions 43... bit for bit, and changes position 42's."""
    _, gold = fixture("gemma3-f32")
    seq = gold["tokens"][int(np.argmax(gold["lengths"]))][:60].astype(np.int64)
    other = seq.copy()
    other[0] = (seq[0] + 1) % 480
    m = load("gemma3-f32")
    try:
        m.graph.c = dataclasses.replace(m.config, swa_layers=(True,) * 6)
        a, b = m.logits(seq), m.logits(other)
    finally:
        m.close()
    reach = 6 * (8 - 1)
    assert np.array_equal(a[reach + 1:], b[reach + 1:])
    assert np.abs(a[reach] - b[reach]).max() > 0


def test_gemma3_packed_rows_equal_rows_alone():
    """Two samples packed in one row: each sample's positions restart and both masks (the
    causal one and the window) stop at the sample's edge."""
    _, gold = fixture("gemma3-f32")
    long = gold["tokens"][int(np.argmax(gold["lengths"]))]
    a, b = long[:13], long[20:50]
    m = load("gemma3-f32")
    try:
        packed = m.logits(np.concatenate([a, b])[None],
                          seg=np.array([[0] * len(a) + [1] * len(b)]))[0]
        alone_a, alone_b = m.logits(a), m.logits(b)
    finally:
        m.close()
    np.testing.assert_allclose(packed[:len(a)], alone_a, atol=1e-5)
    np.testing.assert_allclose(packed[len(a):], alone_b, atol=1e-5)


@pytest.mark.parametrize("keys, match", [
    ({"gemma3.final_logit_softcapping": 30.0}, "soft-capping"),
    ({"gemma3.attention.sliding_window_pattern": 4}, "sliding_window_pattern"),
])
def test_gemma3_what_pytrain_does_not_run_is_refused_by_name(tmp_path, keys, match):
    from scripts.gguf_models import with_keys
    from pytrain.models.model_file import open_model
    path = with_keys(FIXTURES / "gemma3" / "gemma3-f32.gguf", tmp_path / "x.gguf", keys)
    with pytest.raises(ValueError, match=match):
        open_model(path)


# --------------------------------------------------------------------------- PEFT

@pytest.fixture(scope="module", params=FAMILIES)
def peft_result(request):
    family = request.param
    gold = dict(np.load(FIXTURES / family / f"peft_{family}.npz"))
    names, out = peft_step(FIXTURES / family / f"{family}-f32.gguf", gold, TARGETS[family])
    return family, gold, names, out


@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_lora_gradients_match_peft(peft_result, ref, measured):
    """The golden A, B and gradients are convert_lora_to_gguf.py's (no row permutation for
    these architectures), on a padded, prompt-masked batch."""
    family, gold, names, out = peft_result
    n_layer = {"qwen2": 2, "qwen3": 2, "gemma3": 6}[family]
    assert len(names) == n_layer * len(TARGETS[family]) and out["n_valid"] == int(gold["n_valid"])
    assert_step_matches_peft(gold, names, out, ref, measured, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_folders_move_unpermuted(tmp_path, family):
    """PEFT's own folder (PEFT 0.21.2 save_pretrained) read by pytrain equals what llama.cpp's
    convert_lora_to_gguf.py made of it, with or without the model's config (PEFT recorded the
    HF class, which names the architecture: no rows to permute); written back by pytrain, it
    holds PEFT's own tensors under PEFT's names, and the same base class."""
    from safetensors.numpy import load_file
    from pytrain.formats.adapter_peft import read_peft_adapter, write_peft_adapter
    from pytrain.models.model_file import open_model
    fix = FIXTURES / family
    gold = np.load(fix / f"peft_{family}.npz")
    want = {k: gold[k] for k in gold if k.endswith((".lora_a", ".lora_b"))}
    _, _, _, config = open_model(fix / f"{family}-f32.gguf")
    for cfg in (config, None):
        tensors, alpha, rank, _ = read_peft_adapter(fix / f"peft_{family}", cfg)
        assert (alpha, rank) == (ALPHA, RANK) and set(tensors) == set(want)
        for k, v in want.items():
            np.testing.assert_array_equal(tensors[k], v, err_msg=k)
    out = write_peft_adapter(tmp_path / "ad", want, ALPHA, RANK, model_config=config)
    ours = load_file(str(out / "adapter_model.safetensors"))
    peft = load_file(str(fix / f"peft_{family}" / "adapter_model.safetensors"))
    assert set(ours) == set(peft)
    for k, v in peft.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    theirs = json.loads((fix / f"peft_{family}" / "adapter_config.json").read_text())
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["auto_mapping"] == theirs["auto_mapping"]


# --------------------------------------------------------------------------- generation

@pytest.mark.parametrize("name", [f"{f}-f32" for f in FAMILIES])
def test_kv_cache_steps_equal_the_full_forward(name):
    """``llama_family.assert_kv_cache_matches`` (Gemma 3: 15 steps past a window of 8, so its
    sliding layers must drop cached keys as the window moves)."""
    fix, gold = fixture(name)
    assert_kv_cache_matches(fix / f"{name}.gguf", gold)


# --------------------------------------------------------------------------- llama.cpp

def random_adapter(m, seed: int = 1):
    ad = lora.create(m.runtime, m.config, select_targets(m.config, ALL), rank=4, alpha=8, seed=0)
    rng = np.random.default_rng(seed)
    ad.set({k: rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in ad.get().items()})
    return ad


@pytest.mark.parametrize("name", [f"{f}-f32" for f in FAMILIES])
def test_llama_cpp_runs_pytrains_adapter(llama_logits_exe, tmp_path, name, measured):
    """llama.cpp's qwen2 / qwen3 / gemma3 graph with a pytrain-written random adapter gives
    pytrain's logits (``llama_cpp_check.assert_llama_cpp_runs_adapter`` says within what)."""
    from llama_cpp_check import assert_llama_cpp_runs_adapter
    path = FIXTURES / name.split("-")[0] / f"{name}.gguf"
    toks = np.random.default_rng(3).integers(0, 480, 100)
    assert_llama_cpp_runs_adapter(llama_logits_exe, path, random_adapter, toks, tmp_path,
                                  measured, name)


@pytest.mark.parametrize("name", KEPT)
def test_kept_weights_match_llama_cpp_on_the_same_file(llama_logits_exe, tmp_path, name,
                                                       measured):
    """pytrain keeping the file's types against llama.cpp on the same file, both roundings of
    the F32 function, compared with the float64 forward rounding as ggml does (activations
    to the weight's dot type; Gemma's GELU by the F16 table)."""
    from bounds import assert_same_rounding
    from llama_cpp_check import run_llama
    from scripts.llama_ref import forward, gguf_contents, gguf_types
    fix, gold = fixture(name)
    i = int(np.argmax(gold["lengths"]))
    toks = gold["tokens"][i, :gold["lengths"][i]]
    got = kept_and_f32(name, toks[None], np.zeros((1, len(toks)), int))
    theirs = log_softmax(run_llama(llama_logits_exe, fix / f"{name}.gguf", None, toks,
                                   tmp_path / "l.f32", gold["logprobs"].shape[-1]))
    W, F = gguf_contents(fix / f"{name}.gguf")
    emulated = forward(W, F, toks, gguf_types(fix / f"{name}.gguf"),
                       gelu_f16=name.startswith("gemma3"))
    measured(f"{name} kept vs llama.cpp on the same file ({len(toks)} tokens)",
             np.abs(got["auto"][0] - theirs).max(), "the type's own noise")
    assert_same_rounding(emulated, theirs, got["f32"][0])
    assert_same_rounding(got["auto"][0], theirs, got["f32"][0])
