"""A thin layer over the cffi bindings of the pinned ggml.

Model code calls ggml functions by their ggml names on ``lib`` (``lib.ggml_mul_mat(...)``);
this module only adds what Python needs around them: contexts that free themselves, numpy
round trips (ggml's ``ne`` order is the reverse of numpy's shape), backend choice, and graph
compute through ``ggml_backend_sched`` with a check for ops a GPU backend hands to the CPU.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pytrain.errors import PytrainError

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
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
_passive = (json.loads((NATIVE_DIR / "build_info.json").read_text()).get("blas")
            and os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0")
            and "OMP_WAIT_POLICY" not in os.environ)
if _passive:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
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
    if _passive:
        del os.environ["OMP_WAIT_POLICY"]

# numpy dtypes of the types we move as raw memory.  BF16 has no numpy dtype: it travels as
# float32 and is converted by ggml's own row converters.
_RAW_DTYPES = {
    lib.GGML_TYPE_F32: np.float32,
    lib.GGML_TYPE_F16: np.float16,
    lib.GGML_TYPE_I32: np.int32,
    lib.GGML_TYPE_I8: np.int8,
    lib.GGML_TYPE_I16: np.int16,
    lib.GGML_TYPE_I64: np.int64,
    lib.GGML_TYPE_F64: np.float64,
}

TYPES = {ffi.string(lib.ggml_type_name(t)).decode(): t
         for t in range(lib.GGML_TYPE_COUNT) if lib.ggml_blck_size(t) > 0
         and ffi.string(lib.ggml_type_name(t)).decode() != "NONE"}


def type_name(t: int) -> str:
    """A ggml type's name as GGUF tools print it (``Q4_K``, ``BF16``)."""
    return ffi.string(lib.ggml_type_name(t)).decode().upper()


def op_name(t) -> str:
    return ffi.string(lib.ggml_op_desc(t)).decode()


def build_info() -> dict:
    """What native/build.py recorded: ggml version, pinned archive, backends."""
    return json.loads((NATIVE_DIR / "build_info.json").read_text())


# Native objects made through this module and not freed yet, by kind.  Why: a path that
# raises half-way through building a graph, or a close that forgets a part, leaks native
# memory (a backend buffer lives until its runtime closes, on a GPU for the whole run) that
# Python's garbage collector never sees; tests compare ``live_objects()`` before and after.
_LIVE = {"contexts": 0, "buffers": 0, "kept graph allocators": 0}


def live_objects() -> dict[str, int]:
    """How many ggml contexts, runtime-owned backend buffers and kept-graph allocators
    (``Runtime.alloc_resident``) are alive now, in this process."""
    return dict(_LIVE)


class Context:
    """A ggml context for tensor metadata; with ``no_alloc`` the data lives in backend buffers."""

    def __init__(self, n_tensors: int = 0, graph_size: int = 0, grads: bool = False,
                 mem_size: int | None = None, no_alloc: bool = True):
        if mem_size is None:
            mem_size = n_tensors * lib.ggml_tensor_overhead()
            if graph_size:
                mem_size += lib.ggml_graph_overhead_custom(graph_size, grads)
            mem_size += 1024
        params = ffi.new("struct ggml_init_params *")
        params.mem_size = mem_size
        params.mem_buffer = ffi.NULL
        params.no_alloc = no_alloc
        self.ptr = lib.ggml_init(params[0])
        if self.ptr == ffi.NULL:
            raise MemoryError(f"ggml_init failed for a {mem_size}-byte context")
        _LIVE["contexts"] += 1

    def compute_tensors(self) -> list:
        """The tensors of this context that live in compute buffers: its own tensors and views
        of them (a view of a tensor from another, persistent, context keeps pointing into
        that tensor).  Kept until the context grows (a step graph's ~30k tensors took ~50 ms
        to list and filter from Python, at every allocation of its graph)."""
        used = lib.ggml_used_mem(self.ptr)
        if getattr(self, "_compute_tensors_at", None) != used:
            own = list(self.tensors())
            mine = {address(t) for t in own}
            self._compute_tensors = [t for t in own
                                     if t.view_src == ffi.NULL or address(t.view_src) in mine]
            self._compute_tensors_at = used
        return self._compute_tensors

    def tensors(self) -> Iterator:
        """Every tensor made in this context, in creation order."""
        t = lib.ggml_get_first_tensor(self.ptr)
        while t != ffi.NULL:
            yield t
            t = lib.ggml_get_next_tensor(self.ptr, t)

    def close(self) -> None:
        if self.ptr is not None and self.ptr != ffi.NULL:
            lib.ggml_free(self.ptr)
            _LIVE["contexts"] -= 1
        self.ptr = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- tensors

def shape(t) -> tuple[int, ...]:
    """The numpy shape of a tensor: ggml's ne reversed, trailing unit dims dropped."""
    n = lib.ggml_n_dims(t)
    return tuple(int(t.ne[i]) for i in reversed(range(n)))


