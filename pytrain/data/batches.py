"""Examples to batches: length bucketing or first-fit packing, padding, the pad id."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from pytrain.data.examples import Batch, DataError, Example

if TYPE_CHECKING:
    from pytrain.data.tokenizer import Tokenizer


# ------------------------------------------------------------------------------- batching
def pad_token_id(tokenizer: "Tokenizer") -> int:
    """The id written at padding positions: the pad token, else EOS.  Padding is never a
    target (seg -1), so this only decides what the forward pass reads there."""
    for tid in (tokenizer.pad_id, tokenizer.eos_id):
        if tid is not None:
            return tid
    raise DataError("the tokenizer has neither a pad nor an EOS token to pad with")


def _rows_to_batch(rows: list[list[Example]], pad_id: int) -> Batch:
    T = max(sum(len(e) for e in r) for r in rows)
    B = len(rows)
    tok = np.full((B, T), pad_id, np.int32)
    seg = np.full((B, T), -1, np.int64)
    msk = np.zeros((B, T), bool)
    for b, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            n = len(ex)
            tok[b, at:at + n] = ex.tokens
            seg[b, at:at + n] = s
            msk[b, at:at + n] = ex.train_mask
            at += n
    return Batch(tok, seg, msk)


def _pack_rows(examples: Sequence[Example], order: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit decreasing: longest first, each into the first row with room."""
    lengths = np.array([len(examples[i]) for i in order], np.int64)
    by_len = order[np.argsort(-lengths, kind="stable")]
    free = np.empty(len(examples), np.int64)
    rows: list[list[int]] = []
    for i in by_len:
        n = len(examples[i])
        fits = np.flatnonzero(free[:len(rows)] >= n)
        if fits.size:
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            free[r] = capacity
        rows[r].append(int(i))
        free[r] -= n
    return rows


def make_batches(examples: Sequence[Example], batch_size: int, packing: bool = False,
                 seed: int = 0, shuffle: bool = True, *, max_seq_len: int | None = None,
                 pad_id: int | None = None) -> list[Batch]:
    """Examples into batches; deterministic given ``seed``.

    Without packing: length-bucketed (sorted by length, ties in seeded random order; chunks of
    ``batch_size``; batch order shuffled), one sample per row, right-padded, T = the longest
    row of the batch.  With packing: first-fit-decreasing into rows of ``max_seq_len`` (default:
    the longest example) with seg ids 0, 1, 2, ... per row; rows shuffled, then chunked.
    ``shuffle=False`` (evaluation) uses no randomness: sorted, in order.  ``pad_id`` (default
    0; pass :func:`pad_token_id`) fills padding, whose seg is -1 and mask False.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not examples:
        return []
    pad = 0 if pad_id is None else int(pad_id)
    rng = np.random.default_rng(seed)
    n = len(examples)
    order = rng.permutation(n) if shuffle else np.arange(n)
    if packing:
        cap = max_seq_len if max_seq_len is not None else max(len(e) for e in examples)
        longest = max(len(e) for e in examples)
        if longest > cap:
            raise ValueError(f"an example of {longest} tokens does not fit a packed row of "
                             f"{cap}; truncate to max_seq_len first")
        packed = _pack_rows(examples, order, cap)
        if shuffle:
            packed = [packed[i] for i in rng.permutation(len(packed))]
        rows = [[examples[i] for i in r] for r in packed]
    else:
        lengths = np.array([len(examples[i]) for i in order], np.int64)
        rows = [[examples[i]] for i in order[np.argsort(lengths, kind="stable")]]
    batches = [_rows_to_batch(rows[i:i + batch_size], pad) for i in range(0, len(rows), batch_size)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches
