"""The ``llama`` graph against HF transformers' ``LlamaForCausalLM`` and PEFT, on GGUFs the pinned
llama.cpp converter wrote (tests/fixtures/llama, made by scripts/make_llama_fixtures.py).

Models: ``gqa`` (4 q / 2 kv heads, tied; F32, F16, Q8_0), ``untied`` (8 q heads / 1 kv head,
untied head, q/k/v/o biases, linear rope scaling x2), ``llama3`` (tied, FFN biases, Llama 3
rope: ``rope_freqs.weight``).  The converter permutes each head's q/k rows for NORM rope; these
tests would fail if pytrain ran NEOX rope on them, or missed a bias, a scaling or the factors.

Bounds, as for the Qwen3.5 fixtures (max |Δ log-softmax| over every real position;
``llama_family.f32_bound``):
* every GGUF loaded as F32 vs a float64 forward of that GGUF's own weights: F32_SPREAD (4)
  times the larger of HF float32's own distance from the float64 forward of the F32 file on
  the same sequences (5.7e-6 - 9.5e-6: this network's float32 rounding on the machine that
  made the golden) and pytrain's own rounding measured now by perturbation
  (``llama_family.own_rounding``), at least 8 ulps of the log-probabilities;
* F32 GGUF vs HF float32: that plus HF's own distance (two float32 evaluations made on
  different machines differ by up to both of their errors: ``bounds.reference_bounds``);
* PEFT's loss and LoRA gradients (float32 and float64): the same rule, with PEFT float32's
  distance from its float64 run in the golden and pytrain's own rounding of the step measured
  now (tests/step_rounding.py; ``llama_family.assert_step_matches_peft``);
* F16 / Q8_0 with the default loading (weights kept; ggml rounds the activations to the
  weight's dot type, as llama.cpp does; measured 0.0097 / 0.28 from the float64 forward on an
  Intel Xeon): against the same float64 forward rounding the activations as ggml does
  (``llama_ref.round_activations``), within the kept type's own noise on these tokens
  (``bounds.assert_same_rounding``), never a fixed number.

Measured (Intel Xeon, AVX-512, 2 threads): F32 vs HF 8.0e-6 / 6.6e-6 / 9.1e-6 (gqa / untied /
llama3); loaded as F32 vs float64 of the file 7.2e-6 - 8.6e-6 for every file.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import pytrain
from llama_family import (ALPHA, FIXTURES, RANK, assert_kv_cache_matches, f32_bound,
                          log_softmax, max_error, assert_step_matches_peft, peft_step)
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import loss as L
from pytrain.step.graphs import GradGraph

FIX = FIXTURES / "llama"
FILES = ["gqa-f32", "gqa-f16", "gqa-q8_0", "untied-f32", "llama3-f32"]


@pytest.mark.parametrize("name", ["gqa-f32", "untied-f32", "llama3-f32"])
def test_f32_logits_match_hf(name, measured):
    gold = np.load(FIX / f"{name.split('-')[0]}.npz")
    m = pytrain.load_model(FIX / f"{name}.gguf", device="cpu", threads=2)
    try:
        err = max_error(m, gold, gold["logprobs"])
    finally:
        m.close()
    bound, hf_rounding = f32_bound(FIX, name.split("-")[0], gold)
    measured(f"{name} vs HF float32, max |Δ log-softmax|", err, bound + hf_rounding)
    assert err <= bound + hf_rounding, (err, bound, hf_rounding)


@pytest.mark.parametrize("name", FILES)
def test_f32_loading_matches_float64_of_the_file(name, measured):
    gold = np.load(FIX / f"{name.split('-')[0]}.npz")
    want = np.load(FIX / f"{name}.f64.npz")["logprobs64"]
    m = pytrain.load_model(FIX / f"{name}.gguf", device="cpu", threads=2, type_policy="f32")
    try:
        err = max_error(m, gold, want)
    finally:
        m.close()
    bound, _ = f32_bound(FIX, name.split("-")[0], gold)
    measured(f"{name} loaded as F32 vs float64 of its weights, max |Δ log-softmax|", err, bound)
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("name", ["gqa-f16", "gqa-q8_0"])
def test_kept_weights_round_activations_as_ggml_does(name, measured):
    from bounds import assert_same_rounding
    from scripts.llama_ref import forward, gguf_contents, gguf_types
    gold = np.load(FIX / f"{name.split('-')[0]}.npz")
    tokens, lengths = gold["tokens"], gold["lengths"]
    seg = np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], 0, -1)
    got = {}
    for policy in ("auto", "f32"):
        m = pytrain.load_model(FIX / f"{name}.gguf", device="cpu", threads=2, type_policy=policy)
        try:
            got[policy] = log_softmax(m.logits(tokens, seg=seg))
        finally:
            m.close()
    W, F = gguf_contents(FIX / f"{name}.gguf")
    types = gguf_types(FIX / f"{name}.gguf")
    worst = 0.0
    for i, n in enumerate(lengths):
        emulated = forward(W, F, tokens[i, :n], types)
        worst = max(worst, float(np.abs(got["auto"][i, :n] - emulated).max()))
        print(f"{name} row {i}: kept vs emulated {np.abs(got['auto'][i, :n] - emulated).max():.2e}"
              f", kept vs F32 {np.abs(got['auto'][i, :n] - got['f32'][i, :n]).max():.2e}")
        assert_same_rounding(got["auto"][i, :n], emulated, got["f32"][i, :n])
    measured(f"{name} kept vs float64 rounding activations as ggml does, max |Δ log-softmax|",
             worst, "the type's own noise")


def test_converter_layout_is_norm_rope(monkeypatch):
    """The converter's q/k permutation makes NORM rope (adjacent pairs) the right one: the same
    file run with NEOX rope is far from HF (so the parity above is not a coincidence)."""
    from pytrain.models import llama
    gold = np.load(FIX / "gqa.npz")
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    try:
        monkeypatch.setattr(llama.LlamaGraph, "rope_mode", pytrain.ggml.lib.GGML_ROPE_TYPE_NEOX)
        err = max_error(m, gold, gold["logprobs"])
    finally:
        m.close()
    assert err > 0.1, err


def test_config_from_the_converter_keys():
    from pytrain.models.model_file import open_model
    _, _, _, c = open_model(FIX / "untied-f32.gguf")
    assert (c.n_head, c.n_head_kv, c.head_dim, c.tied_embeddings) == (8, 1, 8, False)
    assert c.biases == {"attn_q", "attn_k", "attn_v", "attn_output"}
    assert c.rope.scaling == "linear" and c.rope.freq_scale == 0.5 and c.rope.base == 1e4
    _, _, _, c = open_model(FIX / "llama3-f32.gguf")
    assert c.rope_freqs and c.rope.freq_scale == 1.0 and c.tied_embeddings
    assert c.biases == {"ffn_gate", "ffn_up", "ffn_down"}
    _, _, _, c = open_model(FIX / "gqa-q8_0.gguf")
    assert (c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.rope.base) == (3, 4, 2, 16, 1e5)


def test_packed_rows_equal_rows_alone():
    """Two samples packed in one row (sample ids) give each sample's logits alone."""
    gold = np.load(FIX / "gqa.npz")
    a, b = gold["tokens"][1, :7], gold["tokens"][2, :33]
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    try:
        row = np.concatenate([a, b])[None]
        seg = np.array([[0] * 7 + [1] * 33])
        packed = m.logits(row, seg=seg)[0]
        alone_a, alone_b = m.logits(a), m.logits(b)
    finally:
        m.close()
    np.testing.assert_allclose(packed[:7], alone_a, atol=1e-5)
    np.testing.assert_allclose(packed[7:], alone_b, atol=1e-5)


