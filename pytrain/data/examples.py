"""What the data stage produces: examples with a per-token target mask, batches with sample
ids, and the counts of what happened to each file's records."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pytrain.errors import PytrainError

ROLES = ("system", "user", "assistant", "tool")
ERROR_REASONS = ("malformed_json", "not_an_object", "unrecognised_record", "other_format",
                 "bad_field", "unknown_role", "template_error")
SKIP_REASONS = ("no_assistant_turn", "too_long", "no_targets", "equal_after_truncation")
_KEEP_MESSAGES = 3  # first messages kept per skip reason, for the report


class DataError(PytrainError, ValueError):
    """A dataset that cannot be used; the message names the file (and line)."""


# ------------------------------------------------------------------------------- types
@dataclass
class Example:
    """One training sample: ``tokens`` int32 [L], ``train_mask`` bool [L] (token is a target)."""

    tokens: np.ndarray
    train_mask: np.ndarray
    source: str = ""  # file:line

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_targets(self) -> int:
        """Targets after the shift: masked tokens other than the first."""
        return int(self.train_mask[1:].sum())


@dataclass
class Batch:
    """``tokens`` int32 [B, T]; ``seg`` int64 [B, T] sample id within the row, -1 = padding;
    ``train_mask`` bool [B, T], False on padding."""

    tokens: np.ndarray
    seg: np.ndarray
    train_mask: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    @property
    def n_targets(self) -> int:
        """Valid targets, by the same rule as ``loss.shift_targets`` (equal by test)."""
        s, m = self.seg, self.train_mask
        return int(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0) & m[:, 1:]).sum())

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.seg >= 0).sum())

    @property
    def n_samples(self) -> int:
        return int(sum(len(np.unique(r[r >= 0])) for r in self.seg))

    def pad_to(self, T: int, pad_id: int) -> "Batch":
        """The same batch right-padded to ``T`` columns (for graphs built for a fixed T)."""
        B, t = self.tokens.shape
        if T < t:
            raise ValueError(f"cannot pad a batch of length {t} to {T}")
        tok = np.full((B, T), pad_id, np.int32)
        seg = np.full((B, T), -1, np.int64)
        msk = np.zeros((B, T), bool)
        tok[:, :t], seg[:, :t], msk[:, :t] = self.tokens, self.seg, self.train_mask
        return Batch(tok, seg, msk)


@dataclass
class DataStats:
    """What happened to one file's records; ``records == examples + sum(skipped.values())``."""

    path: str = ""
    format: str | None = None
    mask: str | None = None
    records: int = 0                  # non-blank lines read
    skipped: dict[str, int] = field(default_factory=dict)
    skip_messages: dict[str, list[str]] = field(default_factory=dict)  # first few per reason
    truncated: int = 0                # kept, but cut to max_seq_len
    examples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    padding_share: float | None = None  # set by record_batches
    held_out: int = 0                 # examples moved to the validation split (data.split)
    split_of: str | None = None       # a validation split: the file it was held out from
    # the records were rendered with the chat template (chat records, conversational
    # preference pairs): a prompt given as text is asked through it too (train.sample_prompts)
    templated: bool = False

    @property
    def dropped(self) -> int:
        """Examples skipped for being longer than max_seq_len (truncation "drop")."""
        return self.skipped.get("too_long", 0)

    def skip(self, reason: str, message: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        kept = self.skip_messages.setdefault(reason, [])
        if len(kept) < _KEEP_MESSAGES:
            kept.append(message)

    def record_batches(self, batches: Sequence[Batch]) -> None:
        """Set ``padding_share``: padding positions / all positions of ``batches``."""
        total = sum(b.tokens.size for b in batches)
        pad = sum(int((b.seg < 0).sum()) for b in batches)
        self.padding_share = pad / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "mask": self.mask,
                "records": self.records, "skipped": dict(self.skipped),
                "truncated": self.truncated, "dropped": self.dropped,
                "examples": self.examples, "tokens": self.tokens,
                "target_tokens": self.target_tokens, "padding_share": self.padding_share,
                **({"held_out": self.held_out} if self.held_out else {}),
                **({"split_of": self.split_of} if self.split_of else {})}

    @classmethod
    def of_split(cls, examples: Sequence[Example], source: DataStats) -> "DataStats":
        """The counts of a validation split held out from ``source``'s examples."""
        return cls(path=source.path, format=source.format, mask=source.mask,
                   records=len(examples), examples=len(examples),
                   tokens=sum(len(e) for e in examples),
                   target_tokens=sum(e.n_targets for e in examples), split_of=source.path,
                   templated=source.templated)

    def summary(self) -> str:
        """One line for the run log."""
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        pad = "" if self.padding_share is None else f", padding {self.padding_share:.1%}"
        return (f"{os.path.basename(self.path)}: {self.records} records ({self.format}, mask "
                f"{self.mask}) -> {self.examples} examples, {self.tokens} tokens, "
                f"{self.target_tokens} targets; truncated {self.truncated}; skipped {skipped}"
                f"{pad}")
