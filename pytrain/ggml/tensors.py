"""Tensors between numpy and ggml: the contexts they are made in, their names and shapes, and
copies in and out of backend buffers.

ggml's ``ne`` order is the reverse of numpy's shape, and quantized, F16 and BF16 data goes
through ggml's own converters, so a round trip here gives back what ggml computes with.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from pytrain.ggml.loader import ffi, lib

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


# Native objects made through pytrain.ggml and not freed yet, by kind (contexts here, the
# runtime's buffers and kept-graph allocators in runtime.py).  Why: a path that raises
# half-way through building a graph, or a close that forgets a part, leaks native memory (a
# backend buffer lives until its runtime closes, on a GPU for the whole run) that Python's
# garbage collector never sees; tests compare ``live_objects()`` before and after.
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
        that tensor).  Kept until the context grows: listing them from Python at every
        allocation of a graph was slow."""
        # measured: a step graph's ~30k tensors took ~50 ms to list and filter from Python
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


def address(t) -> int:
    """A tensor pointer as an int, for dict keys."""
    return int(ffi.cast("uintptr_t", t))


def is_allocated(t) -> bool:
    """False for a tensor the scheduler left out because no node of the graph reads it."""
    return t.buffer != ffi.NULL or t.data != ffi.NULL
