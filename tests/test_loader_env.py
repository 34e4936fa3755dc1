"""The thread-wait settings the loader gives OpenMP and OpenBLAS while they load
(pytrain/ggml/loader.py): set only for the load, never over the caller's own choice."""
import json
import os
import subprocess
import sys

import pytest

from pytrain.ggml import loader

PROBE = ("import os, ctypes, json\n"
         "libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p\n"
         "import pytrain.ggml.loader as L\n"
         "print(json.dumps({'set_during_load': L._set_env,\n"
         "                  'after': {k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'OPENBLAS_THREAD_TIMEOUT')},\n"
         "                  'c_after': {k: (libc.getenv(k.encode()) or b'').decode() for k in ('OMP_WAIT_POLICY', 'OPENBLAS_THREAD_TIMEOUT')}}))\n")


def probe(**env) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not loader.build_info().get("blas"), reason="a build without the BLAS backend sets nothing")
def test_wait_settings_hold_for_the_load_only():
    got = probe()
    assert got["set_during_load"] == {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "12"}
    assert got["after"] == {"OMP_WAIT_POLICY": None, "OPENBLAS_THREAD_TIMEOUT": None}
    assert got["c_after"] == {"OMP_WAIT_POLICY": "", "OPENBLAS_THREAD_TIMEOUT": ""}


def test_the_callers_own_settings_win():
    got = probe(OPENBLAS_THREAD_TIMEOUT="20", OMP_WAIT_POLICY="ACTIVE")
    assert got["set_during_load"] == {}
    assert got["after"] == {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_THREAD_TIMEOUT": "20"}


def test_without_blas_nothing_is_set():
    assert probe(PYTRAIN_BLAS="0")["set_during_load"] == {}
