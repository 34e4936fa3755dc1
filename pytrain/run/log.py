"""What a run records, and who hears of it: metrics.jsonl (a line per step, validation,
skipped step, early stop or NaN stop) and samples.jsonl, written by rank 0, each record also
handed to the callbacks (``callbacks.Callback``, as mlx-lm's ``TrainingCallback``: TensorBoard
plugs in there).

One object holds the file and the callbacks so that the run closes them together on every way
out, and draws loss.png from the file it has just closed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from pytrain.formats import atomic
from pytrain.run import samples as samples_mod
from pytrain.run.callbacks import Callback
from pytrain.run.folder import run_file
from pytrain.run.metrics import plot_losses

METRICS_FILE = run_file("metrics.jsonl", "a line per step and validation")
PLOT_FILE = run_file("loss.png", "the loss plot, drawn when the run ends")


def start_fresh(out: Path) -> None:
    """A fresh run's metrics.jsonl: empty (an earlier run's lines are not this run's)."""
    atomic.write_bytes(out / METRICS_FILE, b"")


class RunLog:
    """metrics.jsonl opened for appending (rank 0; other ranks record nothing), and the
    callbacks.  ``close`` is called once, on every way out of the run."""

    def __init__(self, out: Path, log: Callable[[str], None], main: bool = True):
        self.out, self._log, self.main = out, log, main
        self.file = open(out / METRICS_FILE, "a") if main else None
        self.callbacks: list[Callback] = []

    def add(self, callback: Callback) -> None:
        """Tell ``callback`` what the run records from now on (rank 0 only); closed with the
        log."""
        if self.main:
            self.callbacks.append(callback)

    def record(self, rec: dict) -> None:
        if self.file is not None:
            try:
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
            except OSError as e:          # a full disk: say which file
                raise atomic.named(e, self.out / METRICS_FILE) from e
        for cb in self.callbacks:
            cb.on_record(rec)

    def samples(self, step: int, got: list[dict]) -> None:
        """Greedy generations at ``step``: into samples.jsonl and to the callbacks."""
        path = self.out / samples_mod.SAMPLES_FILE
        try:
            with open(path, "a") as f:
                for i, g in enumerate(got):
                    f.write(json.dumps({"step": step, "index": i, **g}) + "\n")
        except OSError as e:              # a full disk: say which file
            raise atomic.named(e, path) from e
        for cb in self.callbacks:
            cb.on_samples(step, got)

    def close(self) -> None:
        """The metrics file and loss plot, then the callbacks.  A plot that cannot be drawn (a
        full disk, matplotlib missing) or a callback that fails to close is a warning, never
        the error the run ends with."""
        try:
            if self.file is not None:
                png = self.out / PLOT_FILE
                try:
                    self.file.close()
                    plot_losses(self.out / METRICS_FILE, png)
                except Exception as e:
                    self._log(f"warning: {png} not drawn: {e}")
                self.file = None
        finally:
            for cb in self.callbacks:
                try:
                    cb.close()
                except Exception as e:
                    self._log(f"warning: {type(cb).__name__} not closed: {e}")
            self.callbacks = []
