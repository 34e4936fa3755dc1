"""Benchmark: one DPO training step, pytrain against TRL's DPOTrainer + PEFT, on the CPU.

Why: preference training (pytrain/step/preference.py) should cost no more than the reference
stack's on the same model, the same pairs and the same thread count.  A benchmark, not a test:
nothing is asserted about speed (tests/test_bench_dpo.py smoke-tests it at the toy size).
Writes a markdown report to ``bench_results/train-dpo.md`` (+ the raw ``train-dpo.json``).

Models (``--models``, comma-separated, default ``mid``; scripts/bench_common.py's SPECS, made
once by the reference stack and cached under ``--cache``, exactly as scripts/bench_train.py makes
and finds them: ``bench_train.prepare``): ``mid`` (hidden 512, 8 layers, vocab 151936, F32) and
``toy`` (the smoke tests' model).

The step, the same on both sides:
  * the pairs: ``--pairs`` P (default 2), each a prompt of ``--prompt-len`` (128) random token
    ids and two different completions of ``--completion-len`` (128) random ids (seeded,
    uniform over the model's vocabulary): 2P sequences (chosen rows, then rejected rows), no
    padding.  ``--short-rejected K`` cuts the last pair's rejected completion by K tokens (its
    row is then right-padded on both sides).  Tokens = the real tokens of the 2P sequences
    (2P x 256 = 1024 by default); targets = the completion tokens;
  * LoRA r=16, alpha=32, dropout 0 on q/k/v/o of the full-attention layers (bench_train's
    adapter; both start from B = 0); AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0,
    global-norm clipping at 1.0; DPO, sigmoid loss, beta 0.1, no label smoothing; float32;
  * pytrain: ``PreferenceTrainer(model, adapter, AdamWSettings(...), PreferenceSettings("dpo",
    0.1, "sigmoid", 0.0))``; the pairs as ``pytrain.data.preference.Pair``s, one
    ``pair_batch``; ``trainer.compute_reference("train", pairs, P)`` once before training
    (timed once on its own: the "reference pass"), then the timed step is
    ``trainer.step([pair_batch], lr)``: a forward-only pass for the policy's sequence
    log-probabilities, the DPO loss and its derivatives on the host, then one forward +
    backward weighted by them, the gradient norm, clipping and AdamW;
  * TRL 1.16 (``--ref-python``'s torch / transformers / PEFT / TRL): ``Qwen3_5ForCausalLM``
    (float32, sdpa attention) handed to ``DPOTrainer(model, DPOConfig(...), peft_config=
    LoraConfig(...))`` - TRL wraps it itself, as a user fine-tuning a fresh LoRA does, and its
    reference is then the same model with the adapter disabled (a model already wrapped in
    PEFT would instead get a frozen copy of its adapter as "ref").  DPOConfig: the settings
    above, ``per_device_train_batch_size`` P, ``max_length`` None (no truncation),
    ``bf16=False`` and ``gradient_checkpointing=False`` (both default True in TRL 1.16: bf16
    would not be float32, and pytrain's preference step keeps every activation too),
    ``use_cpu``, constant learning rate, the Trainer's default optimizer (``optim``
    adamw_torch_fused under torch >= 2.8).  Two variants, each in its own process:
      - "TRL" = TRL's default ``precompute_ref_log_probs=False``: each step also runs the
        reference forward (no grad, adapter disabled) on the batch;
      - "TRL pre" = ``precompute_ref_log_probs=True``: the reference log-probabilities are
        computed once before training by TRL's own ``_precompute_ref_logps`` (DataLoader over
        the dataset, ``compute_ref_log_probs`` per batch, cached as dataset columns; timed
        once: its "reference pass"), and the step reads them from the batch.
    TRL 1.16's ``DPOTrainer`` does not take a pre-tokenized dataset (``_prepare_dataset``
    always tokenizes text: ``prompt_ids``/``chosen_ids``/``rejected_ids`` columns alone fail in
    its ``extract_prompt`` with KeyError 'chosen'), and random ids are no text.  So the trainer
    is built with a one-record text placeholder, and the pairs' ids go in as the dataset TRL's
    tokenization would have made (``trainer.train_dataset``; for "TRL pre" through
    ``_precompute_ref_logps``), collated by the trainer's own ``DataCollatorForPreference``
    (chosen rows then rejected rows, ``completion_mask``).  The timed step is the Trainer
    loop's body for one optimizer step without gradient accumulation:
    ``trainer.training_step(model, batch)`` (TRL's ``compute_loss``: the policy forward through
    its fused LM head / chunked log-softmax, the reference forward or the precomputed values,
    the loss and its logged metrics; then ``backward``), ``trainer._clip_grad_norm(model)``
    (accelerate's ``clip_grad_norm_``), ``optimizer.step()``, ``model.zero_grad()``; the
    learning-rate scheduler (constant), logging and callbacks are left out.

Timing (as bench_train): each side in its own subprocess (peak RSS = its VmHWM), ``--warmup``
steps (default 1), then timed steps until ``--steps`` clean ones are in (other processes kept
< 0.3 cores busy beyond the cores a side leaves free; ``bench_common.clean_loop``) or 3x that many
were run; tokens/s = tokens / median clean step.  The first step (the first warm-up one) starts
from B = 0, so the policy equals the reference and its loss is log 2 = 0.693147 on every side:
the report shows each side's first-step loss, rewards and margins, and the reference log-
probabilities of pytrain and TRL side by side.  The SFT ratio of the same model and thread
count is read from ``bench_results/train.md`` (its row "| MODEL | THREADS |", column
"ratio pytrain/HF") for comparison.

How (from the repo root, with the project's python and the reference interpreter):

    python -m scripts.bench_dpo --ref-python /work/main/.refenv/bin/python --models mid \
        --threads 2 --steps 5 --out bench_results/train-dpo.md
    python -m scripts.bench_dpo --ref-python .refenv/bin/python --models toy --steps 1 \
        --out /tmp/x.md                                      # the smoke test's size
    python -m scripts.bench_dpo --report-from bench_results/train-dpo.json   # re-render
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts.bench_common import ALPHA, LR, MAX_NORM, RANK, REPO, SPECS

BETA = 0.1
SIDES = {"pytrain": "pytrain", "trl": "TRL", "trl_pre": "TRL pre"}   # row key -> label
WORKERS = {"pytrain": "pytrain", "trl": "trl", "trl_pre": "trl-pre"}  # row key -> --worker
SFT_MD = REPO / "bench_results" / "train.md"


def make_pairs(vocab: int, n: int, prompt: int, completion: int, seed: int,
               short_rejected: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    """n (prompt, chosen, rejected) id lists, seeded and uniform over the vocabulary; chosen and
    rejected differ; the last pair's rejected is ``short_rejected`` tokens shorter."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c, r = (rng.integers(0, vocab, size=k).tolist()
                   for k in (prompt, completion, completion))
        while r == c:
            r = rng.integers(0, vocab, size=completion).tolist()
        if short_rejected and i == n - 1:
            r = r[:max(1, completion - short_rejected)]
        out.append((p, c, r))
    return out


