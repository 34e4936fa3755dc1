"""A second Ctrl-C stops a graph compute in progress, not only the Python around it.

Python runs signal handlers only when the main thread is back in the interpreter; a training
step's graph compute at the 2B shape holds it in C for tens of seconds.  run.Interrupt counts
the signals on a thread woken by Python's wakeup fd and, at the second one, sets the flag
ggml-cpu checks after every node (its abort callback; the scheduler's eval callback on a GPU),
so the compute returns at its next node."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import os, signal, threading, time
    import numpy as np
    from pytrain import ggml
    from pytrain.ggml import lib
    from pytrain.run.loop import Interrupt

    rt = ggml.Runtime("cpu", threads=2)
    wctx = ggml.Context(n_tensors=2)
    w = lib.ggml_new_tensor_2d(wctx.ptr, lib.GGML_TYPE_F16, 1024, 1024)  # F16: ggml-cpu's matmul
    x = lib.ggml_new_tensor_2d(wctx.ptr, lib.GGML_TYPE_F32, 1024, 256)
    rt.alloc(wctx)
    rng = np.random.default_rng(0)
    ggml.from_numpy(w, (rng.standard_normal((1024, 1024)) / 32).astype(np.float32))
    ggml.from_numpy(x, rng.standard_normal((256, 1024)).astype(np.float32))

    def chain(n):
        # n matmuls, then a last node whose value is exactly 1 everywhere once computed:
        # first and last are outputs (never overwritten), so what they hold says which ran
        ctx = ggml.Context(n_tensors=n + 8, graph_size=n + 8)
        first = y = lib.ggml_mul_mat(ctx.ptr, w, x)
        for _ in range(n - 1):
            y = lib.ggml_mul_mat(ctx.ptr, w, y)
        last = lib.ggml_scale_bias(ctx.ptr, y, 0.0, 1.0)
        lib.ggml_set_output(first)
        lib.ggml_set_output(last)
        graph = ggml.new_graph(ctx, n + 8)
        lib.ggml_build_forward_expand(graph, last)
        rt.alloc_graph(graph, ctx)
        zero = np.zeros((256, 1024), np.float32)
        ggml.from_numpy(first, zero)
        ggml.from_numpy(last, zero)
        return ctx, graph, first, last

    # NODES matmuls take tens of seconds on a fast CPU; the signals go as soon as the first
    # node has written its output, so the compute has begun and has far to go
    ctx, graph, first, last = chain(NODES)
    sent = []

    def kick():
        while not ggml.to_numpy(first).any():
            time.sleep(0.001)
        # two signals that cannot merge into one while the first is pending (two SIGINTs
        # can): Ctrl-C, then SIGTERM, both counted by the run's handling
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        sent.extend([True, True])

    with Interrupt():
        threading.Thread(target=kick, daemon=True).start()
        try:
            rt.compute(graph)
            print("NOT STOPPED")
        except KeyboardInterrupt:
            print("STOPPED", len(sent) >= 2, bool((ggml.to_numpy(last) == 1).all()))
    # the flag is cleared again: a later compute runs whole
    ctx2, graph2, first2, last2 = chain(4)
    rt.compute(graph2)
    print("AFTER", bool((ggml.to_numpy(last2) == 1).all()))
""")


def test_a_second_interrupt_stops_a_compute_in_progress():
    """Observable events only, no timing: the signals are sent once the graph's first node has
    written its output; the compute then returns with KeyboardInterrupt without having run
    its last node (which would hold exactly 1 everywhere), where the Python handler alone
    would have waited for the whole graph; a later compute runs to its last node."""
    code = SCRIPT.replace("NODES", "4000")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    first, after = r.stdout.split("\n")[:2]
    assert first == "STOPPED True False", r.stdout     # signalled; the last node never ran
    assert after == "AFTER True", r.stdout


def test_second_signal_drops_a_step_never_an_update_and_the_third_stops_at_once():
    """The step loop's three signals (pytrain.run.interrupt), in process: the first is a
    request; the second raises nowhere but where a step can be dropped whole (before its
    optimizer update), stops the next compute once an update under way is done, and drops the
    next step before it starts; the third raises at once and puts the earlier handlers back."""
    import os
    import signal
    import time

    import pytest

    from pytrain import ggml
    from pytrain.run.interrupt import Interrupt

    def until(cond):
        end = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < end, "the signal was never handled"
            time.sleep(0.001)
    before = signal.getsignal(signal.SIGINT)
    with Interrupt() as it:
        it.training()
        os.kill(os.getpid(), signal.SIGINT)
        until(lambda: it.requested == "SIGINT")
        assert not it.stop_now and not ggml.abort_requested()
        with it.interruptible():                 # a step's gradients
            with it.holding():                   # its update: the second signal waits
                os.kill(os.getpid(), signal.SIGINT)
                until(lambda: it.count == 2)
                assert it.stop_now and not ggml.abort_requested()
        until(ggml.abort_requested)              # the next compute stops at its first node
        with pytest.raises(KeyboardInterrupt):
            with it.interruptible():             # the next step is dropped before it starts
                pytest.fail("a step started after the second signal")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            until(lambda: False)
        assert signal.getsignal(signal.SIGINT) is before
    assert not ggml.abort_requested()
