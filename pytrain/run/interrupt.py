"""Ctrl-C and SIGTERM during `pytrain train`: stop soon, and never lose a finished step.

* Before the step loop (loading the model, tokenizing, the base model's validation) the first
  signal stops at once: nothing was trained, so nothing needs saving (``on_setup`` makes the
  error raised, which says so).
* In the step loop the first signal is a request: the step in flight finishes, a checkpoint is
  written, the run stops (``requested``).
* The second stops the step in flight at once, even inside a graph compute, and the run still
  writes the checkpoint of the last finished step: a quick double Ctrl-C must not lose every
  step of a run that saves only at its end.  The compute is stopped through ggml's abort flag
  (``ggml.request_abort``), which ggml checks after every node; Python would run a handler only
  once the main thread is back in the interpreter, which a step's compute (tens of seconds at
  the 2B shape) is not.  So the signals are also counted by a thread woken through Python's
  wakeup fd, which sets the flag.  The handler itself raises only where the step can be
  dropped whole (``interruptible``: the step's gradients), never inside the optimizer update
  (``holding``) or while the loop books a finished step or writes a checkpoint: a checkpoint
  never holds half an update, nor an update under the wrong step.
* The third (the second with several ranks, which cannot save unless all of them stop at the
  same point) stops at once, whatever runs (KeyboardInterrupt); checkpoints are written
  atomically, so the newest one on disk is intact.

Python lets only the main thread install signal handlers: a run started from another thread
(a notebook's worker, a service) handles no signal, and ``Interrupt`` says so instead of
failing.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from pytrain import ggml

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """The run's signal handling, a context manager: handlers installed on entry, the previous
    ones restored on exit.  ``on_setup(name)``: the exception a signal raises before
    ``training()`` is called (None: a signal there is a request like any other).
    ``hard_at``: the signal count that stops at once."""

    def __init__(self, log: Callable[[str], None] | None = None,
                 on_setup: Callable[[str], BaseException] | None = None, hard_at: int = 3):
        self.requested: str | None = None      # the first signal's name
        self.count = 0
        self.hard_at = hard_at
        self.handling = False                  # False off the main thread
        self._log = log
        self._on_setup = on_setup
        self._lock = threading.Lock()
        self._holding = False
        self._interruptible = False
        self._seen = 0                         # signals counted by the watcher thread
        self.old: dict = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._thread: threading.Thread | None = None

    @property
    def stop_now(self) -> bool:
        """A second signal came: the step in flight is dropped."""
        return max(self.count, self._seen) >= 2

    @property
    def hard(self) -> bool:
        """As many signals came as stop at once, with no save."""
        return max(self.count, self._seen) >= self.hard_at

    def __enter__(self) -> "Interrupt":
        if threading.current_thread() is not threading.main_thread():
            if self._log is not None:
                self._log("note: the run is not on the main thread, so it does not handle "
                          "Ctrl-C or SIGTERM (Python delivers signals to the main thread "
                          "only); it saves every train.save_every steps and at the end")
            return self
        for sig in SIGNALS:
            self.old[sig] = signal.signal(sig, self.handle)
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wakeup = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(r,),
                                        name="pytrain-interrupt", daemon=True)
        self._thread.start()
        self.handling = True
        return self

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            with self._lock:
                self._seen += sum(b in SIGNALS for b in data)
                if self._seen >= 2 and not self._holding:
                    ggml.request_abort()
            if not data or 0xff in data:              # closed, or told to stop
                return

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        # signals that came while the main thread was in C reach this handler once
        self.count = max(self.count + 1, self._seen)
        if self.requested is None:
            self.requested = name
        if self._on_setup is not None:
            self.restore()
            raise self._on_setup(name)
        if self.count >= self.hard_at:
            self.restore()
            raise KeyboardInterrupt
        if self.count >= 2 and self._interruptible and not self._holding:
            raise KeyboardInterrupt("the step in flight is dropped")

    def training(self) -> None:
        """The step loop starts: from now on a first signal asks the run to stop after its
        step (and a signal counted before, while the main thread was in C, is one)."""
        self._on_setup = None

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A step's work up to its optimizer update, which a second signal may drop whole
        (KeyboardInterrupt: at once, or on entry when the signal came before)."""
        if self.stop_now:
            raise KeyboardInterrupt("the step in flight is dropped")
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    @contextmanager
    def holding(self) -> Iterator[None]:
        """The optimizer update, which a second signal does not cut short: one that came
        before it drops the step before the update; one that comes inside it stops the next
        compute.  The step is done after it: nothing of it may be dropped any more."""
        with self._lock:
            if ggml.abort_requested():
                raise KeyboardInterrupt("stopped before the optimizer update")
            self._holding = True
        try:
            yield
        finally:
            with self._lock:
                self._holding = False
                self._interruptible = False
                if self._seen >= 2:
                    ggml.request_abort()

    def restore(self) -> None:
        for sig, h in self.old.items():
            signal.signal(sig, h)
        self.old = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            r, w = self._wakeup
            self._wakeup = None
            try:
                os.write(w, b"\xff")
            except OSError:
                pass
            if self._thread is not None:
                self._thread.join(timeout=5)
            os.close(r)
            os.close(w)
        if self.handling:
            ggml.request_abort(False)

    def __exit__(self, *exc) -> None:
        self.restore()