# --------------------------------------------------------------------------- PEFT gradients

@pytest.fixture(scope="module", params=["gqa", "llama3"])
def peft_result(request):
    name = request.param
    gold = dict(np.load(FIX / f"peft_{name}.npz"))
    targets = ("attn_q", "attn_k", "attn_v", "attn_output") + \
        (("ffn_gate", "ffn_up", "ffn_down") if name == "llama3" else ())
    names, out = peft_step(FIX / f"{name}-f32.gguf", gold, targets)
    yield name, gold, names, out


def test_peft_golden_covers_the_targets(peft_result):
    name, gold, names, out = peft_result
    in_golden = {k.removesuffix(".lora_a.grad") for k in gold if k.endswith(".lora_a.grad")}
    assert in_golden == set(names) and len(names) == (12 if name == "gqa" else 14)
    assert out["n_valid"] == int(gold["n_valid"]) == 30


@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_llama_lora_gradients_match_peft(peft_result, ref, measured):
    """The golden A, B and gradients are in llama.cpp's layout as convert_lora_to_gguf.py wrote
    them (q/k B rows permuted), so a missing or wrong permutation fails here."""
    name, gold, names, out = peft_result
    assert_step_matches_peft(gold, names, out, ref, measured, name)


# --------------------------------------------------------------------------- PEFT folders

