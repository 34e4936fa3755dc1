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

MPI is detected from the launcher's environment (MPICH/Intel MPI ``PMI_SIZE``, Open MPI
``OMPI_COMM_WORLD_SIZE``, MVAPICH ``MV2_COMM_WORLD_SIZE``, Slurm's ``srun``) and mpi4py is
imported only then: a single-process run never touches it.
"""
from __future__ import annotations

import os
import socket
import sys

import numpy as np

from pytrain.errors import PytrainError


class DistributedError(PytrainError, RuntimeError):
    """The ranks of a run disagree, or MPI is asked for but missing."""


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

    def abort(self, message: str, code: int = 1) -> None:
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

    def abort(self, message: str, code: int = 1) -> None:
        """End every rank of the job now (MPI_Abort), saying which one failed and why."""
        sys.stderr.write(f"[{self.name}] {message}\n")
        sys.stderr.flush()
        self.comm.Abort(code)


_WORLD: World | None = None


def world() -> World:
    """This process's place in the run: an MPI rank when a launcher started several."""
    global _WORLD
    if _WORLD is None:
        _WORLD = MPIWorld() if launcher_size() > 1 else World()
    return _WORLD


def check_agreement(w: World, facts: dict[str, str]) -> None:
    """Every rank must run the same config on the same data, model and build: gather what
    each sees and refuse the run, naming the rank and host that differ."""
    everyone = w.allgather((w.name, facts))
    _, want = everyone[0]
    for name, got in everyone[1:]:
        diff = [k for k in want if got.get(k) != want[k]]
        if diff:
            raise DistributedError(
                f"{name} differs from rank 0 in {', '.join(diff)} "
                f"({'; '.join(f'{k}: {got.get(k)} vs {want[k]}' for k in diff)}); every rank "
                f"must see the same config, data, base model and build")