def pair_tokens(pairs) -> tuple[int, int]:
    """(real tokens, completion tokens) of the 2n sequences."""
    return (sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs),
            sum(len(c) + len(r) for _, c, r in pairs))


def _pairs_of(a):
    return make_pairs(a.vocab, a.pairs, a.prompt_len, a.completion_len, a.seed, a.short_rejected)


def _finish(res: dict, stats: dict, tokens: int) -> dict:
    res.update(stats)
    res["peak_rss"] = bc.proc_status()["VmHWM"]
    res["tokens"] = tokens
    res["tokens_per_s"] = tokens / res["median_s"]
    return res


# --------------------------------------------------------------------------------------------
# pytrain worker
# --------------------------------------------------------------------------------------------

def pytrain_worker(a) -> dict:
    import numpy as np

    import pytrain
    from pytrain import ggml
    from pytrain.data.preference import Pair, pair_batch
    from pytrain.models import lora
    from pytrain.models.lora_targets import lora_param_count, select_targets
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.preference import PreferenceSettings, PreferenceTrainer
    P, threads = a.pairs, int(a.threads)
    t0 = time.perf_counter()
    m = pytrain.load_model(a.gguf, device="cpu", threads=threads)
    names = select_targets(m.config)
    ad = lora.create(m.runtime, m.config, names, RANK, ALPHA, seed=0)
    tr = PreferenceTrainer(m, ad, AdamWSettings(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8,
                                                weight_decay=0.0, max_grad_norm=MAX_NORM),
                           PreferenceSettings("dpo", BETA, "sigmoid", 0.0))
    load_s = time.perf_counter() - t0
    raw = _pairs_of(a)
    pairs = [Pair(*(np.asarray(x, np.int32) for x in t), f"bench pair {i}")
             for i, t in enumerate(raw)]
    pb = pair_batch(pairs, list(range(P)), m.pad_id)
    _, ref_s, ref_others, _ = bc.timed(lambda: tr.compute_reference("train", pairs, P))
    ref_c, ref_r = tr.reference["train"]
    first, losses, warm = None, [], []
    for _ in range(a.warmup):
        t1 = time.perf_counter()
        r = tr.step([pb], LR)
        warm.append(time.perf_counter() - t1)
        first = first or r
        losses.append(r.loss)
    stats, results, _use = bc.clean_loop(lambda: tr.step([pb], LR), a.runs, threads)
    first = first or results[0]
    losses += [r.loss for r in results]
    tokens = results[0].tokens
    assert tokens == pair_tokens(raw)[0], (tokens, pair_tokens(raw))
    res = dict(side="pytrain", load_s=load_s, warmup_s=warm, ref_pass_s=ref_s,
               ref_pass_others=ref_others, ref_chosen=ref_c.tolist(), ref_rejected=ref_r.tolist(),
               first_loss=first.loss, first_grad_norm=first.grad_norm, first_metrics=first.extra,
               losses=losses, pad_id=m.pad_id, batch_shape=list(pb.tokens.shape),
               lora_params=lora_param_count(m.config, names, RANK), lora_names=len(names),
               backends=[ggml.backend_name(b) for b in m.runtime.backends],
               blas=m.runtime.blas is not None)
    return _finish(res, stats, tokens)


