"""Loads the native ggml and registers its backend modules, once, when ``pytrain.ggml`` is
first imported.

Why it takes more than an import: the build ships one ggml-cpu module per x86-64 level and
the one this CPU runs best is dlopened at run time (``PYTRAIN_CPU_VARIANT`` picks another);
libggml-cuda finds the CUDA runtime only if it is loaded first; OpenMP's wait policy must be
set before libgomp loads; and ggml's logging is filtered to warnings and errors.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pytrain.errors import PytrainError

NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"
LIB_DIR = NATIVE_DIR / "lib"

if not (NATIVE_DIR / "build_info.json").exists():
    raise ImportError(f"pytrain's native ggml build in {NATIVE_DIR} is missing or incomplete; "
                      f"build it with `make build` or `python native/build.py`")


class CpuVariantError(PytrainError, ImportError):
    """The ggml-cpu variant asked for is not in this build or not runnable on this CPU."""


@dataclass(frozen=True)
class CpuVariant:
    name: str          # "zen4", "haswell", "x64", ... ("native": built with -march=native)
    path: Path
    score: int         # ggml_backend_score(): 0 = this CPU lacks its instructions
    chosen_by: str     # "best for this CPU" or "PYTRAIN_CPU_VARIANT"


def _variant_name(path: Path) -> str:
    return path.name[len("libggml-cpu-"):-3] if path.name != "libggml-cpu.so" else "native"


def _module_score(path: Path) -> int:
    """ggml_backend_score() of a ggml-cpu module: its own cpuid check (0 when the CPU lacks
    one of its instruction sets, else higher for more of them), as ggml's
    ``ggml_backend_load_best`` computes it.  The module is closed again afterwards."""
    import ctypes
    import _ctypes
    handle = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
    try:
        fn = getattr(handle, "ggml_backend_score", None)
        return int(fn()) if fn is not None else 1
    finally:
        _ctypes.dlclose(handle._handle)


def cpu_variant_scores(lib_dir: Path = LIB_DIR) -> dict[str, tuple[Path, int]]:
    """Every ggml-cpu module of the build, by variant name, with its score on this CPU."""
    return {_variant_name(p): (p, _module_score(p))
            for p in sorted(lib_dir.glob("libggml-cpu*.so"))}


def choose_cpu_variant(scores: dict[str, tuple[Path, int]], wanted: str | None) -> CpuVariant:
    """``wanted`` (``PYTRAIN_CPU_VARIANT``: a variant name, or the path of a ggml-cpu module
    built elsewhere from the same source) if set, else a native module if the build has one,
    else the runnable variant with the highest score, as ggml's own loader picks it."""
    if wanted and os.sep in wanted:
        path = Path(wanted)
        if not path.is_file():
            raise CpuVariantError(f"PYTRAIN_CPU_VARIANT={wanted}: no such file")
        scores = {**scores, wanted: (path, _module_score(path))}
    if not scores:
        raise CpuVariantError(f"no ggml-cpu module in {LIB_DIR}: rebuild with `make build`")
    runnable = sorted((s, n) for n, (_, s) in scores.items() if s > 0)
    if wanted:
        if wanted not in scores:
            raise CpuVariantError(f"PYTRAIN_CPU_VARIANT={wanted}: this build has no such ggml-cpu "
                                  f"variant (it has {', '.join(sorted(scores))})")
        path, score = scores[wanted]
        if score <= 0:
            raise CpuVariantError(
                f"PYTRAIN_CPU_VARIANT={wanted}: this CPU lacks instructions that variant needs "
                f"(it would die with SIGILL); variants this CPU runs: "
                f"{', '.join(n for _, n in runnable) or 'none'}")
        name = _variant_name(path) if os.sep in wanted else wanted
        return CpuVariant(name, path, score, "PYTRAIN_CPU_VARIANT")
    if "native" in scores:
        path, score = scores["native"]
        return CpuVariant("native", path, score, "built for this CPU (PYTRAIN_GGML_NATIVE=1)")
    if not runnable:
        raise CpuVariantError(f"none of this build's ggml-cpu variants runs on this CPU "
                              f"({', '.join(sorted(scores))})")
    score, name = runnable[-1]
    return CpuVariant(name, scores[name][0], score, "best for this CPU")


def _install_log_filter():
    """ggml logs through one process-wide callback; by default it prints everything, which
    with run-time backends means a "loaded ... backend" line per module at every import.
    Warnings and errors still go to stderr; ``PYTRAIN_GGML_LOG=1`` shows ggml's info and
    debug lines too."""
    import sys
    shown = {lib.GGML_LOG_LEVEL_WARN, lib.GGML_LOG_LEVEL_ERROR}
    if os.environ.get("PYTRAIN_GGML_LOG", "") not in ("", "0"):
        shown |= {lib.GGML_LOG_LEVEL_INFO, lib.GGML_LOG_LEVEL_DEBUG}
    last = [lib.GGML_LOG_LEVEL_NONE]

    def log(level, text, _user):
        if level != lib.GGML_LOG_LEVEL_CONT:
            last[0] = level
        if last[0] in shown:
            sys.stderr.write(ffi.string(text).decode(errors="replace"))
            sys.stderr.flush()

    cb = ffi.callback("ggml_log_callback", log)
    lib.ggml_log_set(cb, ffi.NULL)
    return cb                    # kept alive for the life of the process


