"""Data-parallel training over MPI: the processes an ``mpiexec -n N`` (or ``srun``) starts
train one run together, each on its share of every optimizer step's micro-batches.

Why MPI: it is what clusters, Slurm and multi-GPU hosts already run, and LoRA gradients are
small (r 16 on the attention of the 2B shape: 5.9 MB), so one all-reduce per step is cheap.
The semantics are those of one process with ``grad_accum x ranks`` micro-batches per step:

* every rank builds the same seeded batch list and takes its share of each step;
* the step's target count, which the loss divides by, is summed across ranks before any
  micro-batch runs; the gradient accumulators are summed after the last one (one message),
  before the NaN check, the gradient norm and AdamW, which then run identically everywhere;
* a rank with no micro-batch in a step still joins every collective.

How a run ends when something fails (the launcher may drop what a rank wrote just before
``MPI_Abort``, so an abort is kept for what cannot end otherwise):

* a verdict every rank reaches together, raised right after a collective that gave each rank
  the same result (``CollectiveError``: ``agree``, ``on_main``, ``check_agreement``, a NaN step
  after the all-reduce, an interrupt after ``any``), ends the job normally: rank 0 says it once
  (an error also in the run folder's ``error.log``: ``World.end_together``), and every rank
  leaves through ``MPI_Finalize`` with the same exit code (1; 130 for an interrupt);
* any other exception is a failure this rank may meet alone, while the others wait for it in
  a collective: it ends the job at once (``World.abort``: ``MPI_Abort``), its message on
  stderr and in ``error-rank-N.log`` (one file per rank: several may abort at once).

MPI is detected from the launcher's environment (MPICH/Intel MPI ``PMI_SIZE``, Open MPI
``OMPI_COMM_WORLD_SIZE``, MVAPICH ``MV2_COMM_WORLD_SIZE``, Slurm's ``srun``) and mpi4py is
imported only then: a single-process run never touches it.
"""
from __future__ import annotations

import datetime as dt
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from pytrain.errors import PytrainError
from pytrain.formats import atomic

T = TypeVar("T")
# seconds an aborting rank waits between its stderr line and MPI_Abort (see MPIWorld.abort)
ABORT_GRACE_S = 1.0


class DistributedError(PytrainError, RuntimeError):
    """The ranks of a run disagree, or MPI is asked for but missing."""


class CollectiveError(PytrainError):
    """An error every rank raises at the same point, decided from the result of a collective
    that each took part in: no rank is left waiting for another, so the job can end normally
    with ``code`` (``World.end_together``) instead of ``MPI_Abort``.  Raised only right after
    such a collective; an error raised anywhere else is one rank's alone."""
    code = 1


class RanksDisagree(DistributedError, CollectiveError):
    """What the ranks gathered from each other differs (config, data, build, adapter)."""


def forget_messages(folder: str | os.PathLike) -> None:
    """Remove what ``keep_message`` kept for an earlier attempt in ``folder``: a run that
    starts there is not the one that failed."""
    for p in Path(folder).glob("error*.log"):
        if p.name == "error.log" or p.name.startswith("error-rank-"):
            p.unlink(missing_ok=True)


def keep_message(folder: str | os.PathLike | None, name: str, message: str) -> str:
    """``message`` written (atomically, with the time) to ``folder/name``, so that no launcher
    can lose it; the words that tell the user where: " (also in PATH)", or why it could not be
    written.  Nothing is written without a folder (the config did not load)."""
    if folder is None:
        return ""
    path = Path(folder) / name
    try:
        stamp = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        atomic.write_bytes(path, f"{stamp} {message}\n".encode())
    except OSError as e:
        return f" (could not also write it to {path}: {e.strerror or e})"
    return f" (also in {path})"


