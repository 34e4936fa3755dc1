"""Preference training (DPO, ORPO): the step, the reference log-probabilities, validation.

A step over micro-batches of pairs (``PairBatch``: chosen rows, then rejected rows):

  1. the policy's per-sequence log-probabilities pi (a forward-only graph, ``EvalGraph`` with
     ``rows_per_seq``): the sum of log p(target) over the completion targets of each row, the
     same masked targets as SFT (prompt and padding are never targets);
  2. on the host, in float64, the loss of every pair and its derivatives dL/dpi
     (``preference_loss``), normalised by the step's totals summed over all ranks (pairs; and
     chosen completion targets for ORPO's NLL), so that gradient accumulation and data-parallel
     ranks give the gradient of one big batch;
  3. one forward + backward of sum_s w_s * CE_s (``GradGraph`` with ``rows_per_seq``),
     CE_s = -pi_s / R, w_s = -R * dL/dpi_s: its gradient is sum_s dL/dpi_s * grad(pi_s), the
     preference loss's gradient.

DPO's reference is the base model (the adapter off, as TRL's reference for a PEFT model): its
log-probabilities are computed once per pair before training (TRL's
``precompute_ref_log_probs``), in a fixed order independent of the run's batch order, and
cached in the run folder, so a resumed run uses the very same numbers.  ORPO has no
reference, and its run no reference pass.
"""
from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pytrain.data.preference import PairBatch, make_pair_batches
from pytrain.formats import atomic
from pytrain.step import loss as loss_mod
from pytrain.step import preference_loss as pl
from pytrain.step.distributed import World
from pytrain.step.graphs import EvalGraph, GradGraph, bucket_length
from pytrain.step.trainer import StepResult, Trainer

REFERENCE_FILE = "reference_logps.npz"


@dataclass
class PreferenceSettings:
    """TRL's names: ``beta`` (DPO's beta, ORPO's lambda), ``loss_type``, ``label_smoothing``."""

    objective: str = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0


def pair_digest(pairs: Sequence) -> str:
    """What the reference log-probabilities were computed for (the pairs' tokens)."""
    h = hashlib.sha256()
    for p in pairs:
        for a in (p.prompt, p.chosen, p.rejected):
            h.update(np.int64(a.size).tobytes())
            h.update(a.tobytes())
    return h.hexdigest()


# what a cache made for something else was made for, in the words of the log line
# (the most telling first)
_MADE_FOR = {"model file": "another model file", "weight types": "weights loaded as other types",
             "pairs": "other pairs", "objective": "another objective",
             "adapter": "another adapter initialisation"}


def reference_key(parts: dict[str, Sequence], made_for: dict) -> dict:
    """What a cache of reference log-probabilities holds values of: the pairs of each split
    (their tokens) and ``made_for``, as JSON values (so that a key read back compares equal)."""
    pairs = hashlib.sha256("".join(pair_digest(p) for p in parts.values()).encode())
    return json.loads(json.dumps({"pairs": pairs.hexdigest(), **made_for}, sort_keys=True))


def read_reference(path: Path | None, key: dict, parts: dict[str, Sequence]
                   ) -> tuple[dict | None, str | None]:
    """(the cached values of ``parts``, None), or (None, why the cache at ``path`` cannot be
    used: unreadable, not this project's record, made for something else); (None, None) when
    there is none.  Whatever is under the file's name (cut short by a full disk, another
    program's npz, an earlier version's), the answer is to compute it again, not to fail."""
    if path is None or not path.exists():
        return None, None
    if not zipfile.is_zipfile(path):           # np.load would try it as a pickle
        return None, "unreadable: not an npz archive (cut short, or another kind of file)"
    try:
        with np.load(path, allow_pickle=False) as z:
            if "made_for" not in z.files:
                return None, ("it holds no record of what it was made for (another program's "
                              "file, or an earlier version's)")
            was = json.loads(str(z["made_for"]))
            if not isinstance(was, dict):
                return None, "its record of what it was made for is not one"
            differs = sorted((k for k in set(key) | set(was) if key.get(k) != was.get(k)),
                             key=lambda k: (list(_MADE_FOR).index(k) if k in _MADE_FOR
                                            else len(_MADE_FOR), k))
            if differs:
                return None, "made for " + ", ".join(_MADE_FOR.get(k, f"another {k}")
                                                    for k in differs)
            found = {}
            for k, pairs in parts.items():
                names = (f"{k}_chosen", f"{k}_rejected")
                vals = [z[n] if n in z.files else None for n in names]
                bad = [n for n, v in zip(names, vals)
                       if v is None or v.shape != (len(pairs),) or v.dtype != np.float64]
                if bad:
                    return None, (f"incomplete: no {', '.join(bad)} values for "
                                  f"{len(pairs)} pairs")
                found[k] = tuple(vals)
            return found, None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"


