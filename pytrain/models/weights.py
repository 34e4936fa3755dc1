"""Frozen base weights: GGUF tensors streamed into one ggml backend buffer.

Bytes go from the file's memory map straight into the backend tensor
(``ggml_backend_tensor_set``), so a model is never held twice in Python memory; only a tensor
whose type must change passes through a temporary, and then in row chunks of a few MiB.

Type policy.  Every frozen weight ends up as ``src0`` of some op in the training graph, and
the backward of ``MUL_MAT`` runs ``OUT_PROD`` with the weight as ``src0``.  ggml's CPU
``OUT_PROD`` takes F32, F16 and the quantized types but not BF16; the pinned CUDA one takes
F32 only, and pytrain's patch 0003 lets it take any type ggml-cuda dequantizes (rows
dequantized in slabs, then a GEMM).  The tensors used element-wise (norms, biases, ``ssm_a``,
the depthwise conv kernel) feed ``MUL``/``ADD``, which want F32 everywhere.  Hence
``type_policy``:

``auto``   CPU: matrices keep F32/F16/quantized; BF16 becomes F16 (same size).  BF16 has 8
           mantissa bits and F16 11, so every BF16 value in F16's normal range (6.1e-5 to
           65504 in magnitude) converts exactly; smaller ones become F16 subnormals and lose
           bits, below ~6e-8 they become 0 (each tensor's report counts such values).  A
           tensor holding values beyond 65504 is loaded as F32 instead (twice the size).
           CUDA: matrices keep the file's type when ggml-cuda has MUL_MAT, GET_ROWS and a
           dequantizer for it (F16, BF16, Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K); any other type
           becomes F32.  Element-wise tensors: F32 on both.
``f32``    everything F32 (reference runs; 4 bytes per weight).
``bf16``   CPU training at bf16 precision (``train.compute_type = "bf16"``): F32, F16 and BF16
           matrices become BF16 (F32 and F16 rounded to nearest even, as torch's
           ``.to(torch.bfloat16)`` rounds them), which ggml-blas multiplies with oneDNN's bf16
           matmul, forward and backward (patch 0018); a quantized matrix keeps its type unless
           ``dequantize`` maps its type to BF16 (the training run's measured choice,
           ``pytrain.run.type_choice``: dequantized, then rounded to BF16); the element-wise
           tensors load as F32.
``keep``   the file's types untouched: inference only, training graphs may not run.

``dequantize`` (a file type -> F32 or F16; BF16 under ``bf16``) refines ``auto`` (``bf16``)
for the matrices of those types:
a training run passes the types its measurements found faster as F32 on its device
(``pytrain.run.type_choice``); the values are the file's, so the function is the same (F16
rounds them, and says how many it could not keep).

Extra tensors in the file (MTP/nextn blocks, blocks past the trunk) are not loaded.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
from gguf import GGUFReader

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.formats.gguf_tensors import (TensorInfo, WeightsError, is_elementwise, open_reader,
                                          tensor_infos, type_supported)

POLICIES = ("auto", "f32", "keep", "bf16")
F32, F16, BF16 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16
_CHUNK_ELEMENTS = 1 << 22      # conversion temporaries: at most ~16 MiB of float32 at a time
_F16_MAX = 65504.0
# matrix types a GPU run keeps (MUL_MAT, GET_ROWS and OUT_PROD take them: patch 0003 on CUDA,
# 0011 on Vulkan)
_DEVICE_KEPT = {F32, F16, BF16} | {getattr(lib, f"GGML_TYPE_{n}") for n in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}


@dataclass(frozen=True)
class TensorLoad:
    """How one tensor was loaded: the file's type, the type in memory, and the byte cost."""
    name: str
    shape: tuple[int, ...]
    file_type: str
    loaded_type: str
    file_bytes: int
    loaded_bytes: int
    note: str = ""
    n_inexact: int = 0      # values a conversion could not represent exactly


