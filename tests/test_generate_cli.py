"""`pytrain generate` from the command line on the embedded model (pytrain/assets/default-model.gguf):
sampling is reproducible per --seed (also across processes), different seeds sample different
text, and temperature 0 is greedy decoding, equal to ``Model.generate(..., temperature=0.0)``."""
import subprocess
import sys
from pathlib import Path

import pytest

from pytrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "pytrain" / "assets" / "default-model.gguf"
PROMPT = "What does the cow say?"
COMMON = ["--device", "cpu", "--threads", "1"]


def generate(capsys, *args) -> str:
    """stdout of an in-process `pytrain generate MODEL ARGS...` (exit status checked)."""
    capsys.readouterr()
    assert main(["generate", str(MODEL), *COMMON, *args]) == 0
    return capsys.readouterr().out


def generate_subprocess(*args) -> str:
    p = subprocess.run([sys.executable, "-m", "pytrain", "generate", str(MODEL), *COMMON, *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_same_seed_same_text_in_two_processes():
    """Two separate `python -m pytrain generate` processes, temperature 1.5, seed 1."""
    args = ["--prompt", PROMPT, "--temperature", "1.5", "--seed", "1", "--max-new-tokens", "32"]
    first = generate_subprocess(*args)
    second = generate_subprocess(*args)
    assert first.strip(), "sampled nothing: the check below would be vacuous"
    assert first == second


def test_different_seeds_sample_different_text(capsys):
    """Measured here (temperature 1.5): seed 0 "The sky is farmer.", 1 "The lion is in the
    field.", 2 "The sun is yellow.", 3 "Snow is hot."; the bound leaves room for one collision."""
    texts = {s: generate(capsys, "--prompt", PROMPT, "--temperature", "1.5", "--seed", str(s),
                         "--max-new-tokens", "32") for s in range(4)}
    assert texts[0] != texts[1], texts
    assert len(set(texts.values())) >= 3, texts
    # and sampling is not greedy decoding in disguise
    greedy = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", "32")
    assert any(t != greedy for t in texts.values()), (texts, greedy)


def test_temperature_zero_is_greedy_and_ignores_the_seed(capsys):
    """--temperature 0 gives the same text for any seed, equal to the argmax continuation
    computed from Python with Model.generate(..., temperature=0.0) on the same prompt ids."""
    from pytrain.models.model import load_model
    raw = "Tom has a red ball. Tom"
    outs = [generate(capsys, "--raw", "--prompt", raw, "--temperature", "0", "--seed", str(s),
                     "--max-new-tokens", "24") for s in (0, 7)]
    assert outs[0] == outs[1]
    # the default temperature is 0 as well
    assert generate(capsys, "--raw", "--prompt", raw, "--max-new-tokens", "24") == outs[0]
    m = load_model(MODEL, "cpu", 1)
    try:
        ids = m.tokenizer.encode(raw, add_special=True)   # what --raw feeds the model
        out = m.generate(ids, 24, temperature=0.0)
        # independent of the library's greedy branch: argmax of the logits, token by token
        toks, ref = list(ids), []
        for _ in range(24):
            nxt = int(m.logits(toks)[-1].argmax())
            if nxt in set(m.tokenizer.eog_ids):
                break
            ref.append(nxt)
            toks.append(nxt)
        expected = m.tokenizer.decode(out, skip_special=True)
    finally:
        m.close()
    assert out == ref
    assert len(out) >= 3, out            # a real continuation, not an immediate stop
    assert outs[0] == expected + "\n"
    # a sampled continuation at a high temperature is not that (seed 0, measured)
    sampled = generate(capsys, "--raw", "--prompt", raw, "--temperature", "1.5", "--seed", "0",
                       "--max-new-tokens", "24")
    assert sampled != outs[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_chat_prompt_greedy_equals_model_generate(capsys, seed):
    """Chat mode: the CLI renders the user message with the model's template (thinking off)
    and adds the generation prompt; greedy output equals Model.generate on that rendering."""
    from pytrain.data.chat_template import render
    from pytrain.models.model import load_model
    cli = generate(capsys, "--prompt", PROMPT, "--seed", str(seed), "--max-new-tokens", "32")
    m = load_model(MODEL, "cpu", 1)
    try:
        tok = m.tokenizer
        text = render(tok.chat_template, [{"role": "user", "content": PROMPT}],
                      add_generation_prompt=True, enable_thinking=False,
                      **tok.special_tokens_map())
        out = m.generate(tok.encode(text), 32, temperature=0.0)
        expected = tok.decode(out, skip_special=True)
    finally:
        m.close()
    assert expected.strip()
    assert cli == expected + "\n"


def test_an_adapter_with_a_rank_per_pair_runs_in_eval_and_generate(tmp_path, capsys):
    """llama.cpp and `lora_pairs` accept an adapter whose pairs have different ranks (each
    scaled by alpha over its own rank); eval and generate took the first pair's rank for all
    and crashed.  The adapter (q at rank 2, v at rank 4) must give the logits of the base with
    each pair merged in at its own scale (pytrain export's merge, in float64)."""
    import json

    import numpy as np

    import pytrain
    from pytrain.cli import _load_adapter
    from pytrain.formats.adapter_gguf import write_lora_gguf
    from pytrain.formats.merge import merge_adapter
    m = pytrain.load_model(MODEL, device="cpu", threads=1)
    try:
        shapes = m.config.tensor_shapes()
        rng = np.random.default_rng(0)
        tensors = {}
        for name, r in (("blk.3.attn_q.weight", 2), ("blk.3.attn_v.weight", 4)):
            n_out, n_in = shapes[name]
            tensors[name + ".lora_a"] = rng.normal(0, 0.3, (r, n_in)).astype(np.float32)
            tensors[name + ".lora_b"] = rng.normal(0, 0.3, (n_out, r)).astype(np.float32)
        adapter = write_lora_gguf(tmp_path / "mixed.gguf", m.arch.name, 8.0, tensors)
        ad = _load_adapter(m, adapter)
        assert ad.ranks == {"blk.3.attn_q.weight": 2, "blk.3.attn_v.weight": 4}
        toks = np.arange(3, 40)
        ours = m.logits(toks, lora=ad.hook)
    finally:
        m.close()
    merged = merge_adapter(MODEL, tensors, 8.0, tmp_path / "merged.gguf", merged_type="f32")
    assert len(merged.tensors) == 2
    ref = pytrain.load_model(tmp_path / "merged.gguf", device="cpu", threads=1)
    try:
        want = ref.logits(toks)
    finally:
        ref.close()
    assert np.abs(ours - want).max() < 1e-3 * np.abs(want).max()   # float32 rounding of B·A·x
    assert generate(capsys, "--adapter", str(adapter), "--prompt", PROMPT, "--max-new-tokens", "4")
    (tmp_path / "v.jsonl").write_text(json.dumps({"text": "the cow says moo"}) + "\n")
    (tmp_path / "c.toml").write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                                     f'[data]\ntrain = "v.jsonl"\nformat = "text"\n')
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "c.toml"), "--adapter", str(adapter)]) == 0
    assert "loss" in capsys.readouterr().out


def test_chat_template_from_a_file(tmp_path, capsys):
    """--chat-template FILE renders the prompt instead of the GGUF's template: the GGUF's own
    template in a file gives the same text, a file that raises stops with its message, and a
    GGUF without a template says to pass one."""
    from scripts.gguf_models import with_keys
    from pytrain.formats.gguf_meta import read_metadata
    own = tmp_path / "own.jinja"
    own.write_text(read_metadata(MODEL)["tokenizer.chat_template"])
    want = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", "12")
    assert generate(capsys, "--prompt", PROMPT, "--max-new-tokens", "12",
                    "--chat-template", str(own)) == want
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('rendered by the file') }}")
    assert main(["generate", str(MODEL), *COMMON, "--prompt", PROMPT,
                 "--chat-template", str(raising)]) != 0
    assert "rendered by the file" in capsys.readouterr().err
    bare = with_keys(MODEL, tmp_path / "no-template.gguf", {"tokenizer.chat_template": ""})
    assert main(["generate", str(bare), *COMMON, "--prompt", PROMPT]) != 0
    assert "has no chat template: pass --chat-template NAME (built-in: gemma) or FILE" in \
        capsys.readouterr().err