def test_peft_reader_gives_what_convert_lora_to_gguf_gives(tmp_path):
    """PEFT's own folder (peft_gqa/, PEFT 0.21.2 save_pretrained) read by pytrain equals the
    tensors llama.cpp's convert_lora_to_gguf.py made of it (peft_gqa.npz), permutation
    included.  Without the model's config the folder still says its layout (PEFT recorded
    ``LlamaForCausalLM`` in auto_mapping), so the q/k pairs are refused rather than left in
    HF's row order; with its auto_mapping removed and no architecture given, pytrain warns."""
    from pytrain.formats.adapter_peft import PeftAdapterError, read_peft_adapter
    from pytrain.models.model_file import open_model
    gold = np.load(FIX / "peft_gqa.npz")
    _, _, _, config = open_model(FIX / "gqa-f32.gguf")
    tensors, alpha, rank, _ = read_peft_adapter(FIX / "peft_gqa", config)
    assert (alpha, rank) == (ALPHA, RANK)
    want = {k: gold[k] for k in gold if k.endswith((".lora_a", ".lora_b"))}
    assert set(tensors) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(tensors[k], v, err_msg=k)
    with pytest.raises(PeftAdapterError, match="pass model_config"):
        read_peft_adapter(FIX / "peft_gqa")                       # llama, but no head counts
    anonymous = tmp_path / "anonymous"
    shutil.copytree(FIX / "peft_gqa", anonymous)
    cfg = json.loads((anonymous / "adapter_config.json").read_text())
    cfg["auto_mapping"] = None
    (anonymous / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="architecture is unknown"):
        plain, _, _, _ = read_peft_adapter(anonymous)
    assert not np.array_equal(plain["blk.0.attn_q.weight.lora_b"],
                              want["blk.0.attn_q.weight.lora_b"])


def test_peft_writer_gives_what_peft_wrote(tmp_path):
    """The converter's tensors written as a PEFT folder by pytrain hold exactly PEFT's own
    tensors (the inverse permutation), under PEFT's module names."""
    from safetensors.numpy import load_file
    from pytrain.formats.adapter_peft import write_peft_adapter
    from pytrain.models.model_file import open_model
    gold = np.load(FIX / "peft_gqa.npz")
    _, _, _, config = open_model(FIX / "gqa-f32.gguf")
    tensors = {k: gold[k] for k in gold if k.endswith((".lora_a", ".lora_b"))}
    out = write_peft_adapter(tmp_path / "ad", tensors, ALPHA, RANK, model_config=config)
    ours = load_file(str(out / "adapter_model.safetensors"))
    peft = load_file(str(FIX / "peft_gqa" / "adapter_model.safetensors"))
    assert set(ours) == set(peft)
    for k, v in peft.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["auto_mapping"] == json.loads(
        (FIX / "peft_gqa" / "adapter_config.json").read_text())["auto_mapping"]


# --------------------------------------------------------------------------- KV cache

@pytest.mark.parametrize("name", ["gqa-f32", "untied-f32", "llama3-f32"])
def test_kv_cache_steps_equal_the_full_forward(name):
    """``llama_family.assert_kv_cache_matches``, with biases, rope scaling and factors."""
    assert_kv_cache_matches(FIX / f"{name}.gguf", np.load(FIX / f"{name.split('-')[0]}.npz"))


# --------------------------------------------------------------------------- llama.cpp