@dataclass
class Weights:
    """The loaded tensors; ``close()`` frees their buffer (``Runtime.close`` also does)."""
    path: str
    runtime: object
    ctx: ggml.Context
    buffer: object
    tensors: dict[str, object]
    report: dict[str, TensorLoad]
    ignored: list[str] = field(default_factory=list)

    @property
    def file_bytes(self) -> int:
        return sum(r.file_bytes for r in self.report.values())

    @property
    def loaded_bytes(self) -> int:
        return sum(r.loaded_bytes for r in self.report.values())

    @property
    def total_bytes(self) -> int:
        """The backend buffer's size: loaded bytes plus alignment padding."""
        return int(lib.ggml_backend_buffer_get_size(self.buffer)) if self.buffer else 0

    def __getitem__(self, name: str):
        return self.tensors[name]

    def summary(self) -> str:
        """Counts and bytes per (file type -> loaded type), for logs."""
        groups: dict[tuple[str, str], list[TensorLoad]] = {}
        for r in self.report.values():
            groups.setdefault((r.file_type, r.loaded_type), []).append(r)
        lines = [f"{len(self.report)} tensors from {self.path}: {_mib(self.file_bytes)} as stored, "
                 f"{_mib(self.loaded_bytes)} loaded"]
        for (ft, lt), rs in sorted(groups.items()):
            arrow = ft if ft == lt else f"{ft} -> {lt}"
            lines.append(f"  {arrow:<14} {len(rs):5d} tensors  {_mib(sum(r.file_bytes for r in rs))}"
                         f" -> {_mib(sum(r.loaded_bytes for r in rs))}")
        conv = [r for r in self.report.values() if r.file_type != r.loaded_type]
        n_inexact = sum(r.n_inexact for r in conv)
        if n_inexact:
            n_conv = sum(int(np.prod(r.shape, dtype=np.int64)) for r in conv)
            lines.append(f"  {n_inexact} of {n_conv} converted values not exact (F16 keeps "
                         f"full precision only for magnitudes >= 6.1e-5)")
        notes = [r for r in self.report.values() if r.note]
        for r in notes[:8]:
            lines.append(f"  note: {r.name}: {r.note}")
        if len(notes) > 8:
            lines.append(f"  note: ... {len(notes) - 8} more")
        if self.ignored:
            lines.append(f"  {len(self.ignored)} tensors in the file not loaded (MTP/extra)")
        return "\n".join(lines)

    def close(self) -> None:
        if self.buffer is not None:
            try:
                self.runtime.free(self.buffer)
            except ValueError:   # the runtime was closed first and freed it already
                pass
            self.buffer = None
        self.ctx.close()
        self.tensors = {}

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------- type policy

