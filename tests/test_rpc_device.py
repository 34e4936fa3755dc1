"""The GPU code path, rehearsed on a CPU machine: a device that is not host memory, served by
ggml's RPC backend (``python -m pytrain.rpc_server``) on 127.0.0.1 and used as
``device = "rpc:HOST:PORT"`` exactly as a CUDA device is (weights, adapter and optimizer state
in its memory, the scheduler copying across, kept graphs on the device, CPU fallbacks
refused).

What it found, the first time it ran: the scheduler places every graph input on the CPU
(ggml-backend.cpp, "graph input"), so the label graph, built on the device from indices in
device memory, ran on the CPU over device pointers and crashed; every input was copied across
at every compute; and a graph split with copies has its nodes rewired to copies the scheduler
frees at the next allocation.  ``Runtime.alloc_graph`` now keeps inputs on the device, and a
device graph runs whole.

The server computes with the same ggml-cpu variant and thread count as this process, so a
step on it is the same float32 operations as on the CPU (with the BLAS backend off, which a
device run never uses): bounds of zero."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pytrain
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"
THREADS = int(os.environ.get("PYTRAIN_THREADS", "2"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chunked_recurrence(monkeypatch):
    """The CPU side runs the DeltaNet recurrence as a GPU does (the chunked ops), not through
    its own fused op (patch 0020): the same graph on both, so the same bits."""
    monkeypatch.setenv("PYTRAIN_FUSED_RECURRENCE", "0")


@pytest.fixture(scope="module")
def device():
    """An rpc-server on a free local port, for this module; its device string."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pytrain.rpc_server", "--endpoint",
                             f"127.0.0.1:{port}", "--threads", str(THREADS)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"rpc-server did not start: {proc.stdout.read()[-2000:]}")
                time.sleep(0.05)
        yield f"rpc:127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def cpu_without_blas(monkeypatch):
    monkeypatch.setenv("PYTRAIN_BLAS", "0")


def test_logits_on_the_device_are_the_cpus(device, cpu_without_blas, chunked_recurrence):
    toks = np.arange(1, 60)
    out = {}
    for dev in ("cpu", device):
        m = pytrain.load_model(FIX / "gqa-f32.gguf", device=dev, threads=THREADS)
        try:
            assert m.runtime.device == dev.split(":")[0]
            assert (m.runtime.gpu is not None) == dev.startswith("rpc")
            out[dev] = m.logits(toks)
        finally:
            m.close()
    np.testing.assert_array_equal(out[device], out["cpu"])


@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_alternating_shapes_and_evaluations_give_the_cpus_training(device, cpu_without_blas,
                                                                  chunked_recurrence, recompute):
    """Steps of two batch shapes in turn, an evaluation after each pair: the device re-splits
    and re-allocates cached graphs at every change, where the copies the scheduler made for
    the last shape would be stale.  Losses, evaluation losses and the adapter equal the CPU's
    bit for bit."""
    from pytrain.data import Example, make_batches
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.trainer import Trainer
    rng = np.random.default_rng(3)
    ex = [Example(rng.integers(0, 480, n).astype(np.int32), rng.random(n) < 0.7)
          for n in (17, 30, 9, 24, 31, 12, 20, 26, 14, 33, 8, 21, 45, 50)]
    short, long_ = make_batches(ex[:6], 2, seed=1), make_batches(ex[6:], 2, seed=1)
    runs = {}
    for dev in ("cpu", device):
        m = pytrain.load_model(FIX / "gqa-f32.gguf", device=dev, threads=THREADS)
        ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
        tr = Trainer(m, ad, AdamWSettings(lr=1e-2), recompute=recompute)
        try:
            losses = []
            for i in range(3):
                losses.append(tr.step([short[i]], 1e-2).loss)
                losses.append(tr.step([long_[i]], 1e-2).loss)
                losses.append(tr.evaluate(short + long_)["loss"])
            runs[dev] = (losses, ad.get())
        finally:
            tr.close()
            m.close()
    assert runs[device][0] == runs["cpu"][0]
    for k, v in runs["cpu"][1].items():
        np.testing.assert_array_equal(runs[device][1][k], v, err_msg=k)
    assert runs["cpu"][0][-1] != runs["cpu"][0][2]            # it trained


def test_the_gpu_tests_pass_on_the_rehearsal_device(device):
    """tests/test_gpu.py, which a CUDA machine runs, run here against the RPC device: every
    test but the CUDA build's doctor line must run and pass."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_gpu.py"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTRAIN_TEST_DEVICE": device}, timeout=1200)
    tail = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0, r.stdout[-4000:]
    assert tail.startswith("9 passed, 1 skipped"), tail
