"""Make the Qwen3.5 forward-parity fixtures in tests/fixtures/qwen35/.

Why: pytrain's qwen35 graph (GGUF loading, DeltaNet and gated-attention forward) is checked against
HF transformers' `Qwen3_5ForCausalLM` run in float32.  This script builds small random HF models
with a trained 512-token byte-level BPE vocabulary in Qwen3.5's format, converts each with the
pinned llama.cpp `convert_hf_to_gguf.py`, and stores HF's log-probabilities as golden outputs.

    gqa     hidden 64, 4 layers [linear, full, linear, full], attention 4 q / 2 kv heads x 16
            (rope on 4 dims), DeltaNet 2 key / 4 value heads x 16, FFN 128, tied embeddings;
            written as F32, BF16 and Q8_0
    untied  like gqa but tie_word_embeddings=False, DeltaNet 2 / 2 heads, default layer pattern
            (full attention at layer 3 only); F32

Outputs (per model NAME):
    tests/fixtures/qwen35/NAME-f32.gguf (and -bf16, -q8_0 for gqa)
    tests/fixtures/qwen35/NAME.npz: tokens int32 [N, T] right-padded with the pad id, lengths
        int32 [N], logprobs float32 [N, T, V] (log_softmax of HF float32 logits, each sequence run
        alone with no padding; zero past each length), config_json (HF config as JSON text)
    tests/fixtures/qwen35/tokenizer/ (tokenizer.json, tokenizer_config.json: the HF tokenizer the
        GGUFs were made from, for tokenizer and chat-template parity tests)

Checks made here: HF runs are bit-identical when repeated; every tensor of each F32 GGUF equals the
HF tensor under our own statement of the converter transforms (`expected_gguf_tensors`); BF16 and
Q8_0 tensors are within their rounding of it; an independent numpy forward pass over each GGUF
(`numpy_forward_gguf`: GGUF order, plain DeltaNet recurrence) matches the HF golden (F32: < 1e-4 in
log-probability; the BF16/Q8_0 errors are printed).

How (from the repo root, with the reference stack of scripts/requirements-reference.txt):

    /opt/refenv/bin/python -m scripts.make_qwen35_fixtures [--out tests/fixtures/qwen35]

Deterministic: fixed seeds, one thread.  Takes well under a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref

VOCAB = 512
SEQ_LENGTHS = [1, 7, 33, 64, 100]  # 33: random ids over the whole vocabulary

MODELS = {
    "gqa": dict(
        config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16,
                    tie_word_embeddings=True),
        seed=1234,
        outtypes=["f32", "bf16", "q8_0"],
    ),
    "untied": dict(
        config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=2,
                    linear_key_head_dim=16, linear_value_head_dim=16,
                    tie_word_embeddings=False),
        seed=4321,
        outtypes=["f32"],
    ),
}


def make_sequences(hf_tok, vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    text = ref.english_corpus(seed=99, n_paragraphs=40)
    long_ids = hf_tok.encode(" ".join(text[:40]), add_special_tokens=False)
    chat = ref.render_chat(hf_tok, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+7?"},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "Where is the red ball?"},
        {"role": "assistant", "content": "The red ball is in the garden."},
    ])
    chat_ids = hf_tok.encode(chat, add_special_tokens=False)
    seqs = []
    for n in SEQ_LENGTHS:
        if n == 33:
            seqs.append([rng.randrange(vocab_size) for _ in range(n)])
        elif n == 100:
            assert len(chat_ids) < n, len(chat_ids)   # the whole chat, think block included
            chat_ids = chat_ids + long_ids
            seqs.append(chat_ids[:n])
        else:
            start = rng.randrange(0, len(long_ids) - n)
            seqs.append(long_ids[start:start + n])
    for s, n in zip(seqs, SEQ_LENGTHS):
        assert len(s) == n, (len(s), n)
    return seqs


def write_gguf(name: str, ot: str, model, hf_dir: Path, out: Path, seqs, logprobs) -> None:
    """The pinned converter's GGUF of ``model`` in type ``ot``, its layout checked against the
    HF weights, and an independent numpy forward over it against the HF golden."""
    import numpy as np
    path = ref.convert_to_gguf(hf_dir, out / f"{name}-{ot}.gguf", ot)
    if ot == "f32":
        qg.check_gguf_layout(model, path)
    elif ot == "bf16":
        qg.check_gguf_layout(model, path, atol=0.02)
    else:
        qg.check_gguf_layout(model, path, atol=0.05)
    size = path.stat().st_size
    assert size < 1_000_000, f"{path} is {size} bytes"
    # independent numpy forward over the GGUF vs the HF golden (real positions)
    diffs = [np.abs(qg.numpy_forward_gguf(path, s) - logprobs[i, :len(s)])
             for i, s in enumerate(seqs)]
    errs = [float(d.max()) for d in diffs]
    mean = float(np.concatenate([d.ravel() for d in diffs]).mean())
    print(f"[{name}-{ot}] numpy-from-GGUF vs HF golden: max |dlogprob| = {max(errs):.3g}, "
          f"mean {mean:.2g} (max per sequence {', '.join(f'{e:.2g}' for e in errs)})")
    if ot == "f32":
        assert max(errs) < 1e-4, errs
    print(qg.gguf_summary(path) if ot == "f32" else f"# {path.name}: {size} bytes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ref.REPO / "tests" / "fixtures" / "qwen35")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (gqa, untied)")
    ap.add_argument("--types", default="f32,bf16,q8_0",
                    help="the GGUF types to write, of each model's (the smoke test: f32)")
    a = ap.parse_args()
    models = {k: v for k, v in MODELS.items() if k in a.models.split(",")}
    types = set(a.types.split(","))

    import numpy as np
    import torch
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    corpus = ref.english_corpus(seed=2024, n_paragraphs=3000)
    tok = ref.train_tokenizer(corpus, VOCAB)
    ref.save_tokenizer_dir(tok, tok_dir)
    hf_tok = ref.load_hf_tokenizer(tok_dir)
    pad_id = hf_tok.convert_tokens_to_ids(ref.PAD_TOKEN)
    eos_id = hf_tok.convert_tokens_to_ids(ref.EOS_TOKEN)
    seqs = make_sequences(hf_tok, VOCAB)
    T = max(SEQ_LENGTHS)

    with tempfile.TemporaryDirectory(prefix="qwen35-fixtures-") as tmp:
        for name, spec in models.items():
            cfg = ref.qwen35_text_config(eos_token_id=eos_id, **spec["config"])
            model = ref.build_model(cfg, spec["seed"])
            ref.randomize_weights(model, spec["seed"])

            tokens = np.full((len(seqs), T), pad_id, dtype=np.int32)
            lengths = np.array([len(s) for s in seqs], dtype=np.int32)
            logprobs = np.zeros((len(seqs), T, VOCAB), dtype=np.float32)
            for i, s in enumerate(seqs):
                lp = ref.hf_logprobs(model, s)
                lp2 = ref.hf_logprobs(model, s)
                if not np.array_equal(lp, lp2):
                    raise AssertionError(f"{name}: HF run is not deterministic on sequence {i}")
                tokens[i, :len(s)] = s
                logprobs[i, :len(s)] = lp
            # prefix consistency: the first k positions of a longer run equal a shorter run's
            # (causality; also catches chunk-boundary mistakes in the reference itself)
            lp_pre = ref.hf_logprobs(model, seqs[-1][:37])
            pre_err = float(np.abs(lp_pre - logprobs[-1, :37]).max())
            assert pre_err < 1e-4, pre_err

            hf_dir = Path(tmp) / name
            ref.save_hf_checkpoint(model, tok_dir, hf_dir)
            cfg_json = json.dumps(model.config.to_dict(), sort_keys=True)
            np.savez_compressed(out / f"{name}.npz", tokens=tokens, lengths=lengths, logprobs=logprobs,
                                config_json=np.array(cfg_json))

            for ot in [t for t in spec["outtypes"] if t in types]:
                write_gguf(name, ot, model, hf_dir, out, seqs, logprobs)

            ent = -(np.exp(logprobs) * logprobs).sum(-1)
            real = np.concatenate([ent[i, :n] for i, n in enumerate(lengths)])
            top = np.concatenate([logprobs[i, :n].max(-1) for i, n in enumerate(lengths)])
            print(f"[{name}] params={sum(p.numel() for p in model.parameters())} "
                  f"entropy mean={real.mean():.3f} (uniform {np.log(VOCAB):.3f}) "
                  f"top-1 logprob mean={top.mean():.3f} prefix-consistency err={pre_err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
