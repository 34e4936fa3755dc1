"""The devices this build and machine offer: ggml's device list, the CPU's features and
extra buffer types, the BLAS backend, and the lookup of a CUDA, Vulkan or RPC device by the
name a config gives (``device = "cuda"``).

Kept apart from the runtime because ``pytrain doctor`` and a plan ask these questions
without making one.  ggml-vulkan is registered only when asked for (``load_vulkan``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pytrain.errors import PytrainError
from pytrain.ggml.loader import LIB_DIR, ffi, lib


class DeviceError(PytrainError, ValueError):
    """A device that is not there or not known."""


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
    """Every device ggml's registry lists, in its order, with its memory now."""
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

