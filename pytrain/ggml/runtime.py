"""``Runtime``: the backends a run computes on, the scheduler that splits graphs between them,
and the buffers that hold weights, adapters, optimizer state and graphs.

Why one object: every buffer must be freed before its backend, and a graph must be allocated
by the scheduler that computes it, so the runtime owns them together and ``close`` frees
them in order.  Also here: thread counts, and the abort flag a second Ctrl-C sets.
"""
from __future__ import annotations

import os

from pytrain.errors import PytrainError
from pytrain.ggml.backends import (DEVICES, DeviceError, _blas_device, _cuda_device,
                                   _rpc_backend, _vulkan_device, backend_name,
                                   buffer_type_name)
from pytrain.ggml.graph import op_name, sched_size
from pytrain.ggml.loader import ffi, lib
from pytrain.ggml.tensors import _LIVE, Context, address


class OutOfMemoryError(PytrainError, MemoryError):
    """A buffer the device could not give: the run needs more memory than it has."""


class SettingError(PytrainError, ValueError):
    """An environment variable pytrain reads holds a value it cannot use."""


class CPUFallbackError(PytrainError, RuntimeError):
    """A GPU run would execute some ops on the CPU, copying their inputs every step."""


def forced_threads() -> int | None:
    """``PYTRAIN_THREADS``: the thread count every runtime uses (None: unset)."""
    raw = os.environ.get("PYTRAIN_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise SettingError(f"PYTRAIN_THREADS={raw!r}: expected a whole number of threads >= 1 "
                           f"(or unset it)")
    return int(raw)


def default_threads() -> int:
    """The CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))


def _set_threads(backend, threads: int) -> None:
    """A backend's thread count, through its module's registry entry (the CPU and BLAS
    backends are modules loaded at run time: their functions are not linked)."""
    reg = lib.ggml_backend_dev_backend_reg(lib.ggml_backend_get_device(backend))
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
    if fn != ffi.NULL:
        ffi.cast("ggml_backend_set_n_threads_t", fn)(backend, threads)


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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


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
        what ggml-opt does by duplicating its static graphs before each allocation."""
        if self._current == address(graph):
            return
        # which tensors to clear is decided by ownership (ctx's compute tensors), never by
        # comparing a tensor's buffer pointer with the live buffers: a freed compute buffer's
        # address can come back as a new weight or seed buffer (malloc reuses it), and such a
        # stale tensor then looked static, kept its dangling data pointer and crashed, or
        # wrote into freed memory
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
        backend): checked in O(1), since layer-wise recompute allocates its graphs at every
        step."""
        if self.gpu is None:
            return []
        # the O(1) case first: walking a step graph's ~30k nodes from Python took tens of ms
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
        there, so pytrain.step.free_memory also asks the container's cgroup)."""
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
