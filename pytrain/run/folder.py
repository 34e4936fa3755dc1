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
  own checkpoints (``checkpoint.save``);
* what is an earlier run's is what the run's modules declare they write (``run_file``, next to
  the code that writes each file): a replaced run, or one started again from step 0, goes
  aside whole (its best adapter, samples, TensorBoard events, caches too), and a file of the
  user's in the folder stays where it is.  A run writing an undeclared file is a bug that
  tests/test_run_dir.py catches.
"""
from __future__ import annotations

import fcntl
import fnmatch
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pytrain.errors import PytrainError

LOCK = ".pytrain.lock"

# name or glob pattern -> what writes it: every file or folder a run writes into its folder
_RUN_FILES: dict[str, str] = {}


def run_file(pattern: str, what: str) -> str:
    """Declare that runs write ``pattern`` (a name, or a glob such as TensorBoard's
    ``events.out.tfevents.*``) into their folder, ``what`` saying which part of the run:
    the file goes aside with the run it belongs to.  Returns ``pattern``, so that the writer
    names its file by this call.  Declared at import: the run's module imports every module
    that writes into the folder before it sets a run aside."""
    _RUN_FILES[pattern] = what
    return pattern


def is_run_file(name: str) -> bool:
    """``name`` (in a run folder) is a run's: declared, or the temporary file or folder an
    atomic write of one leaves when killed (pytrain.formats.atomic: ``.NAME.PID.HEX.tmp``,
    ``.NAME.RANDOM.tmp``, ``.NAME.HEX.old``)."""
    if _declared(name):
        return True
    return name.startswith(".") and name.endswith((".tmp", ".old")) and \
        any(_declared(name[1:].rsplit(".", k)[0]) for k in (2, 3))


def _declared(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in _RUN_FILES)


@dataclass
class SetAside:
    """An earlier run's files moved into ``path`` (``replaced-TIME/``) by ``RunDir.set_aside``
    for ``why`` (``--overwrite``, ``--resume``, a fresh run), deleted once the new run has a
    checkpoint (``drop_replaced``)."""
    path: Path
    why: str


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
        ``overwrite``.  True when there are files of an earlier run to move aside
        (``set_aside``, once the new run is checked): a replaced run's, or what a run that
        never trained a step left (its config.toml, a cache, TensorBoard's first events)."""
        earlier = self.earlier_run()
        if earlier is not None and not overwrite:
            if not self.has_checkpoint():
                raise RunDirError(
                    f"{self.out} holds an earlier run that stopped before writing a checkpoint "
                    f"({earlier}): start it again from step 0 with --resume, replace it with "
                    f"--overwrite, or set another output.dir")
            raise RunDirError(
                f"{self.out} holds an earlier run ({earlier}): continue it with --resume, "
                f"replace it with --overwrite (deletes its checkpoints, metrics and adapter), "
                f"or set another output.dir")
        return bool(self.run_files_here())

    def run_files_here(self, keep: tuple[str, ...] = ()) -> list[str]:
        """The names in the folder that a run wrote (``is_run_file``), but those in ``keep``;
        never the lock, an earlier ``replaced-*`` folder or a file of the user's."""
        if not self.out.is_dir():
            return []
        return sorted(p.name for p in self.out.iterdir()
                      if p.name != LOCK and p.name not in keep and is_run_file(p.name))

    def set_aside(self, log, why: str, keep: tuple[str, ...] = ()) -> SetAside | None:
        """Move every file of the earlier run (all run files here but ``keep``) into
        ``replaced-TIME/``, deleted by ``drop_replaced`` once the new run has a checkpoint;
        None when there is none.  ``why``: what the user asked for, for the messages."""
        names = self.run_files_here(keep)
        if not names:
            return None
        aside = self.out / time.strftime("replaced-%Y%m%d-%H%M%S")
        n = 1
        while aside.exists():
            n += 1
            aside = self.out / time.strftime(f"replaced-%Y%m%d-%H%M%S-{n}")
        aside.mkdir()
        for name in names:
            os.replace(self.out / name, aside / name)
        log(f"{why}: moved the earlier run in {self.out} ({', '.join(names)}) to {aside}; "
            f"it is deleted when this run writes its first checkpoint")
        return SetAside(aside, why)


def drop_replaced(aside: SetAside, log) -> None:
    """The new run has a checkpoint: the earlier run it replaces goes."""
    shutil.rmtree(aside.path, ignore_errors=True)
    log(f"{aside.why}: deleted the earlier run ({aside.path}) now that this run has a "
        f"checkpoint")