def set_name(t, name: str):
    lib.ggml_set_name(t, name.encode()[:63])
    return t


def name(t) -> str:
    return ffi.string(t.name).decode()


def to_numpy(t) -> np.ndarray:
    """Copy a contiguous tensor from its backend buffer; quantized, F16 and BF16 types are
    returned as float32 through ggml's own dequantization (F16 stays float16)."""
    if not lib.ggml_is_contiguous(t):
        raise ValueError(f"tensor {name(t)!r} is not contiguous")
    nbytes = lib.ggml_nbytes(t)
    raw = np.empty(nbytes, dtype=np.uint8)
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(raw), 0, nbytes)
    dt = _RAW_DTYPES.get(t.type)
    if dt is not None:
        return raw.view(dt).reshape(shape(t))
    return decode(raw, t.type, lib.ggml_nelements(t)).reshape(shape(t))


def decode(raw: np.ndarray, ggml_type: int, n: int) -> np.ndarray:
    """float32 values of ``n`` elements stored as ``ggml_type`` in the bytes ``raw``, through
    ggml's own ``to_float`` (a copy even for F32)."""
    if ggml_type == lib.GGML_TYPE_F32:
        return np.frombuffer(raw, np.float32, n).copy()
    traits = lib.ggml_get_type_traits(ggml_type)
    if traits.to_float == ffi.NULL:
        raise TypeError(f"ggml has no dequantization for type {type_name(ggml_type)}")
    src = np.ascontiguousarray(raw)
    out = np.empty(n, dtype=np.float32)
    traits.to_float(ffi.cast("void *", ffi.from_buffer(src)), ffi.cast("float *", ffi.from_buffer(out)), n)
    return out


def from_numpy(t, arr: np.ndarray) -> None:
    """Copy ``arr`` into a tensor's backend buffer, converting or quantizing to its type."""
    arr = np.asarray(arr)
    want = shape(t)
    squeezed = tuple(d for d in arr.shape if d != 1)
    if arr.size != lib.ggml_nelements(t) or (
            arr.ndim > 1 and squeezed != tuple(d for d in want if d != 1)):
        # a flat array is data in ggml's order; any other must have the tensor's shape (unit
        # dims aside): a transposed array of the right size would be copied in scrambled
        raise ValueError(f"tensor {name(t)!r} has shape {want}, got array of shape {arr.shape}")
    raw = to_bytes(arr, t.type, row_len=int(t.ne[0]))
    if raw.nbytes != lib.ggml_nbytes(t):
        raise ValueError(f"tensor {name(t)!r}: {raw.nbytes} bytes for {lib.ggml_nbytes(t)}")
    lib.ggml_backend_tensor_set(t, ffi.from_buffer(raw), 0, raw.nbytes)


def to_bytes(arr: np.ndarray, ggml_type: int, row_len: int) -> np.ndarray:
    """Encode an array as the bytes of ``ggml_type`` (rows of ``row_len`` for block types)."""
    dt = _RAW_DTYPES.get(ggml_type)
    if dt is not None:
        return np.ascontiguousarray(arr, dtype=dt).reshape(-1).view(np.uint8)
    src = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    n = src.size
    if ggml_type == lib.GGML_TYPE_BF16:
        out = np.empty(n, dtype=np.uint16)
        lib.ggml_fp32_to_bf16_row(ffi.cast("float *", ffi.from_buffer(src)),
                                  ffi.cast("ggml_bf16_t *", ffi.from_buffer(out)), n)
        return out.view(np.uint8)
    if n % row_len:
        raise ValueError(f"{n} values do not make whole rows of {row_len}")
    nrows = n // row_len
    out = np.empty(lib.ggml_row_size(ggml_type, row_len) * nrows, dtype=np.uint8)
    lib.ggml_quantize_chunk(ggml_type, ffi.cast("float *", ffi.from_buffer(src)),
                            ffi.cast("void *", ffi.from_buffer(out)), 0, nrows, row_len,
                            ffi.NULL)
    return out


# --------------------------------------------------------------------------- backends

@dataclass
class Device:
    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu", "accel"
    memory_free: int
    memory_total: int


_DEV_KIND = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
             lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}


def devices() -> list[Device]:
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        free = ffi.new("size_t *")
        total = ffi.new("size_t *")
        lib.ggml_backend_dev_memory(d, free, total)
        out.append(Device(ffi.string(lib.ggml_backend_dev_name(d)).decode(),
                          ffi.string(lib.ggml_backend_dev_description(d)).decode(),
                          _DEV_KIND.get(lib.ggml_backend_dev_type(d), "other"),
                          int(free[0]), int(total[0])))
    return out


def _cpu_reg():
    return lib.ggml_backend_dev_backend_reg(lib.ggml_backend_dev_by_type(
        lib.GGML_BACKEND_DEVICE_TYPE_CPU))


