"""One run per output folder, and nothing of an earlier run lost by accident.

Every re-run of a config writes into the same ``output.dir``.  A fresh run into a folder that
holds an earlier run would otherwise mix the two: its checkpoints pruned by step across both
runs (the new run's step 10 deleted at once beside the old run's 300), ``--resume`` continuing
the wrong one.  So:

* a lock file (``.pytrain.lock``, held with ``flock`` for the run's life, naming its pid)
  stops a second run in the same folder;
* a fresh run into a folder with an earlier run's checkpoints, metrics or adapter is refused
  unless resumed (``--resume``) or replaced (``--overwrite``).  ``--overwrite`` touches nothing
  until the new run has been checked whole (config, data, model, targets: ``loop.train``), then
  moves the earlier run's files into ``replaced-TIME/`` and deletes that once the new run has
  written its first checkpoint: a new run that fails early leaves the earlier one complete;
* an earlier run that stopped before it wrote a checkpoint (killed, or an error at its first
  step) has nothing to continue from: ``--resume`` starts it again from step 0, and a fresh
  run is told so;
* each run has an id, written into every checkpoint's ``state.json``; a run prunes only its
  own checkpoints (``checkpoint.save``).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path

from pytrain.errors import PytrainError

LOCK = ".pytrain.lock"
# what a run writes into its folder (an earlier run is any of them present)
RUN_FILES = ("checkpoints", "metrics.jsonl", "adapter.gguf", "peft", "loss.png",
             "data_stats.json", "config.toml")


class RunDirError(PytrainError, RuntimeError):
    """The output folder is in use, or holds an earlier run the command did not say what to
    do with."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class RunDir:
    """The run's hold on its output folder (a context manager: the lock is released on exit)."""

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self._fd: int | None = None

    def __enter__(self) -> "RunDir":
        path = self.out / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(f"{self.out} is in use by another pytrain run (pid {holder}); "
                              f"wait for it to finish, or set another output.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def has_checkpoint(self) -> bool:
        return any((p / "state.json").exists() for p in (self.out / "checkpoints").glob("step-*"))

    def earlier_run(self) -> str | None:
        """What an earlier run left here, in words, or None for a folder a run may start in.
        A config.toml or data_stats.json alone (a run refused before it trained) is none."""
        found = []
        steps = sorted(p.name for p in (self.out / "checkpoints").glob("step-*")) \
            if (self.out / "checkpoints").is_dir() else []
        if steps:
            found.append(f"checkpoints up to {steps[-1]}")
        metrics = self.out / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size > 0:
            found.append("metrics.jsonl")
        if (self.out / "adapter.gguf").exists() or (self.out / "peft").exists():
            found.append("an adapter")
        return ", ".join(found) or None

    def check_fresh(self, overwrite: bool) -> bool:
        """Before a fresh (not resumed) run: refuse an earlier run's folder unless
        ``overwrite``.  True when there is an earlier run to replace (``set_aside``, once the
        new run is checked)."""
        earlier = self.earlier_run()
        if earlier is None:
            return False
        if overwrite:
            return True
        if not self.has_checkpoint():
            raise RunDirError(
                f"{self.out} holds an earlier run that stopped before writing a checkpoint "
                f"({earlier}): start it again from step 0 with --resume, replace it with "
                f"--overwrite, or set another output.dir")
        raise RunDirError(
            f"{self.out} holds an earlier run ({earlier}): continue it with --resume, "
            f"replace it with --overwrite (deletes its checkpoints, metrics and adapter), "
            f"or set another output.dir")

    def set_aside(self, log) -> Path:
        """Move the earlier run's files into ``replaced-TIME/`` (deleted by ``drop_replaced``
        once the new run has a checkpoint)."""
        aside = self.out / time.strftime("replaced-%Y%m%d-%H%M%S")
        n = 1
        while aside.exists():
            n += 1
            aside = self.out / time.strftime(f"replaced-%Y%m%d-%H%M%S-{n}")
        aside.mkdir()
        moved = []
        for name in RUN_FILES:
            if (self.out / name).exists():
                os.replace(self.out / name, aside / name)
                moved.append(name)
        log(f"--overwrite: moved the earlier run in {self.out} ({', '.join(moved)}) to {aside}; "
            f"it is deleted when this run writes its first checkpoint")
        return aside


def drop_replaced(aside: Path, log) -> None:
    """The new run has a checkpoint: the earlier run it replaces goes."""
    shutil.rmtree(aside, ignore_errors=True)
    log(f"--overwrite: deleted the earlier run ({aside}) now that this run has a checkpoint")