# --------------------------------------------------------------------------------------------
# TRL worker
# --------------------------------------------------------------------------------------------

def trl_worker(a, precompute: bool) -> dict:
    import tempfile

    import torch
    torch.set_num_threads(int(a.threads))
    import accelerate
    import datasets
    import peft
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    from trl import DPOConfig, DPOTrainer
    P = a.pairs
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.hf)
    model = Qwen3_5ForCausalLM.from_pretrained(a.hf, dtype=torch.float32,
                                               attn_implementation=a.hf_attn)
    args = DPOConfig(output_dir=tempfile.mkdtemp(prefix="bench_dpo-"),
                     per_device_train_batch_size=P, precompute_ref_batch_size=P, max_length=None,
                     learning_rate=LR, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                     weight_decay=0.0, max_grad_norm=MAX_NORM, lr_scheduler_type="constant",
                     beta=BETA, loss_type=["sigmoid"], label_smoothing=0.0,
                     precompute_ref_log_probs=precompute, bf16=False,
                     gradient_checkpointing=False, use_cpu=True, report_to="none",
                     save_strategy="no", dataloader_num_workers=0, seed=a.seed)
    # TRL tokenizes whatever dataset it is given (see the docstring): a text placeholder here,
    # the pairs' ids below
    placeholder = datasets.Dataset.from_dict({"prompt": ["The cat"], "chosen": [" sat."],
                                              "rejected": [" ran."]})
    lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    trainer = DPOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tok,
                         peft_config=lcfg)
    assert trainer.ref_model is None and list(trainer.model.peft_config) == ["default"]
    assert trainer.precompute_ref_logps is precompute and trainer.loss_types == ["sigmoid"]
    load_s = time.perf_counter() - t0
    raw = _pairs_of(a)
    ds = datasets.Dataset.from_dict({"prompt_ids": [p for p, _, _ in raw],
                                     "chosen_ids": [c for _, c, _ in raw],
                                     "rejected_ids": [r for _, _, r in raw]})
    if precompute:     # what __init__ does to the train dataset, on the pairs
        ds, ref_s, ref_others, _ = bc.timed(lambda: trainer._precompute_ref_logps(ds, "train", P))
        trainer.train_dataset = ds
        batch = trainer.data_collator([ds[i] for i in range(P)])
        ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        ref_what = "DPOTrainer._precompute_ref_logps over the dataset (DataLoader, cached columns)"
    else:
        trainer.train_dataset = ds
        batch = trainer.data_collator([ds[i] for i in range(P)])
        (ref_c, ref_r), ref_s, ref_others, _ = bc.timed(
            lambda: trainer.compute_ref_log_probs(trainer.model, batch))
        ref_what = "DPOTrainer.compute_ref_log_probs on the batch (the reference forward of a step)"
    tokens = int(batch["attention_mask"].sum())
    assert tokens == pair_tokens(raw)[0], (tokens, pair_tokens(raw))
    model = trainer.model
    opt = trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1    # what Trainer's loop sets (no accumulation)
    mets = trainer._metrics["train"]

    def one() -> dict:
        loss = trainer.training_step(model, batch)
        norm = trainer._clip_grad_norm(model)
        opt.step()
        model.zero_grad()
        return dict(loss=float(loss), grad_norm=float(norm),
                    metrics={k: mets[k][-1] for k in ("rewards/chosen", "rewards/rejected",
                                                      "rewards/margins", "rewards/accuracies")})

    first, warm, out = None, [], []
    for _ in range(a.warmup):
        t1 = time.perf_counter()
        out.append(one())
        warm.append(time.perf_counter() - t1)
    stats, results, _use = bc.clean_loop(one, a.runs, int(a.threads))
    out += results
    first = out[0]
    res = dict(side="trl_pre" if precompute else "trl", precompute=precompute, load_s=load_s,
               warmup_s=warm, ref_pass_s=ref_s, ref_pass_others=ref_others, ref_pass_what=ref_what,
               ref_chosen=[float(x) for x in ref_c], ref_rejected=[float(x) for x in ref_r],
               first_loss=first["loss"], first_grad_norm=first["grad_norm"],
               first_metrics=first["metrics"], losses=[o["loss"] for o in out],
               batch_shape=list(batch["input_ids"].shape), pad_id=int(tok.pad_token_id),
               optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, "
                         f"foreach={opt.defaults.get('foreach')})", optim=str(args.optim),
               lora_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
               lora_names=sum(1 for n, _ in model.named_modules()
                              if n.endswith(".lora_A.default")),
               attn=model.config._attn_implementation, torch=torch.__version__,
               transformers=transformers.__version__, peft=peft.__version__,
               trl=trl.__version__, datasets=datasets.__version__,
               accelerate=accelerate.__version__)
    return _finish(res, stats, tokens)


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------