def cpu_features() -> list[str]:
    """The instruction sets the loaded ggml-cpu variant was compiled for ("avx2",
    "avx512", "amx_int8", ...; "llamafile", "openmp", "repack" for its other features),
    lower case, as ggml's CPU backend reports them."""
    fn = lib.ggml_backend_reg_get_proc_address(_cpu_reg(), b"ggml_backend_get_features")
    if fn == ffi.NULL:
        return []
    feats = ffi.cast("ggml_backend_get_features_t", fn)(_cpu_reg())
    out = []
    i = 0
    while feats[i].name != ffi.NULL:
        out.append(ffi.string(feats[i].name).decode().lower())
        i += 1
    return out


def backend_name(backend) -> str:
    return ffi.string(lib.ggml_backend_name(backend)).decode()


def buffer_type_name(buft) -> str:
    return ffi.string(lib.ggml_backend_buft_name(buft)).decode()


def extra_buffer_types() -> list[str]:
    """ggml-cpu's "extra" buffer types on this CPU (AMX, CPU_REPACK, ...).

    Weights placed in one of them run other kernels than ggml-cpu's ordinary MUL_MAT
    (repacked layouts, AMX tiles; the AMX one crashes on some Intel CPUs).  pytrain never
    asks for them: weights, adapters and optimizer state go through
    ``ggml_backend_alloc_ctx_tensors`` (a backend's default buffer type), and the scheduler is
    created without buffer types (the defaults again).  Listed here for ``pytrain doctor``
    and the test that checks every buffer pytrain uses is a default one."""
    dev = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    fn = lib.ggml_backend_reg_get_proc_address(_cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
    if fn == ffi.NULL:
        return []
    arr = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(dev)
    out = []
    i = 0
    while arr != ffi.NULL and arr[i] != ffi.NULL:
        out.append(buffer_type_name(arr[i]))
        i += 1
    return out


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


def _set_threads(backend, threads: int) -> None:
    """A backend's thread count, through its module's registry entry (the CPU and BLAS
    backends are modules loaded at run time: their functions are not linked)."""
    reg = lib.ggml_backend_dev_backend_reg(lib.ggml_backend_get_device(backend))
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
    if fn != ffi.NULL:
        ffi.cast("ggml_backend_set_n_threads_t", fn)(backend, threads)


def _blas_device():
    dev = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_ACCEL)
    if dev == ffi.NULL or ffi.string(lib.ggml_backend_dev_name(dev)).decode() != "BLAS":
        return None
    return dev


def blas_enabled() -> bool:
    """Whether a CPU runtime made now gets ggml's BLAS backend: the build has it and
    PYTRAIN_BLAS does not turn it off (what a plan needs to know without making one)."""
    return os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0") and _blas_device() is not None


def bf16_kernel() -> str:
    """The oneDNN matmul ggml-blas multiplies BF16 weights with on this CPU (patch 0018:
    "brg:avx512_core_amx", "brg:avx512_core_bf16", or an emulation on a CPU without bf16
    units); "" when the build has no BLAS backend or no oneDNN."""
    dev = _blas_device()
    if dev is None:
        return ""
    fn = lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(dev),
                                               b"ggml_backend_blas_bf16_kernel")
    if fn == ffi.NULL:
        return ""
    return ffi.string(ffi.cast("const char * (*)(void)", fn)()).decode()


def _init_blas(threads: int):
    """The BLAS backend with ``threads`` threads, or None when the build has none."""
    dev = _blas_device()
    if dev is None:
        return None
    backend = lib.ggml_backend_dev_init(dev, ffi.NULL)
    _set_threads(backend, threads)
    return backend


def _set_abort_callback(backend) -> None:
    """ggml-cpu checks pytrain's abort flag after every node (``request_abort``)."""
    reg = lib.ggml_backend_dev_backend_reg(lib.ggml_backend_get_device(backend))
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_abort_callback")
    if fn != ffi.NULL:
        ffi.cast("ggml_backend_set_abort_callback_t", fn)(backend, lib.pytrain_abort_callback(),
                                                          ffi.NULL)


def request_abort(on: bool = True) -> None:
    """Make every graph compute in this process stop at its next node (a second Ctrl-C); safe
    to call from any thread while the main thread is inside a compute."""
    lib.pytrain_request_abort(1 if on else 0)


def abort_requested() -> bool:
    """Whether ``request_abort`` is in force (the next compute would stop at its first node)."""
    return bool(lib.pytrain_abort_is_requested())


def _check(status) -> None:
    if status == lib.GGML_STATUS_ABORTED or (status == lib.GGML_STATUS_SUCCESS
                                             and lib.pytrain_abort_is_requested()):
        raise KeyboardInterrupt("graph compute stopped by request")
    if status != lib.GGML_STATUS_SUCCESS:
        raise RuntimeError(f"graph compute failed with ggml status {status}")