LLAMA_CPP_ATOL = 1e-3       # max |Δ logit| (as tests/test_llama_cpp_adapter.py for qwen35)


@pytest.mark.parametrize("name, keys", [
    ("gqa-f32", {}),
    ("untied-f32", {}),
    ("llama3-f32", {}),
    ("gqa-f32", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                 "llama.rope.scaling.original_context_length": 32}),
    ("gqa-f32", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 3.0,
                 "llama.rope.scaling.attn_factor": 0.8}),
])
def test_llama_cpp_runs_pytrains_llama_adapter(llama_logits_exe, tmp_path, name, keys,
                                               measured):
    """llama.cpp (its loader, its llama graph, its adapter loading) on the same file and a
    pytrain-written adapter gives pytrain's logits, also for the rope scaling only llama.cpp
    defines for this architecture (YaRN, the attention factor), and the adapter changes them
    by far more than the tolerance.  Measured (Intel Xeon, 2 threads): base 5.5e-6 - 7.5e-6,
    with the adapter 1.8e-5 - 1.6e-4, its effect 16 - 19."""
    from scripts.gguf_models import with_keys
    from llama_cpp_check import deltas_with_adapter
    from pytrain.formats.adapter_gguf import write_lora_gguf
    path = FIX / f"{name}.gguf"
    if keys:
        path = with_keys(path, tmp_path / "scaled.gguf", keys)
    m = pytrain.load_model(path, device="cpu", threads=2)
    try:
        if keys.get("llama.rope.scaling.type") == "yarn":
            assert m.config.rope.ext_factor == 1.0 and m.config.rope.freq_scale == 0.25
        ad = lora.create(m.runtime, m.config, select_targets(m.config, ("attn_q", "attn_k",
                         "attn_v", "attn_output", "ffn_up")), rank=4, alpha=8, seed=0)
        rng = np.random.default_rng(1)
        ad.set({k: rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in ad.get().items()})
        adapter = write_lora_gguf(tmp_path / "ad.gguf", "llama", ad.alpha, ad.get())
        toks = np.random.default_rng(3).integers(0, 480, 100)
        ours, ours_lora = m.logits(toks), m.logits(toks, lora=ad.hook)
    finally:
        m.close()
    d, d_lora, effect = deltas_with_adapter(llama_logits_exe, path, adapter, toks, ours,
                                            ours_lora, tmp_path)
    what = f"{name}{' ' + keys['llama.rope.scaling.type'] if keys else ''}"
    measured(f"{what} vs llama.cpp, max |Δ logit|", d, LLAMA_CPP_ATOL)
    measured(f"{what} with pytrain's adapter vs llama.cpp --lora, max |Δ logit|", d_lora,
             LLAMA_CPP_ATOL)
    measured(f"{what} the adapter's effect (must exceed)", effect, 0.05)
    assert effect > 0.05 and d < LLAMA_CPP_ATOL and d_lora < LLAMA_CPP_ATOL


def test_layer_recompute_equals_the_one_graph_step():
    """Layer-wise recompute (train.recompute = "layers") runs the llama layers one at a time:
    same loss and LoRA gradients as the one-graph step."""
    from pytrain.step.recompute import RecomputeGraph
    gold = dict(np.load(FIX / "peft_gqa.npz"))
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    try:
        names = select_targets(m.config)[4:]                # layers 1 and 2: l0 > 0
        ad = lora.create(m.runtime, m.config, names, rank=RANK, alpha=ALPHA, seed=0)
        ad.set({k: gold[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
        tokens, labels = gold["input_ids"], gold["labels"]
        seg = np.where(gold["attention_mask"] > 0, 0, -1)
        tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
        outs = []
        for cls in (GradGraph, RecomputeGraph):
            g = cls(m, ad, tokens.shape[0], tokens.shape[1])
            outs.append(g.run(tokens, seg, tgt))
            g.close()
    finally:
        m.close()
    one, rec = outs
    assert rec["n_valid"] == one["n_valid"] and rec["loss"] == pytest.approx(one["loss"], rel=1e-6)
    for k, v in one["grads"].items():
        np.testing.assert_allclose(rec["grads"][k], v, atol=5e-5 * float(np.abs(v).max()),
                                   rtol=0, err_msg=k)