def launcher_size(env=os.environ) -> int:
    """How many processes the launcher started, from its environment (1 when none)."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_NTASKS", "").isdigit():
        return int(env["SLURM_NTASKS"])
    return 1


class World:
    """One process: every collective is the identity."""
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def __init__(self):
        self.host = socket.gethostname()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        return f"rank {self.rank} on {self.host}"

    def allreduce_sum(self, arr: np.ndarray) -> np.ndarray:
        return arr

    def sum(self, x: float | int) -> float | int:
        return x

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def bcast(self, obj):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def end_together(self, message: str, code: int, folder=None) -> int:
        """Every rank, after the same ``CollectiveError``: rank 0 prints ``message`` and keeps
        it in ``folder/error.log``; returns the exit code every rank leaves with."""
        if self.is_main:
            sys.stderr.write(message + keep_message(folder, "error.log", message) + "\n")
            sys.stderr.flush()
        self.barrier()     # said before any rank exits: a launcher may end the job then
        return code

    def abort(self, message: str, code: int = 1, folder=None) -> None:
        raise SystemExit(code)

    def close(self) -> None:
        pass


class MPIWorld(World):
    """The ranks of an MPI job (mpi4py's COMM_WORLD)."""

    def __init__(self):
        super().__init__()
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise DistributedError(
                f"started by an MPI launcher ({launcher_size()} processes) but mpi4py is not "
                f"installed: pip install mpi4py mpich (or `make build`, which installs them)"
            ) from e
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()

    def allreduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """Sum ``arr`` (contiguous float32/float64/int64) across ranks, in place."""
        self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.SUM)
        return arr

    def sum(self, x: float | int) -> float | int:
        return self.comm.allreduce(x, op=self.MPI.SUM)

    def any(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(1 if flag else 0, op=self.MPI.MAX))

    def bcast(self, obj):
        return self.comm.bcast(obj, root=0)

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, message: str, code: int = 1, folder=None) -> None:
        """End every rank of the job now (MPI_Abort), saying which one failed and why, on
        stderr and in ``folder/error-rank-N.log`` (the launcher may not forward the former).
        MPICH's MPI_Abort returns to its caller until the launcher's kill arrives: this process
        leaves at once, running no more of the program (no second message, no collective)."""
        where = keep_message(folder, f"error-rank-{self.rank}.log", f"[{self.name}] {message}")
        sys.stdout.flush()
        sys.stderr.write(f"[{self.name}] {message}{where}\n")
        sys.stderr.flush()
        # the line is in the pipe to the launcher's proxy, which may be torn down by the abort
        # before it forwards it: on a loaded machine (load 7 on 2 cores) it was lost once in a
        # full-suite run; a moment's grace lets the proxy read it (the file keeps it regardless)
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
        os._exit(code)


_WORLD: World | None = None


def world() -> World:
    """This process's place in the run: an MPI rank when a launcher started several."""
    global _WORLD
    if _WORLD is None:
        _WORLD = MPIWorld() if launcher_size() > 1 else World()
    return _WORLD


def agree(w: World, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
    """``fn()`` on every rank, then one allgather of how it went: where it raised a
    ``PytrainError`` or ``OSError`` on any rank (a config, data or model file error, whether
    every rank or one meets it), every rank raises the same ``CollectiveError`` naming where
    and why, after ``undo`` releases what ``fn`` returned here.  ``fn`` must call no
    collective: a rank that failed before it would leave the others waiting there."""
    if w.size == 1:
        return fn()
    try:
        got, said = fn(), None
    except (PytrainError, OSError) as e:
        got, said = None, str(e)
    failed = [(name, m) for name, m in w.allgather((w.name, said)) if m is not None]
    if not failed:
        return got
    if said is None and undo is not None:
        undo(got)
    by_message: dict[str, list[str]] = {}
    for name, m in failed:
        by_message.setdefault(m, []).append(name)
    if len(failed) == w.size and len(by_message) == 1:       # everyone, the same words
        raise CollectiveError(failed[0][1])
    raise CollectiveError("; ".join(f"{', '.join(names)}: {m}"
                                    for m, names in by_message.items()))


def on_main(w: World, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 (what reads or writes the run folder, which may exist there only),
    its result broadcast to every rank; its ``PytrainError`` or ``OSError`` is raised on every
    rank as a ``CollectiveError``, so that no rank waits in a collective for one that has
    stopped."""
    if w.size == 1:
        return fn()
    got = None
    if w.is_main:
        try:
            got = ("ok", fn())
        except (PytrainError, OSError) as e:
            got = ("error", str(e))
    got = w.bcast(got)
    if got[0] == "error":
        raise CollectiveError(got[1])
    return got[1]


def check_agreement(w: World, facts: dict[str, str]) -> None:
    """Every rank must run the same config on the same data, model and build: gather what
    each sees and refuse the run on every rank (``RanksDisagree``), naming the rank and host
    that differ."""
    everyone = w.allgather((w.name, facts))
    _, want = everyone[0]
    for name, got in everyone[1:]:
        diff = [k for k in want if got.get(k) != want[k]]
        if diff:
            raise RanksDisagree(
                f"{name} differs from rank 0 in {', '.join(diff)} "
                f"({'; '.join(f'{k}: {got.get(k)} vs {want[k]}' for k in diff)}); every rank "
                f"must see the same config, data, base model and build")
