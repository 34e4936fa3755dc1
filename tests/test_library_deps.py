"""What the installed libraries ask the dynamic loader for names nothing of this machine's
build folders: a build (or a CUDA prefix carried to a GPU machine, or a wheel) loads on a
bare machine.  Checked with readelf on every library of ``pytrain/_native``:

* NEEDED: a library shipped beside it, or one of the system's (glibc, libstdc++, libgcc,
  libgomp) and, for the CUDA backend, the CUDA runtime, cuBLAS and the driver, which
  pytrain preloads from the Python environment's nvidia-* wheels or the system;
* RUNPATH: ``$ORIGIN`` (the package's own folder) only, and for the cffi extension its
  ``$ORIGIN/lib`` and the Python installation's own library folder (which the interpreter
  building it adds).

A CUDA build once carried its build machine's cuBLAS folder in libggml-cuda's RUNPATH, and
the BLAS module the OpenBLAS library only found at the build machine's absolute path."""
import subprocess
import sysconfig
from pathlib import Path

import pytest

from pytrain import ggml

SYSTEM = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1",
          "ld-linux-x86-64.so.2", "libpthread.so.0", "libdl.so.2", "librt.so.1"}
CUDA = {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcuda.so.1"}


def dynamic(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED sonames, RUNPATH/RPATH entries) of an ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    needed, runpath = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RUNPATH)" in line or "(RPATH)" in line:
            runpath += line.split("[", 1)[1].rstrip("]").split(":")
    return needed, runpath


def libraries() -> list[Path]:
    return sorted(ggml.LIB_DIR.iterdir()) + sorted(ggml.NATIVE_DIR.glob("_ggml*.so"))


def violations(lib: Path, shipped: set[str], extension: bool = False) -> list[str]:
    needed, runpath = dynamic(lib)
    allowed_paths = {"$ORIGIN/lib", sysconfig.get_config_var("LIBDIR")} if extension \
        else {"$ORIGIN"}
    return ([f"{lib.name} needs {n}" for n in needed
             if n not in shipped and n not in SYSTEM and n not in CUDA]
            + [f"{lib.name} has RUNPATH {r}" for r in runpath if r not in allowed_paths])


def test_every_library_needs_only_what_a_bare_machine_has():
    shipped = {p.name for p in ggml.LIB_DIR.iterdir()}
    bad = [v for lib in libraries()
           for v in violations(lib, shipped, extension=lib.parent == ggml.NATIVE_DIR)]
    assert not bad, bad


def test_the_check_finds_a_foreign_runpath(tmp_path):
    """What the first test would say of a library linked with an absolute RUNPATH (the CUDA
    backend's, before)."""
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 1; }\n")
    so = tmp_path / "libx.so"
    r = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src),
                        "-Wl,-rpath,/root/.cache/pytrain/cublas/lib:$ORIGIN"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no C compiler: {r.stderr[-300:]}")
    assert violations(so, set()) == ["libx.so has RUNPATH /root/.cache/pytrain/cublas/lib"]