def run_worker(python: str, key: str, model: dict, a, threads: int) -> dict | None:
    """One worker process (``key``: pytrain, trl or trl_pre); its RESULT, or None."""
    cmd = [python, "-m", "scripts.bench_dpo", "--worker", WORKERS[key], "--threads",
           str(threads), "--runs", str(a.steps), "--warmup", str(a.warmup), "--pairs",
           str(a.pairs), "--prompt-len", str(a.prompt_len), "--completion-len",
           str(a.completion_len), "--short-rejected", str(a.short_rejected), "--vocab",
           str(model["vocab"]), "--seed", str(a.seed), "--hf-attn", a.hf_attn,
           "--nice", str(a.nice)]
    cmd += ["--gguf", str(model["gguf"])] if key == "pytrain" else ["--hf", str(model["hf"])]
    busy = bc.wait_quiet(a.quiet_wait) if a.quiet_wait else bc.machine_busy()
    what = f"{SIDES[key]}, {threads} thread{'s' if threads > 1 else ''}"
    print(f"  [{model['name']}] {what} ... (machine busy {busy:.2f} cores before; load average "
          f"{os.getloadavg()[0]:.2f})", flush=True)
    res, r = bc.run_result(cmd, bc.worker_env(threads), start_new_session=bool(a.nice))
    if res is None:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
        print(f"  [{model['name']}] {what} FAILED (exit {r.returncode})", flush=True)
        return None
    res.update(busy_before=busy, threads=threads)
    print(f"  [{model['name']}] {what}: {res['tokens_per_s']:.1f} tokens/s (step "
          f"{res['median_s']:.3f} s; {res['n_clean']} clean of {len(res['times'])}), first loss "
          f"{res['first_loss']:.6f}, reference pass {res['ref_pass_s']:.3f} s, peak RSS "
          f"{bc.fmt_gib(res['peak_rss'])}", flush=True)
    return res