class DeviceError(PytrainError, ValueError):
    """A device that is not there or not known."""


class OutOfMemoryError(PytrainError, MemoryError):
    """A buffer the device could not give: the run needs more memory than it has."""


class SettingError(PytrainError, ValueError):
    """An environment variable pytrain reads holds a value it cannot use."""


def forced_threads() -> int | None:
    """``PYTRAIN_THREADS``: the thread count every runtime uses (None: unset)."""
    raw = os.environ.get("PYTRAIN_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise SettingError(f"PYTRAIN_THREADS={raw!r}: expected a whole number of threads >= 1 "
                           f"(or unset it)")
    return int(raw)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _gpu_devices(reg_name: str) -> list:
    """The GPU devices (discrete or integrated) of the backend registered as ``reg_name``
    ("CUDA", "Vulkan"), in ggml's order."""
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        reg = lib.ggml_backend_dev_backend_reg(d)
        if (lib.ggml_backend_dev_type(d) in (lib.GGML_BACKEND_DEVICE_TYPE_GPU,
                                             lib.GGML_BACKEND_DEVICE_TYPE_IGPU)
                and ffi.string(lib.ggml_backend_reg_name(reg)).decode() == reg_name):
            found.append(d)
    return found


def _cuda_device(index: int = 0):
    """The ``index``-th GPU device (modulo their count) of a CUDA build, or None."""
    found = _gpu_devices("CUDA")
    return found[index % len(found)] if found else None


VULKAN_MODULE = LIB_DIR / "libggml-vulkan.so"
_vulkan_state: dict = {}


def vulkan_built() -> bool:
    return VULKAN_MODULE.exists()


def load_vulkan() -> bool:
    """Register ggml-vulkan with ggml, once per process, when a run, ``pytrain doctor`` or a
    test asks for it; False when the build has none or no Vulkan driver answers.  Not done at
    import: it starts the Vulkan loader and every installed driver (lavapipe's LLVM among
    them) in every process.  ggml-vulkan reads ``GGML_VK_VISIBLE_DEVICES`` now: without it
    it lists discrete and integrated GPUs only, so Mesa's lavapipe (a CPU device) is used
    only when asked for, as ``GGML_VK_VISIBLE_DEVICES=0``."""
    if "loaded" not in _vulkan_state:
        ok = vulkan_built() and lib.ggml_backend_load(str(VULKAN_MODULE).encode()) != ffi.NULL
        _vulkan_state["loaded"] = ok
    return _vulkan_state["loaded"]


def _vulkan_device(index: int = 0):
    """The ``index``-th device (modulo their count) ggml-vulkan lists, or a DeviceError
    saying why there is none."""
    if not vulkan_built():
        raise DeviceError("device 'vulkan' requested but this build has no Vulkan backend "
                          "(build with `make build VULKAN=1` or PYTRAIN_VULKAN=1)")
    found = _gpu_devices("Vulkan") if load_vulkan() else []
    if not found:
        hint = ("; Mesa's lavapipe, a CPU device for testing, is installed: set "
                "GGML_VK_VISIBLE_DEVICES=0 to use it" if lavapipe_installed()
                and "GGML_VK_VISIBLE_DEVICES" not in os.environ else "")
        raise DeviceError(f"device 'vulkan' requested but ggml-vulkan lists no device (no "
                          f"Vulkan driver for a GPU here){hint}")
    return found[index % len(found)]


