"""The best validation loss so far, and early stopping, as Hugging Face's Trainer keeps them.

The best adapter is the one of the lowest validation loss seen (any decrease counts, as the
Trainer's ``best_metric``).  Early stopping follows ``transformers.EarlyStoppingCallback``: a
validation *improves* when its loss is below the best before it by more than ``min_delta``;
``patience`` validations in a row that do not improve stop the run.  The state is small and
goes into every checkpoint, so that a resumed run counts on where it stopped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Best:
    """The best validation so far and the early-stopping count since the last improvement."""
    step: int | None = None          # step of the best validation (None: none yet)
    loss: float | None = None        # its validation loss
    bad_evals: int = 0               # validations in a row that did not improve

    def update(self, step: int, loss: float, min_delta: float) -> bool:
        """Count validation ``loss`` at ``step``; True when it is a new best."""
        improved = self.loss is None or (loss < self.loss and self.loss - loss > min_delta)
        self.bad_evals = 0 if improved else self.bad_evals + 1
        if self.loss is None or loss < self.loss:
            self.step, self.loss = step, loss
            return True
        return False

    def exhausted(self, patience: int) -> bool:
        """Early stopping is due (``patience`` 0: never)."""
        return patience > 0 and self.bad_evals >= patience

    def why(self, patience: int, min_delta: float) -> str:
        by = f" by more than {min_delta:g}" if min_delta else ""
        return (f"early stopping: {self.bad_evals} validations without a loss lower than the "
                f"best{by} (train.early_stopping_patience = {patience}); the best is step "
                f"{self.step}, validation loss {self.loss:.4f}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Best":
        return cls(**d) if d else cls()