def load_type(name: str, shape: tuple[int, ...], file_type: int, device: str,
              policy: str = "auto", dequantize: Mapping[int, int] | None = None) -> int:
    """The ggml type a tensor is loaded as (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"type_policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "keep":
        return file_type
    if policy == "f32" or is_elementwise(name, shape):
        return F32
    if policy == "bf16" and file_type in (F32, F16, BF16):
        return BF16
    if dequantize and file_type in dequantize:
        return dequantize[file_type]
    if device != "cpu":
        return file_type if file_type in _DEVICE_KEPT else F32
    return F16 if file_type == BF16 else file_type


def dequantize_targets(policy: str) -> set[int]:
    """The types ``dequantize`` may map a file type to under ``policy``: BF16 under ``bf16``
    (its matrices are multiplied by oneDNN's bf16 matmul; an F32 copy would leave BLAS's
    sgemm the product, the f32 path), F32 or F16 otherwise (ggml-cpu's OUT_PROD takes no
    BF16)."""
    return {BF16} if policy == "bf16" else {F32, F16}


def _squeeze_leading(shape: tuple[int, ...]) -> tuple[int, ...]:
    s = list(shape)
    while len(s) > 1 and s[0] == 1:
        s.pop(0)
    return tuple(s)


# --------------------------------------------------------------------------- loading

def load_weights(path: str | os.PathLike[str], runtime, shapes: Mapping[str, tuple[int, ...]],
                 type_policy: str = "auto", policy_device: str | None = None,
                 reader: GGUFReader | None = None,
                 dequantize: Mapping[int, int] | None = None) -> Weights:
    """Load the tensors named in ``shapes`` (numpy-order shapes, e.g. from
    ``Qwen35Config.tensor_shapes()``) into one buffer of ``runtime``'s primary backend.

    ``runtime`` needs ``device`` ("cpu"/"cuda", chooses the policy) and ``alloc(ctx)``;
    ``policy_device`` loads the types another device would get (so a CPU machine can build and
    check the graph a GPU would run); ``dequantize`` (file type -> F32/F16) refines ``auto``.
    Every error names the file and the tensor: missing tensors, shape mismatches, types ggml
    cannot dequantize, data cut short.
    """
    if type_policy not in POLICIES:
        raise ValueError(f"type_policy must be one of {', '.join(POLICIES)}; got {type_policy!r}")
    targets = dequantize_targets(type_policy)
    if dequantize and set(dequantize.values()) - targets:
        raise ValueError(f"dequantize: under type_policy {type_policy!r} types may become "
                         f"{' or '.join(sorted(ggml.type_name(t) for t in targets))} only; got "
                         f"{dict(dequantize)}")
    p = Path(path)
    reader = reader or open_reader(p)      # a reader of this file already open: reused
    infos = tensor_infos(reader)
    device = policy_device or getattr(runtime, "device", "cpu")

    missing = [n for n in shapes if n not in infos]
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10
                                           else "")
        raise WeightsError(f"{p}: missing tensor{'s' if len(missing) > 1 else ''}: {shown}")
    plan: list[tuple[TensorInfo, int, np.ndarray, str]] = []
    for n, want in shapes.items():
        info = infos[n]
        if _squeeze_leading(tuple(want)) != _squeeze_leading(info.shape):
            raise WeightsError(
                f"{p}: tensor {n!r} has shape {info.shape} in the file (numpy order; GGUF ne "
                f"{list(info.ne)}), expected {tuple(want)}")
        if not type_supported(info.type):
            raise WeightsError(f"{p}: tensor {n!r} has type {info.type_name}, which ggml cannot "
                               f"dequantize; pytrain cannot load it")
        raw = reader.data[info.offset: info.offset + info.n_bytes]
        if raw.nbytes != info.n_bytes:
            raise WeightsError(f"{p}: truncated GGUF file: tensor {n!r} has {raw.nbytes} of its "
                               f"{info.n_bytes} bytes")
        # the expected shape decides matrix vs vector: a [1, n] matrix is still a matrix
        lt = load_type(n, tuple(want), info.type, device, type_policy, dequantize)
        note = ""
        if info.type == BF16 and lt == F16 and _bf16_overflows_f16(raw):
            lt, note = F32, "BF16 values beyond F16's range (65504): loaded as F32"
        plan.append((info, lt, raw, note))

    ctx = ggml.Context(n_tensors=len(plan))
    tensors: dict[str, object] = {}
    for info, lt, _raw, _note in plan:
        want_ne = list(reversed(shapes[info.name]))
        t = lib.ggml_new_tensor(ctx.ptr, lt, len(want_ne), ffi.new("int64_t[]", want_ne))
        ggml.set_name(t, info.name)
        tensors[info.name] = t
    _refuse_oversized(p, runtime, tensors)
    buf = runtime.alloc(ctx)
    lib.ggml_backend_buffer_set_usage(buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
    weights = Weights(str(p), runtime, ctx, buf, tensors, {},
                      ignored=[n for n in infos if n not in shapes])
    try:
        for info, lt, raw, note in plan:
            t = tensors[info.name]
            n_inexact = _fill(t, info, lt, raw)
            _release(reader, info.offset, info.n_bytes)
            weights.report[info.name] = TensorLoad(
                info.name, info.shape, info.type_name, ggml.type_name(lt), info.n_bytes,
                int(lib.ggml_nbytes(t)), note, n_inexact)
    except BaseException:
        weights.close()
        raise
    return weights


def _release(reader: GGUFReader, start: int, length: int) -> None:
    """Take a copied tensor's file pages out of this process's resident set (MADV_DONTNEED on
    the read-only map: the pages stay in the page cache, and one read again faults back in
    from it).  Without this, loading left the whole file resident beside its copy in the
    backend buffer: at the Qwen3.5-2B shape the peak RSS of loading was 7.3 GiB for 3.5 GiB
    of weights."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or getattr(reader.data, "offset", 0) != 0:
        return
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(start + length, len(mm))
    if end > first:
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def _refuse_oversized(path: Path, runtime, tensors: Mapping[str, object]) -> None:
    """A weight larger than the device takes in one tensor (ggml-vulkan: its buffer size or
    storage-buffer range; 128 MiB on lavapipe) is refused here, by name: the scheduler would
    abort the process when a graph reads it (the node cannot run on the device, and the
    weight cannot move to the CPU)."""
    gpu = getattr(runtime, "gpu", None)
    if gpu is None:
        return
    big = [(n, int(lib.ggml_nbytes(t))) for n, t in tensors.items()
           if not lib.ggml_backend_supports_op(gpu, t)]
    if big:
        n, size = max(big, key=lambda x: x[1])
        raise WeightsError(
            f"{path}: tensor {n!r} ({_mib(size)} as loaded) is larger than "
            f"{runtime.device_label()} takes in "
            f"one tensor ({len(big)} such weight{'s' if len(big) > 1 else ''}); load the "
            f"model in a smaller type (a Q8_0 or Q4_K GGUF) or train on a device with larger "
            f"buffers")