def lavapipe_installed() -> bool:
    """Whether Mesa's software Vulkan driver is registered with the Vulkan loader."""
    return any(Path(d).glob("lvp_icd*.json") for d in
               ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d"))


def is_lavapipe(description: str) -> bool:
    """A Vulkan device description naming Mesa's software driver (llvmpipe underneath)."""
    return description.lower().startswith("llvmpipe")


def _rpc_backend(endpoint: str):
    """A backend on the first device the rpc-server at ``endpoint`` (HOST:PORT) serves."""
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if reg == ffi.NULL:
        raise DeviceError("this build has no RPC backend (libggml-rpc.so): rebuild with "
                          "`make build`")
    add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    server = ffi.cast("ggml_backend_reg_t (*)(const char *)", add)(endpoint.encode())
    if server == ffi.NULL or lib.ggml_backend_reg_dev_count(server) == 0:
        raise DeviceError(f"no RPC server answers at {endpoint} (start one with `python -m "
                          f"pytrain.rpc_server --endpoint {endpoint}`)")
    backend = lib.ggml_backend_dev_init(lib.ggml_backend_reg_dev_get(server, 0), ffi.NULL)
    if backend == ffi.NULL:
        raise DeviceError(f"the RPC device at {endpoint} could not be opened")
    return backend


DEVICES = ("cpu", "cuda", "vulkan", "auto")     # and rpc:HOST:PORT


class CPUFallbackError(PytrainError, RuntimeError):
    """A GPU run would execute some ops on the CPU, copying their inputs every step."""


_PLACEHOLDER = ffi.cast("void *", 1 << 20)   # data of measured-only tensors: never dereferenced


class Runtime:
    """Backends plus a scheduler: the primary backend (GPU when chosen) first, CPU last.

    ``device``: ``cpu``, ``cuda`` (fails if there is none), ``vulkan`` (ggml-vulkan's first
    device: any vendor's GPU, or Mesa's lavapipe), ``auto`` (a CUDA GPU when present), or
    ``rpc:HOST:PORT``: the device an ``rpc-server`` (``python -m
    pytrain.rpc_server``) serves there, used as a GPU is: weights, adapter and optimizer state
    in its memory, the scheduler copying inputs and results across, CPU fallbacks refused.
    """

    def __init__(self, device: str = "auto", threads: int | None = None,
                 graph_size: int = 8192, allow_cpu_fallback: bool = False, blas: bool = True,
                 device_index: int = 0):
        if device not in DEVICES and not device.startswith("rpc:"):
            raise DeviceError(f"device must be 'cpu', 'cuda', 'vulkan', 'auto' or "
                              f"'rpc:HOST:PORT', got {device!r}")
        # PYTRAIN_THREADS overrides every runtime's thread count, configs and callers
        # included: for running a whole test suite or benchmark at another count
        self.threads = forced_threads() or threads or default_threads()
        self.allow_cpu_fallback = allow_cpu_fallback
        gpu = None
        if device.startswith("rpc:"):
            gpu = _rpc_backend(device[len("rpc:"):])
        elif device == "vulkan":
            gpu = lib.ggml_backend_dev_init(_vulkan_device(device_index), ffi.NULL)
            if gpu == ffi.NULL:
                raise DeviceError("the Vulkan device could not be opened")
        elif device in ("cuda", "auto"):
            dev = _cuda_device(device_index)
            if dev is not None:
                gpu = lib.ggml_backend_dev_init(dev, ffi.NULL)
            elif device == "cuda":
                raise DeviceError("device 'cuda' requested but ggml reports no GPU device "
                                   "(build with PYTRAIN_CUDA=1 on a machine with CUDA)")
        self.cpu = lib.ggml_backend_init_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU, ffi.NULL)
        _set_threads(self.cpu, self.threads)
        _set_abort_callback(self.cpu)
        self.gpu = gpu
        # ggml's BLAS backend (OpenBLAS) takes the large matmuls and OUT_PRODs off the CPU
        # backend when the build has it; listed before the CPU so the scheduler gives it those
        # ops, never with a GPU (it would only hide CPU fallbacks).  PYTRAIN_BLAS=0 leaves it
        # out (benchmarks compare both).
        self.blas = None
        if gpu is None and blas and os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0"):
            self.blas = _init_blas(self.threads)
        self.backends = [b for b in (gpu, self.blas, self.cpu) if b is not None]
        self.primary = self.backends[0]
        self.device = ((device.split(":")[0] if device != "auto" else "cuda")
                       if gpu is not None else "cpu")
        self._backend_arr = ffi.new("ggml_backend_t[]", self.backends)
        self.graph_size = 0
        self.sched = None
        self._current = None       # address of the graph the scheduler has allocated
        self._eval_cb = None       # set_eval_callback's callback (None: the default)
        self._ensure_sched(graph_size)
        self._buffers: list = []
        self._gallocs: list = []   # allocators of the graphs kept allocated (alloc_resident)

    def _ensure_sched(self, graph_size: int) -> None:
        """The scheduler's hash set and backend-id arrays are sized at creation; a graph with
        more tensors than that overflows them (heap corruption, not an error), so the
        scheduler is recreated larger whenever a bigger graph comes."""
        if self.sched is not None and graph_size <= self.graph_size:
            return
        if self.sched is not None:
            lib.ggml_backend_sched_free(self.sched)
        self._current = None
        self.graph_size = max(graph_size, 2 * self.graph_size)
        self.sched = lib.ggml_backend_sched_new(self._backend_arr, ffi.NULL, len(self.backends),
                                                self.graph_size, False, True)
        self._apply_eval_callback()

    def _apply_eval_callback(self) -> None:
        cb = self._eval_cb
        if cb is None and self.gpu is not None:
            cb = lib.pytrain_eval_callback()  # ggml-cuda has no abort callback: asked per node
        lib.ggml_backend_sched_set_eval_callback(
            self.sched, cb if cb is not None else ffi.cast("ggml_backend_sched_eval_callback", 0),
            ffi.NULL)

    def set_eval_callback(self, callback=None) -> None:
        """Have the scheduler call ``callback`` (a cffi ``ggml_backend_sched_eval_callback``)
        before and after every node, so that graphs are computed node by node (profiling);
        None: back to the default (on a GPU the per-node abort check, else none)."""
        self._eval_cb = callback
        self._apply_eval_callback()

    def node_backend(self, t) -> str:
        """The name of the backend the scheduler placed node ``t`` of the allocated graph on
        ("CPU", "BLAS", "CUDA0"), "?" when it placed none."""
        b = lib.ggml_backend_sched_get_tensor_backend(self.sched, t)
        return backend_name(b) if b != ffi.NULL else "?"

    def close(self) -> None:
        if getattr(self, "sched", None) is not None:
            lib.ggml_backend_sched_free(self.sched)
            self.sched = None
        for g in getattr(self, "_gallocs", []):
            lib.ggml_gallocr_free(g)
            _LIVE["kept graph allocators"] -= 1
        self._gallocs = []
        for b in getattr(self, "_buffers", []):
            lib.ggml_backend_buffer_free(b)
            _LIVE["buffers"] -= 1
        self._buffers = []
        for b in getattr(self, "backends", []):
            lib.ggml_backend_free(b)
        self.backends = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- persistent tensors (weights, adapters, optimizer state)
    def alloc(self, ctx: Context, on_cpu: bool = False, measure_only: bool = False):
        """Allocate every tensor of ``ctx`` in one buffer of the primary (or CPU) backend.

        ``measure_only``: allocate nothing; the tensors get a placeholder data pointer in a
        tiny stand-in buffer (returned, freed like a real one), so graphs over them can be
        built and measured (``reserve_sizes``), never computed: the allocator counts them as
        placed elsewhere, as it does weights.  ``pytrain plan`` sizes a run whose layer inputs
        alone may exceed the machine's memory this way."""
        if measure_only:
            stand_in = self.alloc_buffer(64, on_cpu=on_cpu)     # where the scheduler looks
            for t in ctx.tensors():
                t.data = _PLACEHOLDER
                t.buffer = stand_in
            return stand_in
        backend = self.cpu if on_cpu else self.primary
        buf = lib.ggml_backend_alloc_ctx_tensors(ctx.ptr, backend)
        if buf == ffi.NULL:
            need = sum(int(lib.ggml_nbytes(t)) for t in ctx.tensors())
            raise OutOfMemoryError(f"out of memory: could not allocate {_gib(need)} on "
                                   f"{self.device} (`pytrain plan CONFIG` shows what a run "
                                   f"needs and whether it fits)")
        self._buffers.append(buf)
        _LIVE["buffers"] += 1
        return buf

    def alloc_buffer(self, n_bytes: int, on_cpu: bool = True):
        """A buffer of ``n_bytes`` in the CPU's (or the primary backend's) default buffer
        type, owned by the runtime (freed by ``free`` or ``close``)."""
        backend = self.cpu if on_cpu else self.primary
        buf = lib.ggml_backend_buft_alloc_buffer(lib.ggml_backend_get_default_buffer_type(backend),
                                                 n_bytes)
        if buf == ffi.NULL:
            raise OutOfMemoryError(f"out of memory: could not allocate a buffer of "
                                   f"{_gib(n_bytes)} on {self.device}")
        self._buffers.append(buf)
        _LIVE["buffers"] += 1
        return buf

    def reserve_sizes(self, graph) -> dict[str, int]:
        """The compute buffers the scheduler would allocate for ``graph``, by buffer type name
        ("CPU", "CUDA0"), without allocating them.  Measured by a scheduler of its own:
        ``reserve_size`` leaves the planned sizes in the allocator without allocating, and a
        later graph that fits that plan would then be placed into buffers that were never
        made.  Backends with the same buffer type (BLAS and the CPU) share one buffer in
        ggml's allocator, and ``reserve_size`` reports it for each of them: it is counted once."""
        n = len(self.backends)
        sched = lib.ggml_backend_sched_new(self._backend_arr, ffi.NULL, n, sched_size(graph),
                                           False, True)
        try:
            sizes = ffi.new("size_t[]", n)
            lib.ggml_backend_sched_reserve_size(sched, graph, sizes)
            out: dict[str, int] = {}
            for i, b in enumerate(self.backends):
                out.setdefault(buffer_type_name(lib.ggml_backend_get_default_buffer_type(b)),
                               int(sizes[i]))
            return out
        finally:
            lib.ggml_backend_sched_free(sched)

    def free(self, buf) -> None:
        self._buffers.remove(buf)
        lib.ggml_backend_buffer_free(buf)
        _LIVE["buffers"] -= 1
        self._current = None

    # -- graphs
    def alloc_graph(self, graph, ctx: "Context") -> None:
        """Assign backends and allocate the graph's intermediate tensors (``ctx`` is the
        context its nodes were made in); inputs can be set afterwards.  Refuses CPU
        fallbacks on a GPU backend unless allowed.

        A graph that is still the allocated one is left as it is.  Any other graph may hold
        data pointers into compute buffers the scheduler has since reused or freed (ggml-alloc
        treats a tensor with data as already placed), so those pointers are cleared first —
        what ggml-opt does by duplicating its static graphs before each allocation.  Which
        tensors to clear is decided by ownership, never by comparing a tensor's buffer pointer
        with the live buffers: a freed compute buffer's address can come back as a new weight
        or seed buffer (malloc reuses it), and such a stale tensor then looked static, kept
        its dangling data pointer and crashed, or wrote into freed memory."""
        if self._current == address(graph):
            return
        for t in ctx.compute_tensors():
            t.data = ffi.NULL
            t.buffer = ffi.NULL
        self._ensure_sched(sched_size(graph))
        lib.ggml_backend_sched_reset(self.sched)
        self._current = None
        if self.gpu is not None:
            # the scheduler puts every input on its last backend, the CPU (ggml-backend.cpp,
            # "graph input"), and copies it across at every compute: the [V, rows] label rows
            # among them, and a graph built on the device (labels from O(rows) indices) would
            # read device memory from the CPU.  Inputs live on the device instead, so a graph
            # the device runs whole has no split and no copy (no node's src rewritten by the
            # scheduler to a copy in a context it frees at the next allocation).
            for t in ctx.compute_tensors():
                if t.flags & lib.GGML_TENSOR_FLAG_INPUT:
                    lib.ggml_backend_sched_set_tensor_backend(self.sched, t, self.primary)
        if not lib.ggml_backend_sched_alloc_graph(self.sched, graph):
            raise OutOfMemoryError(f"out of memory: could not allocate a graph's compute "
                                   f"buffer on {self.device} (`pytrain plan CONFIG` shows "
                                   f"what a run needs; train.recompute = \"layers\" or a "
                                   f"smaller batch needs less)")
        self._current = address(graph)
        if self.gpu is not None and not self.allow_cpu_fallback:
            fb = self.cpu_fallbacks(graph)
            if fb:
                raise CPUFallbackError(
                    f"{len(fb)} ops would run on the CPU instead of {self.device}: "
                    + ", ".join(sorted(set(fb))[:12]))

    # -- small graphs kept allocated, outside the scheduler
    @property
    def compute_backend(self):
        """The backend every op of a kept graph runs on: the GPU, else the CPU."""
        return self.gpu if self.gpu is not None else self.cpu

    def alloc_resident(self, graph):
        """Allocate a small graph once, in a buffer of its own on ``compute_backend``, to be
        run by ``compute_resident`` any number of times.  For the optimizer's graphs, which run
        between every two training steps: through the scheduler each of them evicted the step
        graph, which then had to be allocated again (its whole node list walked by ggml and
        its tensors by Python) at every step.  Every op must run on that backend (no
        scheduler splits it).  Returns the graph's allocator, for ``free_resident``."""
        buft = lib.ggml_backend_get_default_buffer_type(self.compute_backend)
        galloc = lib.ggml_gallocr_new(buft)
        if galloc == ffi.NULL or not lib.ggml_gallocr_alloc_graph(galloc, graph):
            if galloc != ffi.NULL:
                lib.ggml_gallocr_free(galloc)
            raise OutOfMemoryError(f"out of memory: could not allocate a kept graph on "
                                   f"{self.device}")
        self._gallocs.append(galloc)
        _LIVE["kept graph allocators"] += 1
        return galloc

    def free_resident(self, galloc) -> None:
        """Free what ``alloc_resident`` allocated for a kept graph (``galloc``: its return)."""
        self._gallocs.remove(galloc)
        lib.ggml_gallocr_free(galloc)
        _LIVE["kept graph allocators"] -= 1

    def compute_resident(self, graph) -> None:
        _check(lib.ggml_backend_graph_compute(self.compute_backend, graph))

    def forget_graph(self) -> None:
        """Call before freeing the context of the allocated graph."""
        self._current = None

    def cpu_fallbacks(self, graph) -> list[str]:
        """Ops of an allocated graph that the scheduler placed on the CPU backend.  One split
        whose backend is the GPU means every node is there (splits are runs of nodes on one
        backend): checked in O(1), where walking ~30k nodes from Python took tens of ms at
        every allocation (layer-wise recompute allocates its graphs at every step)."""
        if self.gpu is None:
            return []
        if (self._current == address(graph) and lib.ggml_graph_n_nodes(graph) > 0
                and lib.ggml_backend_sched_get_n_splits(self.sched) == 1
                and lib.ggml_backend_sched_get_tensor_backend(
                    self.sched, lib.ggml_graph_node(graph, -1)) == self.gpu):
            return []
        out = []
        for i in range(lib.ggml_graph_n_nodes(graph)):
            node = lib.ggml_graph_node(graph, i)
            if node.op in (lib.GGML_OP_NONE, lib.GGML_OP_VIEW, lib.GGML_OP_RESHAPE,
                           lib.GGML_OP_PERMUTE, lib.GGML_OP_TRANSPOSE):
                continue
            if lib.ggml_backend_sched_get_tensor_backend(self.sched, node) == self.cpu:
                out.append(op_name(node))
        return out

    def device_memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device the step runs on, as ggml reports them (system
        memory for the CPU, whose buffers the BLAS backend shares; ggml reads physical pages
        there, so pytrain.train.memory also asks the container's cgroup)."""
        dev = lib.ggml_backend_get_device(self.gpu if self.gpu is not None else self.cpu)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        return int(free[0]), int(total[0])

    def device_label(self) -> str:
        """The device the step runs on as ggml names it ("Vulkan0: llvmpipe (LLVM ...)",
        "CUDA0: NVIDIA H200", "CPU: AMD EPYC ..."): which of several devices, and whether a
        Vulkan one is a GPU or Mesa's lavapipe, for a plan, a profile or a log."""
        dev = lib.ggml_backend_get_device(self.gpu if self.gpu is not None else self.cpu)
        return (f"{ffi.string(lib.ggml_backend_dev_name(dev)).decode()}: "
                f"{ffi.string(lib.ggml_backend_dev_description(dev)).decode()}")

    def compute_on_owner(self, graph, tensor) -> None:
        """Compute a small graph of views of ``tensor`` (already placed by the allocated graph)
        directly on the backend that owns its buffer, outside the scheduler (which keeps the
        allocated graph as it is)."""
        host = lib.ggml_backend_buft_is_host(lib.ggml_backend_buffer_get_type(tensor.buffer))
        backend = self.cpu if host else self.primary
        _check(lib.ggml_backend_graph_compute(backend, graph))

    def compute(self, graph) -> None:
        _check(lib.ggml_backend_sched_graph_compute(self.sched, graph))


def sched_size(graph) -> int:
    """The scheduler size a graph needs: its nodes, leafs and the copies added between
    backends.  Counted from the nodes, not the graph's capacity: the scheduler reserves
    ~60 tensor structs per unit of size (about 20 KiB), so sizing it by a training graph's
    capacity (200k at the 2B shape) asked malloc for 8 GiB; its leafs (weights, inputs) are
    covered by the constant."""
    return 2 * int(lib.ggml_graph_n_nodes(graph)) + 4096


def new_graph(ctx: Context, size: int = 8192, grads: bool = False):
    return lib.ggml_new_graph_custom(ctx.ptr, size, grads)


def new_graph_for(ctx, *outputs, size: int = 64):
    """A small graph computing ``outputs`` (forward only), in the raw context ``ctx``."""
    g = lib.ggml_new_graph_custom(ctx, size, False)
    for t in outputs:
        lib.ggml_build_forward_expand(g, t)
    return g


def grad_of(graph, t):
    """The gradient tensor of ``t`` in a backward graph, or None."""
    g = lib.ggml_graph_get_grad(graph, t)
    return None if g == ffi.NULL else g


def build_backward(ctx: Context, forward, loss, accumulators: dict | None = None,
                   loss_seed=None):
    """A graph computing ``forward`` then the gradients of the scalar ``loss`` with respect to
    every tensor marked with ``ggml_set_param``.

    Without ``accumulators`` the gradients are fresh each compute; call ``seed_backward``
    after allocating.  With ``accumulators`` (param tensor address -> static F32 tensor of
    the same shape) and a static ``loss_seed`` holding 1.0, each compute ADDS its gradients
    into the accumulators (ggml's grad_accs): gradient accumulation across micro-batches and
    across graphs of different shapes, zeroed by the caller."""
    lib.ggml_set_loss(loss)
    lib.ggml_set_output(loss)
    backward = lib.ggml_graph_dup(ctx.ptr, forward, True)
    if accumulators is None:
        lib.ggml_build_backward_expand(ctx.ptr, backward, ffi.NULL)
        acc = lib.ggml_graph_get_grad_acc(backward, loss)
        lib.ggml_set_input(acc)  # the seed d(loss)/d(loss) = 1 is written before each compute
        return backward
    n = lib.ggml_graph_n_nodes(backward)
    accs = ffi.new("struct ggml_tensor *[]", n)
    for i in range(n):
        node = lib.ggml_graph_node(backward, i)
        key = int(ffi.cast("uintptr_t", node))
        if key in accumulators:
            accs[i] = accumulators[key]
        elif node == loss:
            accs[i] = loss_seed
    lib.ggml_build_backward_expand(ctx.ptr, backward, accs)
    return backward


def address(t) -> int:
    """A tensor pointer as an int, for dict keys."""
    return int(ffi.cast("uintptr_t", t))


def is_allocated(t) -> bool:
    """False for a tensor the scheduler left out because no node of the graph reads it."""
    return t.buffer != ffi.NULL or t.data != ffi.NULL