class _Sums:
    """Per-step (or per-validation) sums over pairs.  Each micro-batch's values are a row of
    their own, at the micro-batch's place in the whole step (rank + ranks x i for this rank's
    i-th), summed in that order after one all-reduce (each row comes from one rank, the
    others add exact zeros): so ranks and accumulation give the same float64 sums."""

    KEYS = ("loss", "nll", "reward_chosen", "reward_rejected", "margin", "correct", "pairs",
            "chosen_targets", "tokens")

    def __init__(self, world, n_batches: int):
        """``n_batches``: the most micro-batches any rank has."""
        self.world = world
        self.rows = np.zeros((n_batches * world.size, len(self.KEYS)), np.float64)

    def add(self, i: int, t: pl.PairTerms, nll: float, chosen_targets: int, tokens: int) -> None:
        """The values of this rank's ``i``-th micro-batch."""
        self.rows[self.world.rank + self.world.size * i] = (
            t.loss.sum(), nll, t.reward_chosen.sum(), t.reward_rejected.sum(),
            (t.reward_chosen - t.reward_rejected).sum(),
            (t.reward_chosen > t.reward_rejected).sum(), t.loss.size, chosen_targets, tokens)

    def reduce(self) -> dict:
        rows = self.world.allreduce_sum(self.rows) if self.world.size > 1 else self.rows
        total = np.zeros(len(self.KEYS), np.float64)
        for r in rows:                 # in the step's order, whatever the ranks
            total += r
        return dict(zip(self.KEYS, map(float, total)))


def metrics(v: dict, objective: str) -> dict:
    """TRL's metric names (batch means over pairs) from the summed values."""
    n = max(v["pairs"], 1.0)
    out = {"rewards/chosen": v["reward_chosen"] / n, "rewards/rejected": v["reward_rejected"] / n,
           "rewards/margins": v["margin"] / n, "rewards/accuracies": v["correct"] / n,
           "pairs": int(v["pairs"])}
    if objective == "orpo":
        out["nll_loss"] = v["nll"] / max(v["chosen_targets"], 1.0)
    return out


def _check_objective(settings: PreferenceSettings) -> None:
    if settings.objective not in ("dpo", "orpo"):
        raise ValueError(f"objective must be dpo or orpo, got {settings.objective!r}")