CUDA_LIBRARIES = ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13")


def cuda_library_dirs() -> list[Path]:
    """Where the CUDA libraries libggml-cuda needs may be, first to last: the nvidia-* wheels
    of the running Python (``nvidia/cu13/lib``: torch's environment on a GPU machine has
    them), then the folders the build found cuBLAS in.  The system's loader path comes last,
    by soname."""
    import sys
    out = [Path(p) / "nvidia" / "cu13" / "lib" for p in sys.path if p]
    out += [Path(d) for d in json.loads((NATIVE_DIR / "build_info.json").read_text())
            .get("cuda_library_dirs", [])]
    return [d for d in dict.fromkeys(out) if d.is_dir()]


def _preload_cuda() -> list[str]:
    """Load the CUDA runtime and cuBLAS globally before libggml-cuda, whose RUNPATH is only
    its own folder, so that it finds them by soname.  Returns what was loaded from where."""
    import ctypes
    loaded = []
    for name in CUDA_LIBRARIES:
        for d in cuda_library_dirs():
            if (d / name).exists():
                ctypes.CDLL(str(d / name), mode=ctypes.RTLD_GLOBAL)
                loaded.append(str(d / name))
                break
        else:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)     # the loader's own path
                loaded.append(name)
            except OSError:
                pass
    return loaded


def _load_backends() -> CpuVariant:
    """Register the backend modules of the build with ggml: CUDA and BLAS when built, and the
    ggml-cpu variant for this CPU (ggml's registry lists devices in this order)."""
    import ctypes
    variant = choose_cpu_variant(cpu_variant_scores(), os.environ.get("PYTRAIN_CPU_VARIANT"))
    cuda = LIB_DIR / "libggml-cuda.so"
    if cuda.exists():
        _preload_cuda()
        try:            # ggml's loader only logs why a module failed: ask the system first
            ctypes.CDLL(str(cuda))
        except OSError as e:
            raise ImportError(f"the CUDA backend {cuda} cannot be loaded ({e}); install the "
                              f"CUDA 13 runtime and cuBLAS (pip install nvidia-cublas "
                              f"nvidia-cuda-runtime) or build without PYTRAIN_CUDA") from e
    for path in (cuda, LIB_DIR / "libggml-blas.so", LIB_DIR / "libggml-rpc.so", variant.path):
        if path.exists() and lib.ggml_backend_load(str(path).encode()) == ffi.NULL:
            raise ImportError(f"ggml could not load its backend module {path}")
    return variant


# With the BLAS backend, ggml-cpu's OpenMP threads must not spin while OpenBLAS's threads work
# between them: with the default (active) wait on this project's 2-core machines a training
# step of the small default model took 1.0 s instead of 0.17, a mid-size one 3.4 s instead of
# 1.7.  libgomp reads the policy once, when it loads with the ggml-cpu module, so it is set
# before that (unless the caller chose one, or loaded OpenMP first), and taken out of the
# environment again so that programs this process starts (a reference run, a compiler) keep
# their own default.
#
# The converse holds too: OpenBLAS's worker threads spin after each product for 2^28 cycles by
# default (tenths of a second) before they sleep, and a step runs ggml-cpu's and oneDNN's
# OpenMP threads between OpenBLAS products, on the same cores.  OpenBLAS reads its timeout once,
# when it loads with ggml-blas, so 2^12 cycles (about a microsecond) is set the same way.  On 2
# cores of an AMD EPYC Zen 4 the mid benchmark step went from 0.96 to 0.84 s in f32 and from
# 0.69 to 0.53 s in bf16, whose oneDNN products lost the second core to a spinning OpenBLAS
# worker (docs/performance.md).
_blas = (json.loads((NATIVE_DIR / "build_info.json").read_text()).get("blas")
         and os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0"))
_set_env = {k: v for k, v in (("OMP_WAIT_POLICY", "PASSIVE"), ("OPENBLAS_THREAD_TIMEOUT", "12"))
            if _blas and k not in os.environ}
os.environ.update(_set_env)
try:
    try:
        from pytrain._native._ggml import ffi, lib  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - depends on the build
        raise ImportError(
            f"pytrain's native ggml library is missing or stale ({e}); build it with "
            f"`make build` or `python native/build.py` from the source tree") from e
    _LOG_CALLBACK = _install_log_filter()
    CPU_VARIANT = _load_backends()
finally:
    for _k in _set_env:
        del os.environ[_k]


def build_info() -> dict:
    """What native/build.py recorded: ggml version, pinned archive, backends."""
    return json.loads((NATIVE_DIR / "build_info.json").read_text())
