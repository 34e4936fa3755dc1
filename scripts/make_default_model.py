"""Make pytrain's embedded default model and demo fine-tuning data (pytrain/assets/).

Why: pytrain ships a demo that runs anywhere in minutes, with no download.  It needs a real-format
Qwen3.5 GGUF that already knows the chat format (so a LoRA run has something to build on) and a
small chat dataset that teaches it something new, visible in greedy generation before and after.

What it makes:
    pytrain/assets/default-model.gguf   a small Qwen3.5 (hidden 128, 6 layers: DeltaNet at 0, 1, 2, 4
        and gated attention at 3, 5; 4 q / 2 kv heads x 32; DeltaNet 2 key / 4 value heads x 32;
        FFN 384; 1024-token byte-level BPE; tied embeddings), pretrained with HF transformers on a
        synthetic corpus (simple English plus conversations rendered with the model's own Qwen3.5
        chat template: arithmetic, facts, counting, copying, reading questions, greetings), then
        converted to F32 with the pinned llama.cpp convert_hf_to_gguf.py (pre forced to qwen35)
    pytrain/assets/demo_train.jsonl, demo_valid.jsonl   OpenAI-style chat records teaching animal
        sounds ("What does the cow say?" -> "The cow says moo."), which the base model never saw

How (from the repo root, with the reference stack of scripts/requirements-reference.txt):

    /opt/refenv/bin/python -m scripts.make_default_model --fresh         # everything (~12 min)
    /opt/refenv/bin/python -m scripts.make_default_model --check-demo \
        --demo-rank 16 --demo-lr 5e-3 --demo-schedule constant --demo-steps 200   # 7/8 animals

Stages cache their results in --work (default /tmp/pytrain-default-model): the tokenizer and the
pretrained HF checkpoint are reused when present (delete the folder or pass --fresh to redo them).
--check-demo trains a LoRA with HF+PEFT on demo_train.jsonl (q/k/v/o of the two attention layers
only; by default config/demo.toml's settings: r 8, alpha 16, lr 1e-3, cosine, warmup 10, clip 1.0,
150 steps of 8; --demo-* options change them) and prints losses, greedy generations before and
after, and how many of the 8 animals it gets right (0/8 before; 7/8 after the settings above;
1/8 with config/demo.toml's, where every animal "says moo").  Deterministic: fixed seeds, torch on
1 thread, a fixed number of steps (a --fresh rerun logged the same pretraining losses through step 450 of 600, where it was
stopped; conversion and demo data from the cached checkpoint reproduce byte for byte).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref
from scripts.default_model_data import (HELD_OUT_QUESTION, SOUND_QUESTIONS, SOUND_WORDS, SOUNDS,
                                        demo_records, pretrain_documents, random_conversation,
                                        sum_question, write_jsonl)

VOCAB = 1024
SEQ = 128
MODEL_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    tie_word_embeddings=True, initializer_range=0.02,
    # rope on 8 of 32 head dims: base 1e4 (not Qwen3.5's 1e7) keeps more than one pair turning
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
PRETRAIN = dict(steps=600, batch=32, lr=5e-3, warmup=50, weight_decay=0.01, seed=0)


# --------------------------------------------------------------------------------------------
# HF training helpers
# --------------------------------------------------------------------------------------------

def packed_rows(docs: list[list[int]], seq: int) -> list[list[int]]:
    flat = [t for d in docs for t in d]
    return [flat[i:i + seq] for i in range(0, len(flat) - seq + 1, seq)]


def pretrain(model, rows, steps, batch, lr, warmup, weight_decay, seed, log_every=50):
    import torch
    g = torch.Generator().manual_seed(seed)
    data = torch.tensor(rows, dtype=torch.long)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    model.train()
    t0 = time.time()
    for step in range(steps):
        f = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for grp in opt.param_groups:
            grp["lr"] = lr * max(f, 0.02)
        idx = torch.randint(0, len(data), (batch,), generator=g)
        x = data[idx]
        out = model(input_ids=x, labels=x, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"  pretrain step {step:5d} loss {out.loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()


def chat_prompt_and_target(hf_tok, msgs: list[dict]) -> tuple[list[int], list[int]]:
    """Prompt ids (everything before the last assistant reply, generation prompt included) and
    target ids (the rest of the rendered chat: the reply and its <|im_end|>)."""
    full = ref.render_chat(hf_tok, msgs)
    prompt = ref.render_chat(hf_tok, msgs[:-1], add_generation_prompt=True)
    assert full.startswith(prompt), (full, prompt)
    p = hf_tok.encode(prompt, add_special_tokens=False)
    t = hf_tok.encode(full[len(prompt):], add_special_tokens=False)
    return p, t


def greedy(model, hf_tok, msgs: list[dict], max_new: int = 24) -> str:
    import torch
    prompt = ref.render_chat(hf_tok, msgs, add_generation_prompt=True)
    ids = torch.tensor([hf_tok.encode(prompt, add_special_tokens=False)])
    end = hf_tok.convert_tokens_to_ids(ref.EOS_TOKEN)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=end,
                             pad_token_id=hf_tok.convert_tokens_to_ids(ref.PAD_TOKEN))
    return hf_tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def answer_of(generated: str) -> str:
    """The reply without the (empty) think block and the closing <|im_end|>."""
    return generated.split("</think>")[-1].strip().removesuffix("<|im_end|>").strip()


def masked_batches(hf_tok, recs, pad_id):
    """(input_ids, labels) per record; labels -100 except the final assistant turn."""
    items = []
    for r in recs:
        p, t = chat_prompt_and_target(hf_tok, r["messages"])
        items.append((p + t, [-100] * len(p) + t))
    return items


def collate(items, pad_id):
    import torch
    T = max(len(x) for x, _ in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    lab = torch.full((len(items), T), -100, dtype=torch.long)
    att = torch.zeros((len(items), T), dtype=torch.long)
    for i, (x, y) in enumerate(items):
        ids[i, :len(x)] = torch.tensor(x)
        lab[i, :len(y)] = torch.tensor(y)
        att[i, :len(x)] = 1
    return ids, lab, att


def eval_loss(model, items, pad_id, bs=16):
    """Mean CE over all target tokens, each record run alone (no padding inside the model)."""
    import torch
    tot, n = 0.0, 0
    with torch.no_grad():
        for x, y in items:
            out = model(input_ids=torch.tensor([x]), use_cache=False)
            logits = out.logits[0, :-1]
            yy = torch.tensor(y[1:])
            m = yy != -100
            tot += torch.nn.functional.cross_entropy(logits[m], yy[m], reduction="sum").item()
            n += int(m.sum())
    return tot / n


def animal_score(model, hf_tok) -> tuple[int, list[str]]:
    """Greedy answers to "What does the <animal> say?" for every animal of the demo."""
    got = []
    for a in sorted(SOUNDS):
        got.append(answer_of(greedy(model, hf_tok, [{"role": "user", "content": f"What does the {a} say?"}], 12)))
    ok = sum(g == f"The {a} says {SOUNDS[a]}." for a, g in zip(sorted(SOUNDS), got))
    return ok, got


def check_demo(model, hf_tok, train_recs, valid_recs, steps=150, batch=8, lr=1e-3, rank=8, alpha=16.0,
               warmup=10, schedule="cosine", clip=1.0, seed=0):
    """HF+PEFT LoRA on q/k/v/o (only the full-attention layers have them), trained on the final
    assistant turn of each record; AdamW without weight decay, warmup then cosine (or constant),
    global-norm clipping: the settings of config/demo.toml by default."""
    import copy
    import torch
    from peft import LoraConfig, get_peft_model
    pad_id = hf_tok.convert_tokens_to_ids(ref.PAD_TOKEN)
    probes = [[{"role": "user", "content": "What does the cow say?"}],
              [{"role": "user", "content": "What sound does a duck make?"}],
              [{"role": "user", "content": "Which sound does a lion make?"}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does the dog say?"}],
              [{"role": "user", "content": "What is 3+4?"}],
              [{"role": "user", "content": "What colour is the sky?"}]]
    tr, va = masked_batches(hf_tok, train_recs, pad_id), masked_batches(hf_tok, valid_recs, pad_id)
    print(f"[demo] base model: train loss {eval_loss(model, tr, pad_id):.4f}  valid loss {eval_loss(model, va, pad_id):.4f}")
    before = [greedy(model, hf_tok, m) for m in probes]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    pm = get_peft_model(copy.deepcopy(model), cfg)
    names = sorted({n.split("model.layers.")[-1].split(".lora_")[0] for n, p in pm.named_parameters() if p.requires_grad})
    print(f"[demo] LoRA r={rank} alpha={alpha} lr={lr} {schedule} warmup={warmup} clip={clip} steps={steps} "
          f"batch={batch} on layers.{', layers.'.join(names)}")
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    pm.train()
    t0 = time.time()
    for step in range(steps):
        f = min(1.0, (step + 1) / max(warmup, 1))
        if schedule == "cosine":
            f *= 0.5 * (1 + math.cos(math.pi * step / steps))
        for grp in opt.param_groups:
            grp["lr"] = lr * f
        idx = torch.randint(0, len(tr), (batch,), generator=g).tolist()
        ids, lab, att = collate([tr[i] for i in idx], pad_id)
        loss = pm(input_ids=ids, attention_mask=att, labels=lab, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            pm.eval()
            vl = eval_loss(pm, va, pad_id)
            pm.train()
            print(f"  lora step {step:4d} batch loss {loss.item():.4f}  valid loss {vl:.4f}  {time.time() - t0:5.1f}s",
                  flush=True)
    pm.eval()
    after = [greedy(pm, hf_tok, m) for m in probes]
    for m, b, a in zip(probes, before, after):
        print(f"[demo] {m[-1]['content']!r}\n    before: {b!r}\n    after:  {a!r}")
    for tag, mm in (("before", model), ("after", pm)):
        ok, got = animal_score(mm, hf_tok)
        print(f"[demo] 'What does the <animal> say?' {tag}: {ok}/{len(SOUNDS)} right: {got}")
    return pm


# --------------------------------------------------------------------------------------------

def tokenizer(tok_dir: Path, fresh: bool):
    """The byte-level BPE, trained on English and rendered conversations unless cached."""
    if fresh or not (tok_dir / "tokenizer.json").exists():
        rng = random.Random(11)
        corpus = ref.english_corpus(seed=11, n_paragraphs=6000, rich=True)
        for _ in range(3000):
            corpus.append("\n".join(f"{m['role']}\n{m['content']}" for m in random_conversation(rng)))
            corpus.append(ref.english_story(rng) + f" Then {rng.choice(ref.NAMES)} heard a {rng.choice(SOUND_WORDS)}.")
        tok = ref.train_tokenizer(corpus, VOCAB)
        ref.save_tokenizer_dir(tok, tok_dir)
    return ref.load_hf_tokenizer(tok_dir)


def pretrained(hf_tok, tok_dir: Path, hf_dir: Path, fresh: bool, steps: int,
               n_docs: int = 60000):
    """The HF model pretrained on the synthetic corpus unless its checkpoint is cached."""
    if fresh or not (hf_dir / "model.safetensors").exists():
        docs = pretrain_documents(hf_tok, seed=12, n_docs=n_docs)
        rows = packed_rows(docs, SEQ)
        print(f"pretraining corpus: {len(docs)} documents, {sum(map(len, docs))} tokens, {len(rows)} rows of {SEQ}")
        cfg = ref.qwen35_text_config(eos_token_id=hf_tok.convert_tokens_to_ids(ref.EOS_TOKEN),
                                     **MODEL_CONFIG)
        model = ref.build_model(cfg, seed=PRETRAIN["seed"])
        print(f"model: {sum(p.numel() for p in model.parameters())} parameters")
        t0 = time.time()
        pretrain(model, rows, steps, PRETRAIN["batch"], PRETRAIN["lr"], PRETRAIN["warmup"],
                 PRETRAIN["weight_decay"], PRETRAIN["seed"])
        print(f"pretraining took {time.time() - t0:.0f}s")
        ref.save_hf_checkpoint(model, tok_dir, hf_dir)
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    return Qwen3_5ForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").float().eval()


def convert(model, hf_tok, hf_dir: Path, out: Path) -> None:
    """default-model.gguf by the pinned converter, its layout and a forward over it checked."""
    import numpy as np
    gguf_path = ref.convert_to_gguf(hf_dir, out / "default-model.gguf", "f32")
    qg.check_gguf_layout(model, gguf_path)
    probe = hf_tok.encode(ref.render_chat(hf_tok, [{"role": "user", "content": "What is 2+3?"}],
                                          add_generation_prompt=True), add_special_tokens=False)
    err = float(np.abs(qg.numpy_forward_gguf(gguf_path, probe) - ref.hf_logprobs(model, probe)).max())
    print(qg.gguf_summary(gguf_path).split("\n  ")[0])
    print(f"numpy-from-GGUF vs HF on a {len(probe)}-token prompt: max |dlogprob| {err:.2e}")
    assert err < 1e-3, err


def show_base(model, hf_tok, n_sums: int = 50) -> None:
    """What the base model answers: a few greedy chats, and its exact-sum score."""
    for msgs in ([{"role": "user", "content": "What is 12+7?"}],
                 [{"role": "user", "content": "What is 9 minus 4?"}],
                 [{"role": "user", "content": "What colour is the sky?"}],
                 [{"role": "user", "content": "Count to 5."}],
                 [{"role": "user", "content": "Anna has a green kite. What colour is the kite?"}],
                 [{"role": "user", "content": "Hello!"}],
                 [{"role": "user", "content": "What does the cow say?"}]):
        print(f"[base] {msgs[-1]['content']!r} -> {greedy(model, hf_tok, msgs)!r}")
    correct = 0
    rng = random.Random(5)
    for _ in range(n_sums):
        q, ans = sum_question(rng)
        g = greedy(model, hf_tok, [{"role": "user", "content": q}], 12)
        correct += g.endswith("<|im_end|>") and answer_of(g) == ans
    print(f"[base] arithmetic: {correct}/{n_sums} exact")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/pytrain-default-model"))
    ap.add_argument("--out", type=Path, default=ref.REPO / "pytrain" / "assets")
    ap.add_argument("--fresh", action="store_true", help="redo the tokenizer and pretraining")
    ap.add_argument("--steps", type=int, default=PRETRAIN["steps"])
    ap.add_argument("--docs", type=int, default=60000, help="pretraining documents (the smoke "
                    "test, tests/test_scripts_reference.py: a few hundred)")
    ap.add_argument("--sums", type=int, default=50, help="sums the base model is scored on")
    ap.add_argument("--check-demo", action="store_true", help="run the HF+PEFT LoRA learnability check")
    ap.add_argument("--demo-steps", type=int, default=150)
    ap.add_argument("--demo-lr", type=float, default=1e-3)
    ap.add_argument("--demo-rank", type=int, default=8)
    ap.add_argument("--demo-schedule", choices=["cosine", "constant"], default="cosine")
    a = ap.parse_args()

    import torch
    # One thread: on a 2-core machine shared with other jobs, two OpenMP threads made steps 5-40x
    # slower (a busy core stalls every parallel region); one thread gives a steady ~1 s per step.
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_flush_denormal(True)

    work, out = a.work, a.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir, hf_dir = work / "tokenizer", work / "hf"
    hf_tok = tokenizer(tok_dir, a.fresh)
    model = pretrained(hf_tok, tok_dir, hf_dir, a.fresh, a.steps, a.docs)
    convert(model, hf_tok, hf_dir, out)
    train = demo_records(seed=21, n=320, templates=SOUND_QUESTIONS)
    valid = demo_records(seed=22, n=50, templates=SOUND_QUESTIONS + [HELD_OUT_QUESTION] * 3)
    write_jsonl(out / "demo_train.jsonl", train)
    write_jsonl(out / "demo_valid.jsonl", valid)
    show_base(model, hf_tok, a.sums)
    if a.check_demo:
        torch.manual_seed(0)
        check_demo(model, hf_tok, train, valid, steps=a.demo_steps, lr=a.demo_lr, rank=a.demo_rank,
                   alpha=2.0 * a.demo_rank, schedule=a.demo_schedule)
    return 0


if __name__ == "__main__":
    sys.exit(main())