def _bf16_overflows_f16(raw: np.ndarray) -> bool:
    """Any finite BF16 value of magnitude >= 65536 (F16 would make it inf)?  Every smaller
    BF16 value rounds to at most 65504."""
    bits = raw.view(np.uint16)
    for i in range(0, bits.size, _CHUNK_ELEMENTS):
        mag = bits[i: i + _CHUNK_ELEMENTS] & 0x7FFF
        if np.any((mag >= 0x4780) & (mag < 0x7F80)):
            return True
    return False


def _fill(t, info: TensorInfo, lt: int, raw: np.ndarray) -> int:
    """Write the file bytes ``raw`` into ``t``, converting in row chunks when the type
    changes; returns how many values the conversion could not keep exactly."""
    if lt == info.type:
        if lib.ggml_nbytes(t) != raw.nbytes:
            raise WeightsError(f"tensor {info.name!r}: {raw.nbytes} bytes in the file, "
                               f"{lib.ggml_nbytes(t)} in ggml")
        lib.ggml_backend_tensor_set(t, ffi.from_buffer(raw), 0, raw.nbytes)
        return 0
    if lt not in (F32, F16, BF16):
        raise WeightsError(f"tensor {info.name!r}: no conversion {info.type_name} -> "
                           f"{ggml.type_name(lt)}")
    row_len = info.ne[0]
    n_rows = info.n_elements // row_len
    src_row = int(lib.ggml_row_size(info.type, row_len))
    dst_row = int(lib.ggml_row_size(lt, row_len))
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row_len)
    inexact = 0
    for r0 in range(0, n_rows, rows_per_chunk):
        nr = min(rows_per_chunk, n_rows - r0)
        f32 = ggml.decode(raw[r0 * src_row: (r0 + nr) * src_row], info.type, nr * row_len)
        if lt == F16:
            out = f32.astype(np.float16)
            back = out.astype(np.float32)
        elif lt == BF16:          # ggml's round to nearest even
            out = ggml.to_bytes(f32, BF16, row_len)
            back = ggml.decode(out, BF16, nr * row_len)
        else:
            out = back = f32
        inexact += int(np.count_nonzero((back != f32) & ~(np.isnan(back) & np.isnan(f32))))
        lib.ggml_backend_tensor_set(t, ffi.from_buffer(out), r0 * dst_row, out.nbytes)
    return inexact


