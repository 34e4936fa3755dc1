"""Make tests/fixtures/{qwen35,llama}/pref_golden.npz: TRL's own preference losses (DPO sigmoid,
IPO, robust; ORPO) with PEFT LoRA on the tiny `gqa` models, their metrics, per-sequence
log-probabilities and LoRA gradients, in float32 and in true float64.

Why: pytrain's preference training (chosen/rejected batching, the reference = adapter off,
the DPO/IPO/robust/ORPO losses, their metrics and gradients through the adapter hook) is
checked against TRL 1.16.0 running its own code (DPOTrainer, trl.experimental.orpo
ORPOTrainer) on the very models pytrain loads, on a padded batch of three pairs with a
multi-turn prompt and chosen/rejected of unequal lengths (in one pair each way); the float64
run says how much of any pytrain-vs-TRL difference is float32 rounding.

What:
  * models: qwen35 `gqa` rebuilt and checked against the committed gqa.npz
    (``make_peft_golden.build_gqa`` / ``check_rebuilt``), float64 on the GGUF's exact weights
    (``make_peft_golden.float64_model``); llama `gqa` (``make_llama_fixtures.build``),
    checked against the committed llama/gqa.npz;
  * LoRA r 4, alpha 8, dropout 0, bias none, on the modules of the PEFT goldens (qwen35: the
    LoraConfig ``make_peft_golden.wrap_peft`` builds, q/k/v/o of full-attention layers 1 and 3;
    llama: q/k/v/o of every layer), with their deterministic non-zero A and B
    (``lora_values`` of each generator: the values are those of peft_grads.npz and
    peft_gqa.npz, checked here).  The LoraConfig is given to the trainer (``peft_config``), so
    TRL wraps the model itself, as a user does; TRL then takes the reference as the same
    model with the adapter disabled (``use_adapter(model, None)``).  (Given an already
    wrapped PeftModel, TRL 1.16 would instead copy its adapter into a frozen "ref" adapter.)
    The A/B values are set after the trainer is built (TRL re-initialises on wrapping);
  * the batch: qwen35 - the 3 conversational records of tests/fixtures/qwen35/pref_records.jsonl
    (record 0: system, user, assistant, user prompt), tokenized by TRL's own ``_prepare_dataset``
    (the DPOTrainer is built with them; prompt_ids / chosen_ids / rejected_ids are read from
    ``trainer.train_dataset``) with the fixture tokenizer (tests/fixtures/qwen35/tokenizer: its
    tokenizer_config.json carries the Qwen3.5 chat template; no BOS);  llama - seeded random
    ids in [0, 480) (regular BPE ids of the tokenizer the llama GGUFs carry, the qwen35 one;
    pad 480), prompt lengths 6, 3, 9, chosen 5, 8, 2, rejected 7, 4, 6 (its DPOTrainer gets a
    one-row placeholder dataset, since it requires one).  Both are collated by the trainer's
    own ``DataCollatorForPreference`` (right padding with the pad id, chosen rows then rejected
    rows, completion_mask on completion tokens);
  * DPO (``dpo_sigmoid`` loss_type ["sigmoid"] beta 0.1; ``dpo_ipo`` ["ipo"] beta 0.1;
    ``dpo_robust`` ["robust"] beta 0.1 label_smoothing 0.1): one DPOTrainer per loss
    (DPOConfig defaults except: use_cpu, bf16 False and gradient_checkpointing False - both
    default True in DPOConfig; checkpointing only trades memory for a recomputed forward, bf16
    would not be float32), model in train mode (dropout is disabled by TRL and is 0 anyway);
    ``trainer.compute_loss(model, batch)`` (TRL's ``_compute_loss``, with its fused LM head:
    chunked log-softmax kernel, reference forward under ``use_adapter(model, None)``), then
    ``loss.backward()``; metrics from ``trainer._metrics["train"]``;
  * ORPO (beta = lambda = 0.1): a real ORPOTrainer (same model, LoraConfig, values; its own
    dataset tokenization is not used) and its own ``concatenated_forward`` (full logits,
    ``get_batch_logps(average_log_prob=True)`` over the completion tokens) and
    ``odds_ratio_loss`` (``log1mexp``), on the same collated batch (labels = input ids with
    -100 off the completion).  ONE DELIBERATE DIFFERENCE from TRL: TRL's chosen NLL covers prompt
    and completion (labels from the attention mask); pytrain counts completion tokens only
    (the paper's definition), so the golden loss is CrossEntropyLoss (mean over labels !=
    -100) of the chosen rows' completion tokens minus mean(beta * logsigmoid(log_odds)).  TRL's
    own full-sequence variant is ``get_batch_loss_metrics``' loss, kept as
    ``orpo.loss_trl_full_nll`` (float32 run, not differentiated);
  * per-sequence log-probabilities: a separate no-grad forward through TRL's own path
    (``model(..., labels, fused_lm_head=True).log_probs`` summed over the completion;
    ``trainer.compute_ref_log_probs`` for the reference); the DPO losses recomputed from them
    with TRL's formulas equal TRL's loss to rounding (asserted), as do the logged logps means;
  * float64: the same trainers on the float64 models, TRL's same code in true float64:
    ``true_float64`` over the modeling module and over trl.kernels.chunked_logprob (the fused LM
    head keeps its logsumexp statistics and gradient accumulators in float32 by design:
    ``torch.float32`` means float64 there and ``Tensor.float()`` means ``.double()``, which also
    lifts ORPO's ``.float()`` casts), with torch's default dtype float64 (the integer counts TRL
    turns into floats: IPO's lengths, the token accuracy); a TorchFunctionMode proves no op
    returned float32.

Output keys (both files; rows of [6, T] arrays and [6] vectors are TRL's order: chosen rows 0-2,
rejected rows 3-5):
    prompt_ids, chosen_ids, rejected_ids  int64, the 3 records' ids concatenated;
    prompt_len, chosen_len, rejected_len  int64 [3];
    input_ids, attention_mask, completion_mask  int64 [6, T] (the collated batch); pad_id int64;
    "<base>.lora_a" float32 [r, n_in], "<base>.lora_b" float32 [n_out, r]: the LoRA values, keyed
        as in qwen35/peft_grads.npz (GGUF base names) and llama/peft_gqa.npz (llama.cpp layout:
        q/k lora_b rows permuted as convert_lora_to_gguf.py writes them; the float32 sets are
        run through that converter, and the float64 gradients get the same row permutation
        here, checked equal to the converter's output on every float32 set);
    policy_logps, ref_logps  float64 [6] (float32 run: sum of completion-token log-probs),
    policy_logps64, ref_logps64  float64 [6] (float64 run);
    per L in dpo_sigmoid, dpo_ipo, dpo_robust, orpo:
        L.loss, L.rewards_chosen, L.rewards_rejected, L.rewards_margins, L.rewards_accuracies
            float64 [] (float32 run, TRL's logged batch means), the same with suffix 64 (float64 run);
        L.<base>.lora_a.grad, L.<base>.lora_b.grad  float32 (float32 run), .grad64 float64;
    orpo.nll, orpo.nll64 (completion-only chosen NLL), orpo.loss_trl_full_nll (float32 run).

Tokenization seen (qwen35 records, TRL 1.16 + the fixture tokenizer): no BOS (the chat starts
at <|im_start|>, bos_token None); the prompt alone ends with the generation prompt
"<|im_start|>assistant\n<think>\n", prompt+completion renders "...<think>\n\n</think>\n\n<answer>
<|im_end|>\n", and this BPE has no "\n\n" token, so the tokenized prompt is a prefix of both
prompt+chosen and prompt+rejected: TRL's common-prefix rule moves no boundary here (prompts
100, 24, 25 tokens) and the completion is "\n</think>\n\n<answer><|im_end|>\n" (chosen 14, 31,
11 tokens; rejected 24, 16, 25; T = 124).  (A tokenizer with a "\n\n" token, as Qwen's own,
would merge across the boundary and TRL would move it back one token.)

Measured when made (torch 2.13 CPU, 1 thread), float32 run - float64 run:
    loss            dpo_sigmoid  dpo_ipo         dpo_robust  orpo
      qwen35        -1.0e-6      -8.4e-6 (30.2)  -1.2e-6     +1.5e-6
      llama         -2.3e-7      -6.0e-6 (18.5)  -3.5e-7     +3.3e-7
    gradients, worst max |g32 - g64| / max |g64| of a tensor
      qwen35        1.0e-5       6.7e-6          9.7e-6      6.8e-6   (layer 1, upstream of
                    DeltaNet layer 2 and attention layer 3; layer 3 <= 4.0e-6)
      llama         1.9e-6       1.5e-6          1.8e-6      1.8e-6
    per-sequence log-probs: qwen35 policy 1.9e-5, reference 5.3e-5; llama 8.8e-6, 7.9e-6.
TRL's DPO losses recomputed from the per-sequence log-probs with its formulas: equal (0) in
both precisions; ORPO from the fused-head log-probs: 9.5e-7 (qwen35), 1.9e-6 (llama) in float32.
DPO rewards/accuracies: 1/3 (qwen35; margins -1.38, +0.197, -1.57), 2/3 (llama).  TRL's
full-sequence ORPO NLL variant vs the golden: qwen35 9.797 vs 9.849, llama 9.525 vs 9.006.

How (repo root, the reference stack of scripts/requirements-reference.txt, with trl 1.16.0):

    .refenv/bin/python -m scripts.make_pref_golden [--only qwen35|llama]    # ~75 s on 2 cores

Deterministic (fixed seeds, one thread, PYTHONHASHSEED 0; a rerun writes the same bytes); most
of the time is the llama.cpp LoRA converter (5 runs for the llama layout check).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from scripts import make_llama_fixtures as mlf
from scripts import make_peft_golden as mg
from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref

FIXTURES = ref.REPO / "tests" / "fixtures"
RECORDS = FIXTURES / "qwen35" / "pref_records.jsonl"
DPO_LOSSES = {
    "dpo_sigmoid": dict(loss_type=["sigmoid"], beta=0.1),
    "dpo_ipo": dict(loss_type=["ipo"], beta=0.1),
    "dpo_robust": dict(loss_type=["robust"], beta=0.1, label_smoothing=0.1),
}
ORPO_BETA = 0.1
LOSSES = [*DPO_LOSSES, "orpo"]
LLAMA_LENGTHS = {"prompt": [6, 3, 9], "chosen": [5, 8, 2], "rejected": [7, 4, 6]}
LLAMA_SEED = 2027
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
COMMON_ARGS = dict(report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                   per_device_train_batch_size=3)


# --------------------------------------------------------------------------- fixtures

class Fixture:
    """What differs between the two models: base model, LoRA placement and values, tokenizer,
    trainer dataset, fixed examples (llama) and the float64 context."""
    name: str
    out: Path
    tok: object
    dataset: object
    lcfg: object
    examples: list | None = None

    def build(self, dtype):
        raise NotImplementedError

    def adapted(self, pm) -> dict:
        """key -> PEFT LoRA layer of the wrapped model ``pm``."""
        raise NotImplementedError

    def float64(self):
        raise NotImplementedError

    def layout(self, key: str, a, b) -> tuple[str, object, object]:
        """(output base name, A, B) in the layout of the committed PEFT golden."""
        raise NotImplementedError


class Qwen35(Fixture):
    name = "qwen35"

    def __init__(self):
        import datasets
        import numpy as np
        import torch
        self.out = FIXTURES / "qwen35"
        self.gold = np.load(self.out / "gqa.npz")
        self.tok = ref.load_hf_tokenizer(self.out / "tokenizer")
        assert self.tok.chat_template, "the fixture tokenizer has no chat template"
        records = [json.loads(line) for line in RECORDS.read_text(encoding="utf-8").splitlines() if line]
        self.dataset = datasets.Dataset.from_list(records)
        cfg, model = mg.build_gqa(torch.float32)
        self.vocab = cfg.vocab_size
        self.full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        # make_peft_golden's own LoraConfig and module placement, from a probe wrap
        probe, probe_mods = mg.wrap_peft(model, self.full)
        names = {id(m): n for n, m in probe.named_modules()}
        self.paths = {g: names[id(m)] for g, m in probe_mods.items()}
        self.lcfg = copy.deepcopy(probe.peft_config["default"])
        self.values = {g: (v[g + ".lora_a"], v[g + ".lora_b"])
                       for v in [mg.lora_values(probe_mods)] for g in probe_mods}
        peft = np.load(self.out / "peft_grads.npz")
        for g, (a, b) in self.values.items():      # the values of peft_grads.npz
            assert np.array_equal(peft[g + ".lora_a"], a) and np.array_equal(peft[g + ".lora_b"], b), g
        self._model64 = None

    def build(self, dtype):
        import torch
        if dtype == torch.float32:
            _, model = mg.build_gqa(torch.float32)
            mg.check_rebuilt(model, self.gold)
            return model
        if self._model64 is None:
            self._model64 = mg.float64_model(self.gold)
        return copy.deepcopy(self._model64)

    def adapted(self, pm):
        return {g: pm.get_submodule(p) for g, p in self.paths.items()}

    def float64(self):
        return [mg.true_float64()]

    def layout(self, key, a, b):
        return key, a, b


class Llama(Fixture):
    name = "llama"
    model = "gqa"

    def __init__(self, tmp: Path):
        import datasets
        import numpy as np
        import torch
        from peft import LoraConfig, get_peft_model
        self.out = FIXTURES / "llama"
        self.tmp = tmp
        self._checked = False
        self.gold = np.load(self.out / f"{self.model}.npz")
        self.tok = ref.load_hf_tokenizer(mlf.TOKENIZER)     # what the llama GGUFs were made with
        fields = qg.gguf_fields(self.out / f"{self.model}-f32.gguf")
        self.pad_id = int(fields["tokenizer.ggml.padding_token_id"])
        assert self.pad_id == self.tok.pad_token_id == 480, (self.pad_id, self.tok.pad_token_id)
        # DPOTrainer requires a dataset; the llama batch is the fixed ids below
        self.dataset = datasets.Dataset.from_list([{"prompt": "The cat", "chosen": " sat.",
                                                     "rejected": " ran."}])
        spec = mlf.MODELS[self.model]
        self.lcfg = LoraConfig(r=mlf.RANK, lora_alpha=mlf.ALPHA, lora_dropout=0.0, bias="none",
                               target_modules=spec["lora"], init_lora_weights=True)
        rng = np.random.default_rng(LLAMA_SEED)
        self.examples = [{k + "_ids": rng.integers(0, self.pad_id, LLAMA_LENGTHS[k][i]).tolist()
                          for k in ("prompt", "chosen", "rejected")} for i in range(3)]
        base = self.build(torch.float32)
        self.cfg = base.config
        self.vocab = base.config.vocab_size
        self.hf_dir = tmp / self.model
        ref.save_hf_checkpoint(base, mlf.TOKENIZER, self.hf_dir)   # the converter's --base
        # make_llama_fixtures' values, by PEFT module name (those of peft_gqa.npz: checked)
        probe = self.adapted(get_peft_model(base, copy.deepcopy(self.lcfg)))
        v = mlf.lora_values(probe)
        self.values = {n: (v[n + ".lora_A.weight"], v[n + ".lora_B.weight"]) for n in probe}
        peft = np.load(self.out / f"peft_{self.model}.npz")
        for n, (a, b) in self.values.items():
            g, a2, b2 = self.layout(n, a, b)
            assert np.array_equal(peft[g + ".lora_a"], a2) and np.array_equal(peft[g + ".lora_b"], b2), g

    def build(self, dtype):
        import numpy as np
        import torch
        model = mlf.build(self.model, dtype)
        if dtype == torch.float32 and not self._checked:   # the committed fixtures' model
            self._checked = True
            committed = json.loads(str(self.gold["config_json"]))
            mine = json.loads(json.dumps(model.config.to_dict(), sort_keys=True))
            # save_pretrained fills in the first two; the committed json has bos None, this
            # build LlamaConfig's default 1 (no forward reads it): the log-probs below decide
            for k in ("architectures", "dtype", "bos_token_id"):
                committed.pop(k, None), mine.pop(k, None)
            assert mine == committed, "llama gqa config differs from the committed gqa.npz"
            for i in (2, 4):
                n = int(self.gold["lengths"][i])
                err = float(np.abs(ref.hf_logprobs(model, self.gold["tokens"][i, :n].tolist())
                                   - self.gold["logprobs"][i, :n]).max())
                print(f"[llama] rebuilt gqa vs committed golden, sequence {i}: max |dlogprob| {err:.3g}")
                assert err < 1e-4, err
        return model

    def adapted(self, pm):
        import torch
        return {n: m for n, m in pm.named_modules()
                if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)}

    def float64(self):
        return [mlf.true_float64(self.model)]

    def layout(self, key, a, b):
        """PEFT module name -> (GGUF base, A, B in llama.cpp's layout): the converter permutes
        the q/k weight rows per head, so lora_B's rows (W = B A)."""
        parts = key.split(".")
        proj = parts[-1]
        base = f"blk.{int(parts[parts.index('layers') + 1])}.{mlf.HF_TO_GGUF[proj]}.weight"
        if proj == "q_proj":
            b = mlf.permute_rows(b, self.cfg.num_attention_heads)
        elif proj == "k_proj":
            b = mlf.permute_rows(b, self.cfg.num_key_value_heads)
        return base, a, b

    def check_converter(self, pm, what: str, sets: dict) -> None:
        """``layout`` equals convert_lora_to_gguf.py's output, exactly, on a float32 set."""
        import numpy as np
        tensors = {}
        for k, (a, b) in sets.items():
            tensors[k + ".lora_A.weight"], tensors[k + ".lora_B.weight"] = a, b
        d = self.tmp / what
        d.mkdir()
        what_kind = "values" if what == "values" else "grad"
        conv = mlf.to_llama_layout(self.model, pm, self.hf_dir, {what_kind: tensors}, d)[what_kind][1]
        assert len(conv) == 2 * len(sets), sorted(conv)
        for k, (a, b) in sets.items():
            base, a2, b2 = self.layout(k, a, b)
            assert np.array_equal(conv[base + ".lora_a"], a2.astype(np.float32)), (what, base)
            assert np.array_equal(conv[base + ".lora_b"], b2.astype(np.float32)), (what, base)


# --------------------------------------------------------------------------- TRL runs

@contextlib.contextmanager
def default_dtype(dtype):
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def set_lora(adapted: dict, values: dict, dtype) -> None:
    import torch
    with torch.no_grad():
        for k, mod in adapted.items():
            a, b = values[k]
            mod.lora_A["default"].weight.copy_(torch.tensor(a, dtype=dtype))
            mod.lora_B["default"].weight.copy_(torch.tensor(b, dtype=dtype))


def lora_grads(adapted: dict) -> dict:
    return {k: (m.lora_A["default"].weight.grad.detach().double().numpy().copy(),
                m.lora_B["default"].weight.grad.detach().double().numpy().copy())
            for k, m in adapted.items()}


def zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def dpo_trainer(fx: Fixture, base, loss: str, tmp: Path):
    from trl import DPOConfig, DPOTrainer
    args = DPOConfig(output_dir=str(tmp / f"{fx.name}-{loss}"), **COMMON_ARGS, **DPO_LOSSES[loss])
    tr = DPOTrainer(model=base, args=args, train_dataset=fx.dataset, processing_class=fx.tok,
                    peft_config=copy.deepcopy(fx.lcfg))
    assert tr.ref_model is None and list(tr.model.peft_config) == ["default"]
    assert tr.loss_types == DPO_LOSSES[loss]["loss_type"]
    tr.model.train()      # as in training: TRL logs under _metrics["train"]
    return tr


def orpo_trainer(fx: Fixture, base, tmp: Path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    args = ORPOConfig(output_dir=str(tmp / f"{fx.name}-orpo"), beta=ORPO_BETA, **COMMON_ARGS)
    tr = ORPOTrainer(model=base, args=args, train_dataset=fx.dataset, processing_class=fx.tok,
                     peft_config=copy.deepcopy(fx.lcfg))
    assert tr.beta == ORPO_BETA and not tr.is_encoder_decoder and not tr.aux_loss_enabled
    tr.model.train()
    return tr


def trl_examples(trainers: dict) -> list[dict]:
    """prompt_ids / chosen_ids / rejected_ids as TRL's _prepare_dataset made them (the same in
    every trainer)."""
    cols = ("prompt_ids", "chosen_ids", "rejected_ids")
    seen = [[{c: list(row[c]) for c in cols} for row in tr.train_dataset] for tr in trainers.values()]
    assert all(s == seen[0] for s in seen), "trainers tokenized the records differently"
    return seen[0]


def tokenization_facts(fx: Fixture, examples: list[dict]) -> None:
    """What TRL's tokenization did to the records: BOS, the prompt/completion boundary."""
    tok = fx.tok
    for i, (rec, ex) in enumerate(zip(fx.dataset, examples)):
        alone = tok.apply_chat_template(rec["prompt"], tokenize=True, return_dict=True,
                                        add_generation_prompt=True)["input_ids"]
        full = tok.apply_chat_template(rec["prompt"] + rec["chosen"], tokenize=True,
                                       return_dict=True)["input_ids"]
        p = len(ex["prompt_ids"])
        assert alone[:p] == ex["prompt_ids"] and full[:p] == ex["prompt_ids"]
        assert full[p:] == ex["chosen_ids"]
        print(f"[{fx.name}] record {i}: prompt {p} tokens (prompt alone with the generation prompt: "
              f"{len(alone)}; cut by the common-prefix rule: {tok.decode(alone[p:])!r}), chosen "
              f"{len(ex['chosen_ids'])}, rejected {len(ex['rejected_ids'])}; first id {alone[0]} "
              f"{tok.convert_ids_to_tokens(alone[0])!r} (bos {tok.bos_token!r})")
        if i == 0:
            print(f"[{fx.name}] record 0 prompt_ids as text: {tok.decode(ex['prompt_ids'])!r}")
            print(f"[{fx.name}] record 0 chosen_ids as text: {tok.decode(ex['chosen_ids'])!r}")


def seq_logps(tr, batch):
    """Per-sequence policy and reference log-probs (summed over the completion) by TRL's own
    path: the fused LM head forward, and ``compute_ref_log_probs`` (adapter disabled)."""
    import torch
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = tr.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False, labels=labels, fused_lm_head=True)
        pol = out.log_probs.sum(dim=1)
        ref_c, ref_r = tr.compute_ref_log_probs(tr.model, batch)
    return pol, torch.cat([ref_c, ref_r])


def trl_formula(loss: str, tr, pol, ref_, completion_mask):
    """TRL 1.16's per-sequence DPO loss formulas (dpo_trainer._compute_loss), batch mean."""
    import torch.nn.functional as F
    beta, ls = tr.beta, tr.label_smoothing
    pc, pr = pol.chunk(2)
    rc, rr = ref_.chunk(2)
    cl, rl = pc - rc, pr - rr
    d = cl - rl
    if loss == "dpo_sigmoid":
        per = -F.logsigmoid(beta * d)
    elif loss == "dpo_ipo":
        cm, rm = completion_mask.chunk(2, dim=0)
        per = (cl / cm.sum(dim=1).clamp(min=1.0) - rl / rm.sum(dim=1).clamp(min=1.0) - 1 / (2 * beta)) ** 2
    elif loss == "dpo_robust":
        per = (-(1 - ls) * F.logsigmoid(beta * d) - (-ls * F.logsigmoid(-beta * d))) / (1 - 2 * ls)
    else:
        raise ValueError(loss)
    return per.mean()


def orpo_formula(pol, completion_mask, beta):
    """ORPO (completion-only NLL) from summed per-sequence log-probs."""
    import torch
    import torch.nn.functional as F
    n = completion_mask[:, 1:].sum(dim=1).to(pol.dtype)
    avg = pol / n
    c, r = avg.chunk(2)
    l1m = lambda x: torch.log1p(-torch.exp(x))          # noqa: E731
    log_odds = (c - r) - (l1m(c) - l1m(r))
    nll = -pol.chunk(2)[0].sum() / n.chunk(2)[0].sum()
    return nll - (beta * F.logsigmoid(log_odds)).mean()


def orpo_batch(batch):
    """The collated batch in ORPOTrainer's keys (labels: -100 off the completion)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = {}
    for half, sl in (("chosen", slice(0, 3)), ("rejected", slice(3, 6))):
        out[f"{half}_input_ids"] = batch["input_ids"][sl]
        out[f"{half}_attention_mask"] = batch["attention_mask"][sl]
        out[f"{half}_labels"] = labels[sl]
    return out


def run_orpo(tr, adapted, batch) -> dict:
    """ORPO with the completion-only NLL (module docstring), its gradients, and TRL's own
    full-sequence loss and logged metrics from get_batch_loss_metrics."""
    import torch
    ob = orpo_batch(batch)
    model = tr.model
    with torch.no_grad():
        loss_trl, trl_metrics = tr.get_batch_loss_metrics(model, ob, train_eval="train")
    zero_grads(model)
    chosen_logps, rejected_logps, chosen_logits, _, trl_nll = tr.concatenated_forward(model, ob)
    labels = ob["chosen_labels"][:, 1:]
    nll = torch.nn.CrossEntropyLoss()(chosen_logits.reshape(-1, chosen_logits.shape[-1]), labels.reshape(-1))
    losses, chosen_rewards, rejected_rewards, _, _ = tr.odds_ratio_loss(chosen_logps, rejected_logps)
    loss = nll - losses.mean()
    loss.backward()
    metrics = {   # as get_batch_loss_metrics logs them
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
    }
    for k in METRICS:     # the same numbers TRL logs
        assert metrics[k] == trl_metrics[k], (k, metrics[k], trl_metrics[k])
    assert abs((trl_nll - losses.mean()).item() - float(loss_trl)) <= 1e-6 * max(1.0, abs(float(loss_trl)))
    return {"loss": loss.item(), "metrics": metrics, "grads": lora_grads(adapted), "nll": nll.item(),
            "loss_trl_full_nll": float(loss_trl)}


def run_dtype(fx: Fixture, dtype, tmp: Path, examples=None) -> dict:
    """Every loss on one precision: trainers, batch, per-sequence log-probs, losses, gradients."""
    import numpy as np
    import torch
    import trl.kernels.chunked_logprob as ck
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    f64 = dtype == torch.float64
    tag = "float64" if f64 else "float32"
    base = fx.build(dtype)
    trainers = {loss: dpo_trainer(fx, copy.deepcopy(base), loss, tmp / tag) for loss in DPO_LOSSES}
    orpo = orpo_trainer(fx, copy.deepcopy(base), tmp / tag)
    for tr in [*trainers.values(), orpo]:
        assert {p.dtype for p in tr.model.parameters()} == {dtype}
    if examples is None:
        examples = fx.examples or trl_examples(trainers)
    first = trainers["dpo_sigmoid"]
    assert isinstance(first.data_collator, DataCollatorForPreference)
    assert first.data_collator.pad_token_id == fx.tok.pad_token_id
    batch = first.data_collator(copy.deepcopy(examples))
    res = {"examples": examples, "batch": {k: v.numpy() for k, v in batch.items()}}

    with contextlib.ExitStack() as stack:
        seen = [stack.enter_context(c) for c in (fx.float64() + [ref.true_float64(ck)] if f64 else [])]
        if f64:     # integer counts TRL turns into floats (IPO's lengths, token accuracy): float64 too
            stack.enter_context(default_dtype(torch.float64))
        logps = {}
        for loss, tr in trainers.items():
            adapted = fx.adapted(tr.model)
            set_lora(adapted, fx.values, dtype)
            pol, ref_ = seq_logps(tr, batch)
            logps[loss] = (pol, ref_)
            zero_grads(tr.model)
            tr._metrics["train"].clear()
            loss_t = tr.compute_loss(tr.model, batch)
            loss_t.backward()
            assert loss_t.dtype == dtype
            m = {k: v[-1] for k, v in tr._metrics["train"].items()}
            # TRL's loss from the per-sequence log-probs with TRL's formula: the same ops
            again = trl_formula(loss, tr, pol, ref_, batch["completion_mask"]).item()
            eps = float(torch.finfo(dtype).eps)
            bound = 4 * eps * max(1.0, abs(loss_t.item()))
            assert abs(again - loss_t.item()) <= bound, (loss, again, loss_t.item())
            pc, pr = pol.chunk(2)
            for k, v in (("logps/chosen", pc.mean().item()), ("logps/rejected", pr.mean().item())):
                assert abs(m[k] - v) <= 4 * eps * abs(v), (k, m[k], v)
            res[loss] = {"loss": loss_t.item(), "metrics": {k: m[k] for k in METRICS},
                         "grads": lora_grads(adapted)}
            print(f"[{fx.name} {tag}] {loss}: loss {loss_t.item():.9f} (TRL formula from the "
                  f"per-sequence logps: {again - loss_t.item():+.2g}); "
                  + ", ".join(f"{k} {m[k]:.6g}" for k in METRICS))
        for loss in trainers:   # every trainer computes the same log-probabilities
            assert all(torch.equal(a, b) for a, b in zip(logps[loss], logps["dpo_sigmoid"])), loss
        pol, ref_ = logps["dpo_sigmoid"]
        res["policy_logps"], res["ref_logps"] = pol.double().numpy(), ref_.double().numpy()
        adapted = fx.adapted(orpo.model)
        set_lora(adapted, fx.values, dtype)
        res["orpo"] = run_orpo(orpo, adapted, batch)
        again = orpo_formula(pol, batch["completion_mask"], ORPO_BETA).item()
        scale = float(pol.abs().max())
        eps = float(torch.finfo(dtype).eps)
        err = again - res["orpo"]["loss"]
        print(f"[{fx.name} {tag}] orpo: loss {res['orpo']['loss']:.9f} (from the fused-head per-sequence "
              f"logps: {err:+.2g}; TRL's full-sequence NLL variant {res['orpo']['loss_trl_full_nll']:.9f}); "
              + ", ".join(f"{k} {res['orpo']['metrics'][k]:.6g}" for k in METRICS))
        assert abs(err) <= 16 * eps * scale, (err, scale)
    for s in seen:
        assert s == {torch.float64}, s          # no op of the float64 run returned float32
    if f64:
        return res
    res["pm"] = orpo.model
    for k, (a, b) in fx.values.items():
        assert np.array_equal(a, fx.adapted(orpo.model)[k].lora_A["default"].weight.detach().numpy())
    return res


# --------------------------------------------------------------------------- output

def golden(fx: Fixture, r32: dict, r64: dict) -> dict:
    import numpy as np
    ex = r32["examples"]
    res = {}
    for k in ("prompt", "chosen", "rejected"):
        res[f"{k}_ids"] = np.array([t for e in ex for t in e[f"{k}_ids"]], np.int64)
        res[f"{k}_len"] = np.array([len(e[f"{k}_ids"]) for e in ex], np.int64)
    for k in ("input_ids", "attention_mask", "completion_mask"):
        assert np.array_equal(r32["batch"][k], r64["batch"][k])
        res[k] = r32["batch"][k].astype(np.int64)
    res["pad_id"] = np.int64(fx.tok.pad_token_id)
    for k, (a, b) in fx.values.items():
        base, a2, b2 = fx.layout(k, a, b)
        res[base + ".lora_a"], res[base + ".lora_b"] = a2.astype(np.float32), b2.astype(np.float32)
    res["policy_logps"], res["ref_logps"] = r32["policy_logps"], r32["ref_logps"]
    res["policy_logps64"], res["ref_logps64"] = r64["policy_logps"], r64["ref_logps"]
    print(f"[{fx.name}] per-sequence logps float32 - float64: policy "
          f"{np.abs(r32['policy_logps'] - r64['policy_logps']).max():.2g}, reference "
          f"{np.abs(r32['ref_logps'] - r64['ref_logps']).max():.2g}")
    for loss in LOSSES:
        a, b = r32[loss], r64[loss]
        res[f"{loss}.loss"], res[f"{loss}.loss64"] = np.float64(a["loss"]), np.float64(b["loss"])
        for m in METRICS:
            key = f"{loss}.{m.replace('/', '_')}"
            res[key], res[key + "64"] = np.float64(a["metrics"][m]), np.float64(b["metrics"][m])
        line = (f"[{fx.name}] {loss}: loss float32 - float64 {a['loss'] - b['loss']:+.2g} "
                f"(loss64 {b['loss']:.12f}); gradients, max |g32 - g64| / max |g64| per tensor:")
        worst = 0.0
        for k in sorted(fx.values):
            base, ga, gb = fx.layout(k, *a["grads"][k])
            _, ga64, gb64 = fx.layout(k, *b["grads"][k])
            for s, g32, g64 in ((".lora_a", ga, ga64), (".lora_b", gb, gb64)):
                res[f"{loss}.{base}{s}.grad"] = g32.astype(np.float32)
                res[f"{loss}.{base}{s}.grad64"] = g64.astype(np.float64)
                scale = float(np.abs(g64).max())
                assert scale > 0, (loss, base, s)
                rel = float(np.abs(g32 - g64).max()) / scale
                worst = max(worst, rel)
                line += f"\n    {base + s:30s} max|g64| {scale:.3g}  {rel:.2g}"
        print(line + f"\n    worst {worst:.2g}")
    res["orpo.nll"], res["orpo.nll64"] = np.float64(r32["orpo"]["nll"]), np.float64(r64["orpo"]["nll"])
    res["orpo.loss_trl_full_nll"] = np.float64(r32["orpo"]["loss_trl_full_nll"])
    return res


def make(fx: Fixture, tmp: Path, out_dir: Path | None = None) -> Path:
    import numpy as np
    import torch
    r32 = run_dtype(fx, torch.float32, tmp)
    if fx.examples is None:
        tokenization_facts(fx, r32["examples"])
    if isinstance(fx, Llama):   # the layout statement against the converter, every float32 set
        fx.check_converter(r32["pm"], "values", fx.values)
        for loss in LOSSES:
            fx.check_converter(r32["pm"], f"grad-{loss}", r32[loss]["grads"])
    r64 = run_dtype(fx, torch.float64, tmp, examples=r32["examples"])
    res = golden(fx, r32, r64)
    assert int(res["input_ids"].max()) < fx.vocab, (int(res["input_ids"].max()), fx.vocab)
    folder = fx.out if out_dir is None else out_dir / fx.out.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pref_golden.npz"
    np.savez_compressed(path, **res)
    size = path.stat().st_size
    assert size < 1_000_000, size
    print(f"wrote {path} ({size} bytes, sha256 {hashlib.sha256(path.read_bytes()).hexdigest()})")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["qwen35", "llama"], default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="write OUT/{qwen35,llama}/pref_golden.npz instead of the fixtures")
    a = ap.parse_args()
    ref.fix_hash_seed(__spec__.name)
    import datasets
    import torch
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    datasets.disable_progress_bar()
    datasets.disable_caching()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="pref-golden-") as tmp:
        tmp = Path(tmp)
        if a.only in (None, "qwen35"):
            make(Qwen35(), tmp, a.out)
        if a.only in (None, "llama"):
            make(Llama(tmp), tmp, a.out)
    print(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
