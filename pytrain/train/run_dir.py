"""One run per output folder, and nothing of an earlier run lost by accident.

Every re-run of a config writes into the same ``output.dir``.  A fresh run into a folder that
holds an earlier run would otherwise mix the two: its checkpoints pruned by step across both
runs (the new run's step 10 deleted at once beside the old run's 300), ``--resume`` continuing
the wrong one.  So:

* a lock file (``.pytrain.lock``, held with ``flock`` for the run's life, naming its pid)
  stops a second run in the same folder;
* a fresh run into a folder with an earlier run's checkpoints, metrics or adapter is refused
  unless resumed (``--resume``) or replaced (``--overwrite``, which deletes the earlier run's
  files and says which);
* each run has an id, written into every checkpoint's ``state.json``; a run prunes only its
  own checkpoints (``checkpoint.save``).
"""
from __future__ import annotations

import fcntl
import os
import shutil
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

    def check_fresh(self, overwrite: bool, log) -> None:
        """Before a fresh (not resumed) run: refuse an earlier run's folder, or, with
        ``overwrite``, delete the earlier run's files."""
        earlier = self.earlier_run()
        if earlier is None:
            return
        if not overwrite:
            raise RunDirError(
                f"{self.out} holds an earlier run ({earlier}): continue it with --resume, "
                f"replace it with --overwrite (deletes its checkpoints, metrics and adapter), "
                f"or set another output.dir")
        removed = []
        for name in RUN_FILES:
            p = self.out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
            else:
                continue
            removed.append(name)
        log(f"--overwrite: deleted the earlier run in {self.out} ({', '.join(removed)})")
