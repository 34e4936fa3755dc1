"""Preference pairs (TRL's formats) to token pairs, and pairs to batches.

A record is ``{"prompt", "chosen", "rejected"}``: strings (TRL's *standard* format) or message
lists (*conversational*: the prompt's messages, then the chosen and the rejected reply), or
``{"chosen", "rejected"}`` message lists alone (TRL's implicit prompt: their common first
messages).  The tokens are made as TRL's ``DPOTrainer`` makes them, so a pair means the same
sequence here and there:

  * standard: EOS text appended to chosen and rejected (unless they end with it), then
    ``prompt`` and ``prompt + chosen`` tokenized as whole strings, special tokens added as the
    tokenizer adds them (a BOS where the GGUF asks for one), special-token text parsed;
  * conversational: the chat template renders ``prompt`` with the generation prompt, and
    ``prompt + chosen`` without it (no BOS added: the template writes its own);
  * the completion starts where the two token sequences part, the shorter of chosen's and
    rejected's common prefixes with the prompt (TRL's ``common_prefix_length``).

Only completion tokens are targets (the shared prompt is masked); chosen and rejected of a pair
always sit in the same micro-batch, chosen rows first (TRL's layout).  Truncation follows
``data.truncation``: right (TRL's ``keep_start``: prompt + completion cut to max_seq_len), left,
or drop; a pair whose prompt leaves no completion token, or whose completions become the same
tokens once cut, is skipped and counted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pytrain.data.batches import pad_token_id
from pytrain.data.chat_template import ChatTemplateError, TemplateSecurityError, render
from pytrain.data.examples import Batch, DataError, DataStats
from pytrain.data.records import DataSplits, _check_chat, _RecordError, split_examples
from pytrain.data.sources import read_rows
from pytrain.data.template_files import no_template_hint, read_template

if TYPE_CHECKING:
    from pytrain.config import DataConfig
    from pytrain.data.tokenizer import Tokenizer

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    """One preference pair as token ids: the shared prompt, then each completion."""

    prompt: np.ndarray        # int32 [P]
    chosen: np.ndarray        # int32 [C]
    rejected: np.ndarray      # int32 [R]
    source: str = ""          # file:line

    def __len__(self) -> int:
        """The longer of the two sequences: what the pair costs in a batch row."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))

    @property
    def n_targets(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass
class PairBatch:
    """``batch``: 2n rows, the n chosen sequences first, then the n rejected ones, right-padded;
    ``pairs``: the n pairs' indices in their split (for the reference log-probs)."""

    batch: Batch
    pairs: np.ndarray          # int64 [n]

    @property
    def n_pairs(self) -> int:
        return int(self.pairs.size)

    @property
    def tokens(self) -> np.ndarray:
        return self.batch.tokens

    @property
    def n_tokens(self) -> int:
        return self.batch.n_tokens


# ------------------------------------------------------------------------------- records
def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _messages(obj: dict[str, Any], key: str) -> list[dict[str, Any]]:
    try:
        return _check_chat({"messages": obj[key]})[0]
    except _RecordError as e:
        raise _RecordError(e.reason, f"\"{key}\": {str(e).replace('messages', key)}") from None


def _split_implicit(obj: dict[str, Any]) -> dict[str, Any]:
    """TRL's ``extract_prompt``: chosen and rejected conversations share their first messages,
    which are the prompt."""
    chosen, rejected = _messages(obj, "chosen"), _messages(obj, "rejected")
    k = 0
    while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
        k += 1
    return {"prompt": chosen[:k], "chosen": chosen[k:], "rejected": rejected[k:]}


def record_kind(obj: dict[str, Any]) -> str:
    """``standard`` or ``conversational``; a _RecordError naming what is missing or wrong."""
    if "chosen" not in obj or "rejected" not in obj:
        missing = [k for k in ("chosen", "rejected") if k not in obj]
        raise _RecordError("bad_field", f"missing {', '.join(repr(k) for k in missing)}: a "
                                        f"preference record has \"prompt\", \"chosen\" and "
                                        f"\"rejected\"")
    values = [obj[k] for k in PAIR_FIELDS if k in obj]
    if all(isinstance(v, str) for v in values):
        if "prompt" not in obj:
            raise _RecordError("bad_field", "missing \"prompt\" (only conversational records "
                                            "may leave the prompt implicit)")
        return "standard"
    if all(isinstance(v, list) for v in values):
        return "conversational"
    raise _RecordError("bad_field", "\"prompt\", \"chosen\" and \"rejected\" must all be strings "
                                    "(standard) or all message lists (conversational)")


def encode_pair(tokenizer: "Tokenizer", obj: dict[str, Any], template: str | None = None
                ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one record, as TRL's DPOTrainer tokenizes it."""
    kind = record_kind(obj)
    if kind == "standard":
        eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        prompt = obj["prompt"]
        ends = [c if c.endswith(eos) else c + eos for c in (obj["chosen"], obj["rejected"])]
        p = tokenizer.encode(prompt, add_special=True, parse_special=True)
        full = [tokenizer.encode(prompt + c, add_special=True, parse_special=True) for c in ends]
    else:
        if "prompt" not in obj:
            obj = _split_implicit(obj)
        prompt = _messages(obj, "prompt") if obj["prompt"] else []
        chosen, rejected = _messages(obj, "chosen"), _messages(obj, "rejected")
        tpl = template if template is not None else tokenizer.chat_template
        kw = tokenizer.special_tokens_map()
        try:
            p = tokenizer.encode(render(tpl, prompt, True, **kw), parse_special=True)
            full = [tokenizer.encode(render(tpl, prompt + c, False, **kw), parse_special=True)
                    for c in (chosen, rejected)]
        except TemplateSecurityError:
            raise
        except ChatTemplateError as e:
            raise _RecordError("template_error", str(e)) from None
    cut = min(common_prefix_length(p, f) for f in full)
    return p[:cut], full[0][cut:], full[1][cut:]


def _truncate_pair(p: list[int], c: list[int], r: list[int], max_len: int, policy: str):
    """Each sequence (prompt + completion) within ``max_len``: right keeps the start (the
    completion is cut), left keeps the end (the prompt is cut from its start), drop skips."""
    if len(p) + max(len(c), len(r)) <= max_len:
        return p, c, r, False
    if policy == "drop":
        return None
    if policy == "right":
        room = max(0, max_len - len(p))
        return p[:max_len], c[:room], r[:room], True
    keep_c, keep_r = c[-max_len:], r[-max_len:]
    room = max_len - max(len(keep_c), len(keep_r))
    return (p[len(p) - room:] if room > 0 else []), keep_c, keep_r, True


def load_pairs(path: str | os.PathLike[str], tokenizer: "Tokenizer", *, max_seq_len: int = 1024,
               truncation: str = "right", on_error: str = "stop", template: str | None = None
               ) -> tuple[list[Pair], DataStats]:
    """Read one JSONL file of preference records.  Errors name ``file:line``: a missing or
    mistyped field, chosen equal to rejected (identical text or tokens: nothing to prefer); a
    pair with no completion token left after truncation is skipped and counted (``too_long``
    under truncation = drop, else ``no_targets``), and so is one whose completions truncation
    makes the same tokens (``equal_after_truncation``: nothing left to prefer, its loss would
    stay at log 2 and dilute every step it is in)."""
    path = os.fspath(path)
    stats = DataStats(path=path, format="preference", mask="completion_only")
    pairs: list[Pair] = []
    for row in read_rows(path):
        stats.records += 1
        where = row.where
        try:
            obj = row.record()
            kind = record_kind(obj)
            if kind == "conversational" and not (template or tokenizer.chat_template):
                raise DataError(f"{where}: conversational preference records need a chat "
                                f"template and the model has none: "
                                f"{no_template_hint('data.chat_template')}")
            stats.templated |= kind == "conversational"
            if obj["chosen"] == obj["rejected"]:
                raise _RecordError("bad_field", "\"chosen\" equals \"rejected\": nothing to "
                                                "prefer")
            p, c, r = encode_pair(tokenizer, obj, template)
            if c == r:
                raise _RecordError("bad_field", "\"chosen\" and \"rejected\" give the same "
                                                "tokens: nothing to prefer")
        except TemplateSecurityError as e:
            raise DataError(f"{where}: the chat template: {e}") from None
        except _RecordError as e:
            if on_error == "stop":
                raise DataError(f"{where}: {e}") from None
            stats.skip(e.reason, f"{where}: {e}")
            continue
        full = len(p) + max(len(c), len(r))
        cut = _truncate_pair(p, c, r, max_seq_len, truncation)
        if cut is None:
            stats.skip("too_long", f"{where}: {full} tokens > max_seq_len {max_seq_len}")
            continue
        p, c, r, was_cut = cut
        first = 0 if p else 1          # a sequence's first token has nothing to predict it
        if len(c) <= first or len(r) <= first:
            why = "the prompt leaves no completion token" if p else "no completion target"
            stats.skip("no_targets", f"{where}: {why} after truncation to max_seq_len "
                                     f"{max_seq_len} ({full} tokens)")
            continue
        if c == r:                     # they differed only in what was cut off
            stats.skip("equal_after_truncation",
                       f"{where}: chosen and rejected are the same tokens after truncation to "
                       f"max_seq_len {max_seq_len} ({full} tokens): nothing to prefer")
            continue
        stats.truncated += was_cut
        pair = Pair(np.asarray(p, np.int32), np.asarray(c, np.int32), np.asarray(r, np.int32),
                    where)
        pairs.append(pair)
        stats.examples += 1
        stats.tokens += len(p) * 2 + len(c) + len(r)
        stats.target_tokens += pair.n_targets
    if not pairs:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(stats.skipped.items()))
        raise DataError(f"{path}: no usable preference pairs ({stats.records} records read"
                        + (f"; skipped: {skipped}" if skipped else "") + ")")
    return pairs, stats


def load_pair_data(cfg: "DataConfig", tokenizer: "Tokenizer", template: str | None = None
                   ) -> DataSplits:
    """Training and validation pairs as the [data] section describes them (DataSplits holding
    pairs in place of examples); conversational records rendered with ``template``, else
    ``data.chat_template``'s file, else the model's."""
    if template is None and cfg.chat_template:
        try:
            template, _ = read_template(cfg.chat_template, "data.chat_template")
        except ChatTemplateError as e:
            raise DataError(str(e)) from None
    if cfg.train is None:
        raise DataError("data.train is not set")
    kw = dict(max_seq_len=cfg.max_seq_len, truncation=cfg.truncation, on_error=cfg.on_error,
              template=template)
    train, tstats = load_pairs(cfg.train, tokenizer, **kw)
    if cfg.validation is not None:
        valid, vstats = load_pairs(cfg.validation, tokenizer, **kw)
        return DataSplits(train, valid, tstats, vstats)
    train, valid = split_examples(train, cfg.split, cfg.shuffle_seed or 0)
    if not valid:
        return DataSplits(train, valid, tstats, None)
    tstats.held_out = len(valid)
    vstats = DataStats(path=tstats.path, format="preference", mask="completion_only",
                       records=len(valid), examples=len(valid),
                       tokens=sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected)
                                  for p in valid),
                       target_tokens=sum(p.n_targets for p in valid), split_of=tstats.path,
                       templated=tstats.templated)
    return DataSplits(train, valid, tstats, vstats)


