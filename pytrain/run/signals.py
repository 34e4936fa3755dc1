"""How `pytrain train` answers Ctrl-C and SIGTERM: the run's policy on top of ``interrupt``
(which installs the handlers, counts the signals and stops a compute through ggml's abort
flag), and the ``Interrupted`` error each way of stopping ends with.

One process: a signal before the step loop stops at once (nothing was trained); in the loop
the first asks for a stop after the step in flight, the second drops that step and saves the
last finished one, the third stops whatever runs.  Several ranks can save only if all stop at
the same point: a signal before the loop is a request like one inside it, and the second stops
at once (the launcher ends the job).  A first signal during the run's last step interrupts
nothing: the run is complete, and ends as finished (``name`` says which signal came).  Kept apart so that the loop reads as steps and every
message of an interrupted run is in one place.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from pytrain.run import checkpoint as ckpt
from pytrain.step.distributed import World
from pytrain.run.interrupt import Interrupt
from pytrain.run.errors import Interrupted


def handling(log: Callable[[str], None], world: World) -> Interrupt:
    """The run's signal handling (a context manager: the handlers are installed on entry)."""
    one = world.size == 1
    return Interrupt(log, on_setup=_before_training if one else None, hard_at=3 if one else 2)


def _before_training(name: str) -> BaseException:
    return Interrupted(f"interrupted by {name} before training started: nothing was "
                       f"trained, nothing needed saving")


def requested(interrupt: Interrupt, world: World) -> bool:
    """After each step (skipped ones too): was any rank asked to stop?  Every rank agrees."""
    return world.any(interrupt.requested is not None)


def name(interrupt: Interrupt) -> str:
    """The signal that asked the run to stop (another rank's: this one saw none)."""
    return interrupt.requested or "a signal to another rank"


def after_step(interrupt: Interrupt, step: int, where: Path) -> Interrupted:
    """A first signal: the run stopped after ``step``, its checkpoint at ``where``."""
    by = name(interrupt)
    return Interrupted(f"interrupted by {by} after step {step}; "
                       f"checkpoint {where} (resume with --resume)")


def can_save(interrupt: Interrupt, world: World) -> bool:
    """A KeyboardInterrupt in the loop: a second signal dropped the step in flight, and the
    last finished step can still be saved (one process, not yet the signal that stops at
    once)."""
    return world.size == 1 and not interrupt.hard


def at_once(interrupt: Interrupt, step: int, where: Path) -> Interrupted:
    """A second signal: the step in flight was dropped; the last finished one is at ``where``."""
    return Interrupted(f"stopped at once by a second interrupt ({interrupt.requested}) after "
                       f"step {step}: the step in flight was dropped; checkpoint {where} "
                       f"(resume with --resume)")


def further(out: Path) -> Interrupted:
    """The signal that stops whatever runs (one process): checkpoints are written atomically,
    so the newest one on disk is intact."""
    newest = ckpt.latest(out / "checkpoints")
    return Interrupted(
        "stopped at once by a further interrupt; " +
        (f"the newest checkpoint, {newest}, is intact (resume with --resume)" if newest
         else "no checkpoint was written"))