def sft_ratio(name: str, threads: int, md: Path = SFT_MD) -> str | None:
    """The "ratio pytrain/HF" cell of ``md``'s row "| NAME | THREADS |" (bench_train's SFT
    table), or None."""
    if not md.exists():
        return None
    header = None
    for line in md.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "ratio pytrain/HF" in cells and cells[:2] == ["model", "threads"]:
            header = cells
        elif header and cells[:2] == [name, str(threads)] and len(cells) == len(header):
            return cells[header.index("ratio pytrain/HF")].strip("*")
    return None


def bench_row(name: str, model: dict, a, threads: int) -> dict:
    print(f"[{name}] {a.pairs} pairs, prompt {a.prompt_len} + completions {a.completion_len}, "
          f"{a.warmup} warm-up + {a.steps} clean steps, {threads} threads", flush=True)
    row = dict(model, threads=threads, pairs=a.pairs, prompt_len=a.prompt_len,
               completion_len=a.completion_len, short_rejected=a.short_rejected)
    for key in SIDES:
        row[key] = run_worker(a.pytrain_python if key == "pytrain" else a.ref_python, key, model,
                              a, threads)
    p = row["pytrain"]
    for key in ("trl", "trl_pre"):
        t = row[key]
        row[f"ratio_{key}"] = p["tokens_per_s"] / t["tokens_per_s"] if p and t else None
        if row[f"ratio_{key}"] is not None:
            print(f"  [{name}] pytrain / {SIDES[key]} = {row[f'ratio_{key}']:.2f}", flush=True)
    sft = sft_ratio(name, threads)
    row["sft_ratio"] = sft
    row["sft_source"] = f"{SFT_MD.relative_to(REPO)}, row '| {name} | {threads} |', column " \
                        f"'ratio pytrain/HF'"
    return row


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------

def info_lines(a, wall_s: float) -> list[str]:
    m = bc.machine_facts()
    dirty = bc.dirty("pytrain", "native", "scripts/bench_dpo.py", "scripts/bench_common.py")
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; pytrain commit {m['commit']}"
            + (f" (uncommitted changes in: {', '.join(dirty)})" if dirty else "")
            + f"; the whole run took {wall_s / 60:.1f} min",
            f"- command: `{bc.command_line('bench_dpo')}`",
            f"- CPU: {m['cpu']}, {os.cpu_count()} cores visible, {m['mem']} RAM; threads per side: "
            f"**{', '.join(map(str, a.thread_list))}** (pytrain `threads=N`, torch "
            f"`set_num_threads(N)`, OMP/MKL/OPENBLAS_NUM_THREADS=N)",
            f"- ggml {m['ggml']}",
            f"- python {platform.python_version()} (pytrain side); worker processes at niceness "
            f"{a.nice:+d}"]


def _v(d: dict | None, k: str, fmt: str = "{:.3f}") -> str:
    return "-" if not d or d.get(k) is None else fmt.format(d[k])


def _all(r: dict, f) -> str:
    return " / ".join(f(r.get(k)) for k in SIDES)


def _metric(d, k):
    return "-" if not d else f"{d['first_metrics'][k]:+.3g}"


