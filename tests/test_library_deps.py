"""What the installed libraries ask the dynamic loader for names nothing of this machine's
build folders: a build (or one carried to a GPU machine, or a wheel) loads on a bare machine.
Checked with readelf on every library of ``pytrain/_native`` by ``native/build.py``'s
``portability_problems``, which says what is allowed and why."""
import subprocess

import pytest

import build as native_build  # native/build.py (conftest puts native/ on sys.path)
from pytrain import ggml


def test_every_library_needs_only_what_a_bare_machine_has():
    libs = list((ggml.NATIVE_DIR / "lib").glob("*.so*"))
    assert len(libs) >= 3, libs          # libggml, libggml-base, a CPU module at least
    assert native_build.portability_problems(ggml.NATIVE_DIR) == []


def test_the_check_finds_a_foreign_runpath_and_an_unshipped_library(tmp_path):
    """What the first test would say of a library linked with an absolute RUNPATH (the CUDA
    backend's, before) and needing a library nothing ships (the BLAS module's OpenBLAS)."""
    (tmp_path / "lib").mkdir()
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 1; }\n")
    dep = tmp_path / "libdep.so"
    so = tmp_path / "lib" / "libx.so"
    for cmd in (["cc", "-shared", "-fPIC", "-o", str(dep), str(src)],
                ["cc", "-shared", "-fPIC", "-o", str(so), str(src), f"-L{tmp_path}", "-Wl,--no-as-needed", "-ldep",
                 "-Wl,-rpath,/root/.cache/pytrain/cublas/lib:$ORIGIN"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"no C compiler: {r.stderr[-300:]}")
    assert native_build.portability_problems(tmp_path) == [
        "libx.so needs libdep.so", "libx.so has RUNPATH /root/.cache/pytrain/cublas/lib"]
