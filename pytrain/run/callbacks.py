"""Hooks into a run, as mlx-lm's ``TrainingCallback``: whatever the run records (a step, a
validation, samples) reaches each callback too, so TensorBoard or a user's own logger plug in
without the loop knowing them.  Only rank 0 of a data-parallel run calls them."""
from __future__ import annotations


class Callback:
    """Override what you need; every method is called on rank 0 only."""

    def on_record(self, rec: dict) -> None:
        """A metrics.jsonl line: a step (``loss``, ``lr``, ...), a validation
        (``split == "valid"``), a skipped step, an early stop."""

    def on_samples(self, step: int, samples: list[dict]) -> None:
        """Greedy generations at ``step``: dicts with ``prompt`` and ``completion``."""

    def close(self) -> None:
        """The run ends (normally or not)."""