def report(rows: list[dict], info: list[str], notes: list[str] | None = None) -> str:
    hf = next((r[k] for r in rows for k in ("trl", "trl_pre") if r.get(k)), None) or {}
    L = ["# One DPO training step: pytrain vs TRL DPOTrainer + PEFT (CPU)", "",
         "Made by `python -m scripts.bench_dpo` (its docstring says exactly what each side's "
         "timed step runs). Tokens/s = real tokens of the 2P sequences / median wall time of one "
         "optimizer step after warm-up, over the *clean* timed steps (other processes kept < 0.3 "
         "cores busy beyond the cores a side leaves free; over all steps when none was clean). "
         "Each side runs in its own process; peak RSS = VmHWM of that process. **TRL** = "
         "DPOTrainer's default, the reference forward (adapter disabled, no grad) in every step; "
         "**TRL pre** = `precompute_ref_log_probs=True`, the reference log-probs computed once "
         "before training. pytrain always precomputes its reference (`compute_reference`).", ""]
    L += info + [
        f"- TRL side: torch {hf.get('torch', '?')}, transformers {hf.get('transformers', '?')}, "
        f"peft {hf.get('peft', '?')}, trl {hf.get('trl', '?')}, datasets "
        f"{hf.get('datasets', '?')}, accelerate {hf.get('accelerate', '?')}; attn "
        f"{hf.get('attn', '?')}, float32, bf16=False, gradient_checkpointing=False; optimizer "
        f"{hf.get('optimizer', '?')} (optim={hf.get('optim', '?')})",
        f"- LoRA r={RANK}, alpha={ALPHA:g}, dropout 0, q/k/v/o of the full-attention layers; AdamW "
        f"lr {LR:g}, betas 0.9/0.999, eps 1e-8, wd 0, clip {MAX_NORM:g}; DPO sigmoid, "
        f"beta {BETA:g}"]
    for r in rows:
        L.append(f"- {r['name']}: {r['desc']}; {r.get('n_params') or 0:,} parameters; "
                 f"{r['pairs']} pairs, prompt {r['prompt_len']} + completions "
                 f"{r['completion_len']}" + (f" (the last rejected {r['short_rejected']} shorter)"
                                              if r.get("short_rejected") else "")
                 + ", random ids, chosen rows then rejected rows")
    L += ["", "| model | threads | pairs (tokens, batch) | steps clean/all pytrain / TRL / TRL pre "
          "| step s pytrain | step s TRL | step s TRL pre | tokens/s pytrain / TRL / TRL pre | "
          "ratio pytrain/TRL | ratio pytrain/TRL pre | SFT ratio pytrain/HF (train.md) | peak RSS "
          "pytrain / TRL / TRL pre | reference pass s pytrain / TRL / TRL pre |",
          "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        p = r.get("pytrain") or {}
        L.append("| " + " | ".join([
            r["name"], str(r["threads"]),
            f"{r['pairs']} ({p.get('tokens', '-')}, "
            f"{' x '.join(map(str, p.get('batch_shape', [])))})",
            _all(r, lambda d: f"{d['n_clean']}/{len(d['times'])}" if d else "-"),
            _v(r.get("pytrain"), "median_s"), _v(r.get("trl"), "median_s"),
            _v(r.get("trl_pre"), "median_s"),
            _all(r, lambda d: _v(d, "tokens_per_s", "{:.1f}")),
            "-" if r.get("ratio_trl") is None else f"**{r['ratio_trl']:.2f}**",
            "-" if r.get("ratio_trl_pre") is None else f"**{r['ratio_trl_pre']:.2f}**",
            r.get("sft_ratio") or "-",
            _all(r, lambda d: bc.fmt_gib(d and d["peak_rss"])),
            _all(r, lambda d: _v(d, "ref_pass_s"))]) + " |")
    L += ["", "## The first step (from B = 0: policy = reference, so the loss is log 2 = "
          f"{math.log(2):.6f})", "",
          "| model | threads | side | loss | grad norm | rewards/chosen | rewards/rejected | "
          "rewards/margins | later losses | reference log-probs chosen / rejected |",
          "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        for k, label in SIDES.items():
            d = r.get(k)
            if not d:
                L.append(f"| {r['name']} | {r['threads']} | {label} | - | - | - | - | - | - | - |")
                continue
            refs = ", ".join(f"{c:.4f} / {x:.4f}"
                             for c, x in zip(d["ref_chosen"], d["ref_rejected"]))
            L.append(f"| {r['name']} | {r['threads']} | {label} | {d['first_loss']:.6f} | "
                     f"{d['first_grad_norm']:.6g} | {_metric(d, 'rewards/chosen')} | "
                     f"{_metric(d, 'rewards/rejected')} | {_metric(d, 'rewards/margins')} | "
                     f"{', '.join(f'{x:.6f}' for x in d['losses'][1:]) or '-'} | {refs} |")
    L += ["", "Grad norm: before clipping. It is not comparable across pytrain and TRL: the LoRA A "
          "matrices start from different random streams (pytrain `lora.create(seed=0)`, PEFT's "
          "kaiming-uniform under TRL's seed); B = 0 on both, so the first loss and rewards are "
          "comparable. The later losses drift apart for the same reason.",
          "", "Reference pass (each timed once, before the first training step): pytrain "
          "`PreferenceTrainer.compute_reference` over the pairs; TRL: "
          + next((r["trl"]["ref_pass_what"] for r in rows if r.get("trl")), "-") + "; TRL pre: "
          + next((r["trl_pre"]["ref_pass_what"] for r in rows if r.get("trl_pre")), "-") + ".",
          "", "SFT ratio: the LoRA SFT step of scripts/bench_train.py on the same model and thread "
          "count (batch 2 x 256, half of each row masked), as committed: "
          + "; ".join(f"{r['sft_source']} = {r.get('sft_ratio') or 'no such row'}" for r in rows)
          + "."]
    if notes:
        L += [""] + [f"- note: {n}" for n in notes]
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mid", help=f"comma-separated, of {', '.join(SPECS)}")
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--steps", type=int, default=5, help="clean timed steps wanted per side")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--completion-len", type=int, default=128)
    ap.add_argument("--short-rejected", type=int, default=0,
                    help="the last pair's rejected completion this many tokens shorter (padding)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytrain" / "bench")
    ap.add_argument("--ref-python", default="/opt/refenv/bin/python")
    ap.add_argument("--pytrain-python", default=sys.executable)
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of the worker processes; on a shared machine -20 (root)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each process, wait up to this many seconds for other processes "
                         "to use < 0.3 cores (0: do not wait)")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "train-dpo.md")
    ap.add_argument("--json", type=Path, default=None, help="default: the .json beside --out")
    ap.add_argument("--note", dest="notes", action="append", default=[])
    ap.add_argument("--report-from", type=Path, default=None,
                    help="only rewrite the markdown from the --json of an earlier run")
    # internal
    ap.add_argument("--worker", choices=sorted(WORKERS.values()), help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.thread_list = [int(t) for t in str(a.threads).split(",") if t.strip()]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        bc.renice(a.nice)
        a.threads = a.thread_list[0]
        res = (pytrain_worker(a) if a.worker == "pytrain" else trl_worker(a, a.worker == "trl-pre"))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if a.report_from:
        j = json.loads(a.report_from.read_text())
        md = report(j["rows"], j["info"], a.notes or j.get("notes"))
    else:
        from scripts.bench_train import prepare
        t_start = time.time()
        rows = []
        for name in [m.strip() for m in a.models.split(",") if m.strip()]:
            if name not in SPECS:
                print(f"[{name}] unknown model (one of {', '.join(SPECS)})", flush=True)
                continue
            model = prepare(name, a)
            for threads in a.thread_list if model else []:
                rows.append(bench_row(name, model, a, threads))
        if not rows:
            print("nothing was benchmarked")
            return 1
        info = info_lines(a, time.time() - t_start)
        js = a.json or a.out.with_suffix(".json")
        js.parent.mkdir(parents=True, exist_ok=True)
        js.write_text(json.dumps(dict(rows=rows, info=info, notes=a.notes), default=str, indent=1))
        print(f"raw results in {js}")
        md = report(rows, info, a.notes)
        if not all(r.get(k) for r in rows for k in SIDES):
            print("a side failed: its output is above", flush=True)
    print(md)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    print(f"wrote {a.out}")
    return 0 if a.report_from or all(r.get(k) for r in rows for k in SIDES) else 1


if __name__ == "__main__":
    sys.exit(main())