# ------------------------------------------------------------------------------- batches
def pair_batch(pairs: Sequence[Pair], index: Sequence[int], pad_id: int) -> PairBatch:
    """Pairs ``index`` as one batch: chosen rows, then rejected rows, right-padded."""
    seqs = ([(pairs[i].prompt, pairs[i].chosen) for i in index]
            + [(pairs[i].prompt, pairs[i].rejected) for i in index])
    T = max(len(p) + len(c) for p, c in seqs)
    B = len(seqs)
    tok = np.full((B, T), pad_id, np.int32)
    seg = np.full((B, T), -1, np.int64)
    msk = np.zeros((B, T), bool)
    for b, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        tok[b, :len(p)], tok[b, len(p):n] = p, c
        seg[b, :n] = 0
        msk[b, len(p):n] = True
    return PairBatch(Batch(tok, seg, msk), np.asarray(index, np.int64))


def make_pair_batches(pairs: Sequence[Pair], batch_size: int, seed: int = 0, shuffle: bool = True,
                      pad_id: int = 0) -> list[PairBatch]:
    """``batch_size`` pairs per micro-batch (2 x batch_size rows), length-bucketed as
    ``make_batches`` does: sorted by length with seeded ties, chunked, batch order shuffled;
    ``shuffle=False`` (validation, the reference pass): sorted, in order, no randomness."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not pairs:
        return []
    rng = np.random.default_rng(seed)
    n = len(pairs)
    order = rng.permutation(n) if shuffle else np.arange(n)
    lengths = np.array([len(pairs[i]) for i in order], np.int64)
    order = order[np.argsort(lengths, kind="stable")]
    batches = [pair_batch(pairs, order[i:i + batch_size], pad_id) for i in range(0, n, batch_size)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


__all__ = ["Pair", "PairBatch", "encode_pair", "load_pairs", "load_pair_data",
           "make_pair_batches", "pad_token_id", "pair_batch"]