class PreferenceEvaluator:
    """The per-sequence log-probabilities over pairs, DPO's reference pass and the validation
    loss and reward metrics, with no optimizer: a run's validation (``PreferenceTrainer``)
    and ``pytrain eval`` of a preference config compute the same numbers by the same code.
    ``adapter`` None: the base model (no LoRA in the graph)."""

    def __init__(self, model, adapter, settings: PreferenceSettings, world=None,
                 max_graphs: int = 12):
        _check_objective(settings)
        self.model, self.adapter, self.settings = model, adapter, settings
        self.world = world or World()
        self.max_graphs = max_graphs
        self.fwd_graphs: dict[tuple, EvalGraph] = {}
        self.ref_graphs: dict[tuple, EvalGraph] = {}
        self.reference: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def uses_reference(self) -> bool:
        """DPO's loss compares the policy with the reference; ORPO's has none, so its run
        skips the reference pass (a forward over every pair, most of a short ORPO run)."""
        return self.settings.objective == "dpo"

    # ---------------------------------------------------------------- graphs
    def _shape(self, pb: PairBatch, targets: np.ndarray) -> tuple[int, int, int]:
        B, T = pb.tokens.shape
        T = bucket_length(self.model, T)
        most = int((targets >= 0).sum(axis=1).max())
        return B, T, loss_mod.rows_bucket(most, T)

    def _cached(self, cache: dict, key: tuple, make):
        if key not in cache:
            if len(cache) >= self.max_graphs:
                cache.pop(next(iter(cache))).close()
            cache[key] = make()
        return cache[key]

    def sequence_logps(self, pb: PairBatch, targets: np.ndarray, reference: bool = False
                       ) -> np.ndarray:
        """Every row's summed completion log-probability under the policy (or the base)."""
        B, T, R = self._shape(pb, targets)
        cache, adapter = (self.ref_graphs, None) if reference else (self.fwd_graphs, self.adapter)
        g = self._cached(cache, (B, T, R),
                         lambda: EvalGraph(self.model, adapter, B, T, None, rows_per_seq=R))
        b = pb.batch
        return g.sequence_logps(b.tokens, b.seg, targets)

    @staticmethod
    def targets_of(pb: PairBatch) -> np.ndarray:
        b = pb.batch
        return loss_mod.shift_targets(b.tokens, b.train_mask, b.seg)

    # ---------------------------------------------------------------- the reference
    def compute_reference(self, name: str, pairs: Sequence, batch_size: int) -> None:
        """The base model's log-probabilities of every pair of split ``name``, in a fixed
        batching (sorted by length, no randomness), shared out over the ranks and summed
        (each value comes from one rank, the others add exact zeros)."""
        w = self.world
        n = len(pairs)
        ref = np.zeros(2 * n, np.float64)
        batches = make_pair_batches(pairs, batch_size, shuffle=False, pad_id=self.model.pad_id)
        for i, pb in enumerate(batches):
            if i % w.size != w.rank:
                continue
            lp = self.sequence_logps(pb, self.targets_of(pb), reference=True)
            k = pb.n_pairs
            ref[pb.pairs], ref[n + pb.pairs] = lp[:k], lp[k:]
        if w.size > 1:
            ref = w.allreduce_sum(ref)
        for g in self.ref_graphs.values():
            g.close()
        self.ref_graphs.clear()
        self.reference[name] = (ref[:n], ref[n:])

    def load_or_compute_reference(self, out: Path | None, splits, batch_size: int, log,
                                  made_for: dict | None = None) -> None:
        """The reference log-probabilities of the train and validation pairs: read from the
        run folder's cache when it was made for these very pairs and everything in
        ``made_for`` (what else the values depend on: the model file's identity, the types
        its weights were loaded as, ...; the run's ``reference_key``), else computed (and
        cached by rank 0).  A cache that does not match is recomputed, and the log says why:
        a path alone does not say which model made it."""
        parts = {"train": splits.train, "valid": splits.valid}
        key = reference_key(parts, made_for or {})
        path = out / REFERENCE_FILE if out is not None else None
        w = self.world
        found, why = (w.bcast(read_reference(path, key, parts) if w.is_main else None)
                      if w.size > 1 else read_reference(path, key, parts))
        if found is not None:
            self.reference.update(found)
            log(f"reference log-probabilities: read from {path}")
            return
        if why:
            log(f"reference log-probabilities: {path} recomputed: {why}")
        t0 = time.perf_counter()
        for k, pairs in parts.items():
            if pairs:
                self.compute_reference(k, pairs, batch_size)
            else:
                self.reference[k] = (np.zeros(0), np.zeros(0))
        n = sum(len(p) for p in parts.values())
        log(f"reference log-probabilities of {n} pairs (base model, adapter off): "
            f"{time.perf_counter() - t0:.1f} s")
        if path is not None and self.world.is_main:
            buf = io.BytesIO()
            np.savez(buf, made_for=np.array(json.dumps(key, sort_keys=True)),
                     **{f"{k}_{s}": v for k, (c, r) in self.reference.items()
                        for s, v in (("chosen", c), ("rejected", r))})
            atomic.write_bytes(path, buf.getvalue())

    # ---------------------------------------------------------------- the loss
    def pair_terms(self, pb: PairBatch, lp: np.ndarray, split: str, targets: np.ndarray
                   ) -> pl.PairTerms:
        s, n = self.settings, pb.n_pairs
        pc, pr = lp[:n], lp[n:]
        if s.objective == "orpo":
            cnt = (targets >= 0).sum(axis=1)
            return pl.orpo_terms(s.beta, pc, pr, cnt[:n], cnt[n:])
        ref_c, ref_r = self.reference[split]
        lens = pb.batch.train_mask.sum(axis=1)            # TRL's completion_mask sums
        return pl.dpo_terms(s.loss_type, s.beta, s.label_smoothing, pc, pr,
                            ref_c[pb.pairs], ref_r[pb.pairs], lens[:n], lens[n:])

    def evaluate(self, batches: list) -> dict:
        """The loss and TRL's reward metrics over the validation pairs (this rank's share of
        the batches, summed over ranks)."""
        w, orpo = self.world, self.settings.objective == "orpo"
        mine = batches[w.rank::w.size]
        sums = _Sums(w, -(-len(batches) // w.size))
        for i, pb in enumerate(mine):
            tg = self.targets_of(pb)
            lp = self.sequence_logps(pb, tg)
            terms = self.pair_terms(pb, lp, "valid", tg)
            sums.add(i, terms, -float(lp[:pb.n_pairs].sum()) if orpo else 0.0,
                     int((tg[:pb.n_pairs] >= 0).sum()), pb.n_tokens)
        v = sums.reduce()
        n = max(v["pairs"], 1.0)
        loss = v["loss"] / n + (v["nll"] / max(v["chosen_targets"], 1.0) if orpo else 0.0)
        return {"loss": loss, **metrics(v, self.settings.objective)}

    def close(self) -> None:
        for cache in (self.fwd_graphs, self.ref_graphs):
            for g in cache.values():
                g.close()
            cache.clear()


class PreferenceTrainer(PreferenceEvaluator, Trainer):
    """``Trainer`` with the preference step, and validation over pairs and the reference pass
    (``PreferenceEvaluator``'s).  The one-graph step only: layer-wise recompute has no
    per-sequence loss yet."""

    def __init__(self, model, adapter, hp, settings: PreferenceSettings, world=None,
                 max_graphs: int = 12):
        _check_objective(settings)          # before anything is allocated
        Trainer.__init__(self, model, adapter, hp, recompute="off", world=world,
                         max_graphs=max_graphs)
        PreferenceEvaluator.__init__(self, model, adapter, settings, self.world, max_graphs)

    def _grad(self, pb: PairBatch, targets: np.ndarray) -> GradGraph:
        B, T, R = self._shape(pb, targets)
        return self._cached(self.graphs, (B, T, R), lambda: GradGraph(
            self.model, self.adapter, B, T, opt_state=self.opt_state, rows_per_seq=R))

    # ---------------------------------------------------------------- the step
    def accumulate(self, micro_batches: list) -> tuple[float, dict] | None:
        """The step's loss and summed metrics, its gradient left in the accumulators (summed
        over ranks); None when the whole step holds no pair."""
        w, orpo = self.world, self.settings.objective == "orpo"
        tgts = [self.targets_of(pb) for pb in micro_batches]
        chosen_targets = [int((t[:pb.n_pairs] >= 0).sum()) for pb, t in zip(micro_batches, tgts)]
        totals = np.array([sum(pb.n_pairs for pb in micro_batches), sum(chosen_targets),
                           len(micro_batches)], np.float64)
        n_pairs, n_chosen, n_micro = map(float, w.allreduce_sum(totals) if w.size > 1
                                         else totals)
        if n_pairs == 0:
            return None
        self.opt_state.zero_grads()
        sums = _Sums(w, -(-int(n_micro) // w.size))
        for i, (pb, tg, nc) in enumerate(zip(micro_batches, tgts, chosen_targets)):
            lp = self.sequence_logps(pb, tg)
            terms = self.pair_terms(pb, lp, "train", tg)
            d = np.concatenate([terms.d_chosen, terms.d_rejected]) / n_pairs
            nll = 0.0
            if orpo:                  # the NLL of the chosen completions, a token mean
                d[:pb.n_pairs] -= 1.0 / n_chosen
                nll = -float(lp[:pb.n_pairs].sum())
            g = self._grad(pb, tg)
            g.accumulate_sequences(pb.batch.tokens, pb.batch.seg, tg, -g.rows_per_seq * d)
            sums.add(i, terms, nll, nc, pb.n_tokens)
        v = sums.reduce()
        if w.size > 1:
            self.opt_state.allreduce_grads(w)
        return v["loss"] / n_pairs + (v["nll"] / n_chosen if orpo else 0.0), v

    def step(self, micro_batches: list, lr: float) -> StepResult | None:
        """One optimizer step over this rank's micro-batches of pairs (see the module
        docstring); None when the whole step holds no pair."""
        t0 = time.perf_counter()
        done = self.accumulate(micro_batches)
        if done is None:
            return None
        loss, v = done
        norm, clip = self.update(loss, lr)
        r = StepResult(loss, int(v["pairs"]), norm, clip, lr, int(v["tokens"]),
                       time.perf_counter() - t0)
        r.extra = metrics(v, self.settings.objective)
        return r

    def close(self) -> None:
        PreferenceEvaluator.close(self)
        Trainer.close(self)
