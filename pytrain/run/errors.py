"""The errors a training run ends with, each a ``PytrainError`` the command line reports as
one line (``Interrupted`` with exit status 130).

They sit below the modules that raise them (``loop``, ``resume``, ``signals``), so that each
imports them without importing the run; ``pytrain.run.loop`` re-exports them.
"""
from __future__ import annotations

from pytrain.errors import PytrainError
from pytrain.step.distributed import CollectiveError


class RunError(PytrainError, RuntimeError):
    """A run that cannot start or had to stop; the message says why and what was kept."""


class Interrupted(RunError, CollectiveError):
    """Ctrl-C or SIGTERM: the run stopped; the message says after which step and what it
    saved (every rank: they agree after each step whether any was interrupted)."""
    code = 130


class NonFiniteStop(RunError, CollectiveError):
    """A step's loss or gradient norm was NaN or inf: every rank sees it in the same summed
    values (after the all-reduce), so every rank stops."""
