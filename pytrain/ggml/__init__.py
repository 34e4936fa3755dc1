"""A thin layer over the cffi bindings of the pinned ggml.

Model code calls ggml functions by their ggml names on ``lib`` (``lib.ggml_mul_mat(...)``);
this package only adds what Python needs around them, one job per module:

* ``loader``: loads the native library and registers its backend modules (the ggml-cpu
  variant for this CPU, CUDA's libraries first, OpenMP's wait policy, ggml's log filter);
* ``tensors``: contexts that free themselves and numpy round trips (ggml's ``ne`` order is
  the reverse of numpy's shape);
* ``backends``: what this build and machine offer (CPU features, BLAS, CUDA, Vulkan, RPC);
* ``runtime``: ``Runtime``, the backends and the ``ggml_backend_sched`` scheduler a run
  computes with, with a check for ops a GPU backend hands to the CPU;
* ``graph``: building forward and backward graphs.

Everything is used through this package (``from pytrain import ggml``; ``ggml.to_numpy``),
so a test that patches ``ggml.from_numpy`` patches what callers look up.  Importing it loads
the native library: ``import pytrain`` does not.
"""
from pytrain.ggml.loader import (CPU_VARIANT, CUDA_LIBRARIES, LIB_DIR, NATIVE_DIR, CpuVariant,
                                 CpuVariantError, build_info, choose_cpu_variant,
                                 cpu_variant_scores, cuda_library_dirs, ffi, lib)
from pytrain.ggml.tensors import (TYPES, Context, address, decode, from_numpy, is_allocated,
                                  live_objects, name, set_name, shape, to_bytes, to_numpy,
                                  type_name)
from pytrain.ggml.backends import (DEVICES, VULKAN_MODULE, Device, DeviceError, backend_name,
                                   bf16_kernel, blas_enabled, buffer_type_name, cpu_features,
                                   devices, extra_buffer_types, is_lavapipe,
                                   lavapipe_installed, load_vulkan, vulkan_built)
from pytrain.ggml.graph import (build_backward, grad_of, new_graph, new_graph_for, op_name,
                                sched_size)
from pytrain.ggml.runtime import (CPUFallbackError, OutOfMemoryError, Runtime, SettingError,
                                  abort_requested, default_threads, forced_threads,
                                  request_abort)

__all__ = [
    # loader
    "CPU_VARIANT", "CUDA_LIBRARIES", "LIB_DIR", "NATIVE_DIR", "CpuVariant", "CpuVariantError",
    "build_info", "choose_cpu_variant", "cpu_variant_scores", "cuda_library_dirs", "ffi", "lib",
    # tensors
    "TYPES", "Context", "address", "decode", "from_numpy", "is_allocated", "live_objects",
    "name", "set_name", "shape", "to_bytes", "to_numpy", "type_name",
    # backends
    "DEVICES", "VULKAN_MODULE", "Device", "DeviceError", "backend_name", "bf16_kernel",
    "blas_enabled", "buffer_type_name", "cpu_features", "devices", "extra_buffer_types",
    "is_lavapipe", "lavapipe_installed", "load_vulkan", "vulkan_built",
    # graph
    "build_backward", "grad_of", "new_graph", "new_graph_for", "op_name", "sched_size",
    # runtime
    "CPUFallbackError", "OutOfMemoryError", "Runtime", "SettingError", "abort_requested",
    "default_threads", "forced_threads", "request_abort",
]
