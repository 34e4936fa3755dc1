"""Merge a LoRA adapter into its base model: one GGUF that needs no ``--lora`` any more.

For every adapted matrix ``W`` [n_out, n_in] (numpy order) the merged file holds

    W' = W + (alpha / r) · B · A          A [r, n_in], B [n_out, r], r = B.shape[1] per pair

which is what llama.cpp (``W·x + scale·B·(A·x)``) and :class:`pytrain.models.lora.LoraAdapter`
compute with the adapter loaded separately.  The one embedding case llama.cpp defines,
``token_embd.weight`` with A [n_vocab, r] and B [n_embd, r], merges as
``W' = W + (alpha / r) · A · Bᵀ`` (llama.cpp: ``B·get_rows(A, tokens)``); it is refused for
models with tied embeddings, where ``token_embd.weight`` is also the output head and the
adapter would change the head too (llama.cpp itself cannot run that combination).

What is copied.  Every key/value pair of the base is copied *byte for byte* from the base file
(types, order and values untouched, ``general.name`` and ``general.file_type`` included); one
key is added, ``pytrain.merged_adapters``: an array of strings, one JSON object per merge
(adapter name, alpha, ranks, tensor count, merged type, sha256 of the adapter tensors),
appended to when an already merged model is merged again.  llama.cpp ignores keys it does not
know, so the file loads wherever the base did.  Every tensor that is not adapted is copied byte
for byte, in the file's order; tensors are streamed from the base's memory map and adapted
ones are processed in row chunks of a few MiB, so the model is never held twice in memory.

Types.  ``merged_type`` says what the *adapted* tensors are written as:

``auto`` (default)  as ``keep``, except a quantized tensor whose requantization would erase
    the update: one whose requantization error is at least half the update (rms), the
    measure ``MergeReport.lost_updates`` warns of under ``keep`` (a LoRA update is often finer
    than a 4-bit grid: SmolLM2's Q4_1 lost it in all 120 tensors, and the merged model
    answered like the base).  Those tensors are written as F16 (F32 where F16's range is too
    small), and the report says which, why and what it costs.  The update of such a tensor
    is measured before the file is written (its header holds the types), so a quantized
    base's adapted tensors are requantized twice: once to measure, once to write.
``keep``  the base tensor's own type.  Float bases (F32, F16, BF16): dequantize to
    float32, add the update computed in float64, round once to float32, and encode back with
    ggml's converters (F32 exactly; F16/BF16 by ggml's round-to-nearest-even).  Quantized
    bases (Q8_0, Q4_K, ...): dequantize with ggml's ``to_float``, merge as above, and
    *requantize to the same type* with ``ggml_quantize_chunk`` (no importance matrix).  The
    requantization adds a second rounding of the same order as the base's own quantization
    error; the report gives, per tensor, its RMS and max next to the RMS of the LoRA update,
    so an update that drowns in quantization noise is visible.  Types whose quantizer needs an
    importance matrix (IQ2_XXS, IQ2_XS, IQ1_S) or that ggml cannot quantize are refused with a
    hint to use ``merged_type="f16"`` or ``"f32"``.
``f16`` / ``f32``  the adapted tensors in that float type (exact merge of the dequantized base
    for ``f32``); other tensors keep their types.  The file is then mixed-type, which GGUF and
    llama.cpp allow; ``general.file_type`` is left as the base's (it is informational only).
    ``f16`` refuses values beyond F16's range (65504) rather than writing Inf.

Refusals, all before anything touches the disk: an adapter made for another base (names or
shapes, via :func:`pytrain.formats.adapter_gguf.check_adapter_matches`), LoRA on a tensor llama.cpp
does not apply LoRA to as a matrix product (``ssm_conv1d.weight``), non-finite adapter
values, an output path that is the base file itself.

The file's bytes are laid out by :mod:`pytrain.formats.gguf_writer` (fields copied raw,
tensors streamed).  The write is atomic like the adapter writer's: a temporary file next to
the destination is written, flushed and fsync'ed, then renamed over the final name (and the
folder fsync'ed); a failure at any point removes the temporary file and leaves whatever was
under the final name untouched.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
from gguf import GGUFEndian

from pytrain import ggml
from pytrain.formats.adapter_gguf import AdapterError, check_adapter_matches, check_alpha, lora_pairs
from pytrain.formats.atomic import replacing
from pytrain.formats.gguf_meta import GGUFError, metadata_from_reader
from pytrain.formats.gguf_writer import (field_bytes, header, string_array_field, tensor_slots,
                                         write_gguf)
from pytrain.formats.gguf_tensors import is_elementwise, open_reader, tensor_infos, type_supported
from pytrain.ggml import ffi, lib

MERGED_TYPES = ("auto", "keep", "f16", "f32")
MERGE_KEY = "pytrain.merged_adapters"
F32, F16, BF16 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16
_FLOAT_TYPES = (F32, F16, BF16)
_FLOAT_NAMES = ("F32", "F16", "BF16")
# Types ggml_quantize_chunk has a quantizer for (its switch; anything else aborts the process).
_QUANTIZABLE_NAMES = ("q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "nvfp4",
                      "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "tq1_0", "tq2_0", "iq2_xxs",
                      "iq2_xs", "iq3_xxs", "iq3_s", "iq2_s", "iq1_s", "iq1_m", "iq4_nl",
                      "iq4_xs")
_QUANTIZABLE = frozenset(ggml.TYPES[n] for n in _QUANTIZABLE_NAMES if n in ggml.TYPES)
_CHUNK_ELEMENTS = 1 << 21       # rows per chunk: ~8 MiB of float32 (16 MiB of float64) at most
_F16_MAX = 65504.0
# requantization error (rms) at which an update counts as erased: at half of it, the merged
# tensor is as far from base + update as from the base
LOST = 0.5


class MergeError(GGUFError):
    """A merge pytrain refuses (wrong adapter, unsupported type, bad path); names the file."""


@dataclass(frozen=True)
class TensorMerge:
    """What happened to one adapted tensor.

    ``delta_rms``/``delta_max``: the LoRA update (alpha/r)·B·A.  ``round_rms``/``round_max``:
    the stored tensor (decoded back to float32) minus the exact float32 merge, i.e. the error
    of rounding back to F16/BF16 or of requantizing (0 for F32).
    """
    name: str
    shape: tuple[int, ...]
    base_type: str
    out_type: str
    rank: int
    scale: float
    delta_rms: float
    delta_max: float
    round_rms: float
    round_max: float


@dataclass
class MergeReport:
    base: str
    out: str
    merged_type: str
    alpha: float
    tensors: list[TensorMerge] = field(default_factory=list)
    n_copied: int = 0
    bytes_written: int = 0
    # ``auto``: what the tensors written in a float type instead of their base's quantized
    # type add to the file (bytes), over writing them in the base's type
    extra_bytes: int = 0

    def summary(self) -> str:
        lines = [f"merged {len(self.tensors)} tensors into {self.out} "
                 f"({self.n_copied} copied unchanged, {self.bytes_written / 2**20:.1f} MiB); "
                 f"merged type: {self.merged_type}"]
        for t in self.tensors:
            conv = t.base_type if t.base_type == t.out_type else f"{t.base_type} -> {t.out_type}"
            line = (f"  {t.name:<32} {conv:<12} r={t.rank:<3} update rms {t.delta_rms:.3g} "
                    f"max {t.delta_max:.3g}")
            if t.round_max > 0:
                what = "requantization" if t.out_type not in ("F32", "F16", "BF16") \
                    else "rounding"
                line += f"; {what} error rms {t.round_rms:.3g} max {t.round_max:.3g}"
            lines.append(line)
        lost = self.lost_updates()
        if lost:
            lines.append(
                f"warning: requantizing left an error of at least half the update (rms) in "
                f"{len(lost)} of {len(self.tensors)} tensors: the merged model may behave like "
                f"the base model; --merged-type auto (the default) writes those tensors as "
                f"F16 and keeps the update, --merged-type f16 all of them (16 bits per weight)")
        kept = self.kept_as_float()
        if kept:
            outs = sorted({t.out_type for t in kept})
            bases = sorted({t.base_type for t in kept})
            lines.append(
                f"note: {len(kept)} of {len(self.tensors)} tensors written as "
                f"{'/'.join(outs)}, not {'/'.join(bases)}: requantizing them would leave an "
                f"error of at least half their update (rms), and the merged model would behave "
                f"like the base model; as {'/'.join(outs)} the update is kept, for "
                f"{self.extra_bytes / 2**20:.1f} MiB more in the file; --merged-type keep "
                f"writes them as {'/'.join(bases)} anyway")
        return "\n".join(lines)

    def lost_updates(self) -> list[str]:
        """Requantized tensors whose rounding error is at least half their update (rms): a
        LoRA update is often finer than a 4-bit grid, so requantizing erases it."""
        return [t.name for t in self.tensors if t.out_type not in _FLOAT_NAMES
                and _lost(t.round_rms, t.delta_rms)]

    def kept_as_float(self) -> list[TensorMerge]:
        """``auto``: the quantized tensors written in a float type because requantizing them
        would have erased the update."""
        return [t for t in self.tensors if self.merged_type == "auto"
                and t.base_type not in _FLOAT_NAMES and t.out_type in _FLOAT_NAMES]


def _lost(round_rms: float, delta_rms: float) -> bool:
    return round_rms >= LOST * delta_rms > 0


# --------------------------------------------------------------------------- adapters

def _check_matches(infos, tensors: Mapping[str, np.ndarray], source: str, base) -> None:
    try:
        check_adapter_matches({n: i.shape for n, i in infos.items()}, tensors, source=source)
    except AdapterError as e:
        raise MergeError(f"{e} -- refusing to merge it into {base}") from e


def _pairs(tensors: Mapping[str, np.ndarray], source: str
           ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{base: (A, B)}`` in float64 (pairing and shape rules: adapter_gguf.lora_pairs)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for base, pair in lora_pairs(tensors, source).items():
        a, b = (np.asarray(x) for x in pair)
        for which, arr in (("lora_a", a), ("lora_b", b)):
            if not np.issubdtype(arr.dtype, np.number) or not np.isfinite(arr).all():
                raise MergeError(f"{source}: {base}.{which} holds NaN/Inf or is not "
                                 f"numeric; refusing to merge it")
        out[base] = (a.astype(np.float64), b.astype(np.float64))
    return out


def adapter_fingerprint(tensors: Mapping[str, np.ndarray], alpha: float) -> str:
    """sha256 over alpha and the float32 bytes of every tensor, by sorted name."""
    h = hashlib.sha256(struct.pack("<d", float(alpha)))
    for name in sorted(tensors):
        h.update(name.encode() + b"\0")
        h.update(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- encoding

def _encode(arr: np.ndarray, t: int, row_len: int) -> np.ndarray:
    """Bytes of ``arr`` (float32) as type ``t``, with ggml's own converters/quantizers."""
    src = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if t == F32:
        return src.view(np.uint8)
    if t == F16:
        out = np.empty(src.size, dtype=np.uint16)
        lib.ggml_fp32_to_fp16_row(ffi.cast("float *", ffi.from_buffer(src)),
                                  ffi.cast("ggml_fp16_t *", ffi.from_buffer(out)), src.size)
        return out.view(np.uint8)
    return ggml.to_bytes(src, t, row_len)     # BF16 and the quantized types


def requantize_problem(t: int) -> str | None:
    """Why pytrain cannot write type ``t`` with ``ggml_quantize_chunk`` (None: it can).
    Checked before calling ggml, which aborts the process on these."""
    if t in _FLOAT_TYPES:
        return None
    if t not in _QUANTIZABLE:
        return "ggml has no quantizer for it"
    if lib.ggml_quantize_requires_imatrix(t):
        return "its quantizer needs an importance matrix"
    return None


def _out_type(base_type: int, merged_type: str) -> int:
    return {"auto": base_type, "keep": base_type, "f16": F16, "f32": F32}[merged_type]


# --------------------------------------------------------------------------- merge

def merge_adapter(base_path: str | os.PathLike[str], adapter_tensors: Mapping[str, np.ndarray],
                  alpha: float, out_path: str | os.PathLike[str], merged_type: str = "auto",
                  adapter_name: str = "adapter", source: str | None = None) -> MergeReport:
    """Write ``base_path`` with the LoRA adapter merged in to ``out_path``; see the module
    docstring for the formula, types, metadata and refusals.

    ``adapter_tensors``: ``{"<base>.lora_a": A [r, n_in], "<base>.lora_b": B [n_out, r]}``
    (numpy order, as :func:`pytrain.formats.adapter_gguf.read_lora_gguf` returns them); ``alpha``: the
    adapter's alpha (scale alpha/r per pair).  ``adapter_name`` is recorded in the merged
    file's ``pytrain.merged_adapters`` entry; ``source`` names the adapter in error messages.
    Returns a :class:`MergeReport` (per adapted tensor: update size and rounding or
    requantization error).
    """
    base, out = Path(base_path), Path(out_path)
    source = source or adapter_name
    alpha = _check_alpha(alpha, merged_type, source)
    reader = _open_base(base, out)
    infos = tensor_infos(reader)
    _check_matches(infos, adapter_tensors, source, base)
    pairs = _pairs(adapter_tensors, source)
    plan = _plan(pairs, infos, alpha, merged_type, base, source)
    extra = _keep_updates(plan, reader, infos) if merged_type == "auto" else 0
    sha = adapter_fingerprint(adapter_tensors, alpha)
    ranks = sorted({int(b.shape[1]) for _a, b in pairs.values()})
    record = json.dumps({"adapter": adapter_name, "alpha": alpha,
                         "rank": ranks[0] if len(ranks) == 1 else ranks,
                         "tensors": len(plan), "merged_type": merged_type,
                         "sha256": sha}, separators=(",", ":"))
    head, slots = _header(reader, plan, record)
    report = MergeReport(str(base), str(out), merged_type, alpha, extra_bytes=extra)
    _write(out, reader, head, slots, plan, infos, report)
    return report


def _check_alpha(alpha, merged_type: str, source: str) -> float:
    if merged_type not in MERGED_TYPES:
        raise MergeError(f"merged_type must be one of {', '.join(MERGED_TYPES)}, got "
                         f"{merged_type!r}")
    return check_alpha(alpha, source, MergeError)


def _plan(pairs, infos, alpha: float, merged_type: str, base: Path, source: str
          ) -> dict[str, tuple[int, np.ndarray, np.ndarray, float]]:
    """Per adapted tensor: (output type, A, B, scale), after refusing what cannot merge."""
    plan: dict[str, tuple[int, np.ndarray, np.ndarray, float]] = {}
    for name, (a, b) in pairs.items():
        info = infos[name]
        if name == "token_embd.weight" and "output.weight" not in infos:   # llama.cpp's rule
            raise MergeError(f"{source}: LoRA on token_embd.weight, which in {base} is also the "
                             f"output head (tied embeddings): merging would change the head "
                             f"too, unlike the adapter")
        if name != "token_embd.weight" and is_elementwise(name, info.shape):
            raise MergeError(f"{source}: LoRA on {name!r}, which is not used as a matrix "
                             f"product (llama.cpp ignores such an adapter tensor)")
        if not type_supported(info.type):
            raise MergeError(f"{base}: tensor {name!r} has type {info.type_name}, which ggml "
                             f"cannot dequantize")
        ot = _out_type(info.type, merged_type)
        why = requantize_problem(ot)
        if why:
            raise MergeError(f"{base}: cannot requantize {name!r} to {info.type_name} ({why}); "
                             f"use merged_type 'f16' or 'f32' (--merged-type)")
        plan[name] = (ot, a, b, alpha / int(b.shape[1]))
    return plan


def _open_base(base: Path, out: Path):
    reader = open_reader(base)
    kind = metadata_from_reader(reader).get("general.type", "model")
    if kind != "model":
        raise MergeError(f"{base}: general.type is {kind!r}, not a base model (an adapter file?)")
    if reader.endianess != GGUFEndian.LITTLE:
        raise MergeError(f"{base}: big-endian GGUF files are not supported")
    if int(reader.fields["GGUF.version"].contents()) not in (2, 3):
        raise MergeError(f"{base}: GGUF version "
                         f"{reader.fields['GGUF.version'].contents()} is not supported")
    if out.exists() and os.path.samefile(out, base):
        raise MergeError(f"{out}: refusing to overwrite the base model with the merged one; "
                         f"choose another output path")
    return reader


def _header(reader, plan, record: str) -> tuple[bytes, list]:
    """The merged file's header (key/values copied raw, plus the merge record) and its tensor
    layout (``gguf_writer.TensorSlot`` per tensor, in the base's order)."""
    fields: list[bytes] = []
    previous: list[str] = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == MERGE_KEY:
            prev = f.contents()
            previous = [str(v) for v in (prev if isinstance(prev, list) else [prev])]
            continue
        fields.append(field_bytes(reader, f))
    fields.append(string_array_field(MERGE_KEY, previous + [record]))
    sizes = []
    for t in reader.tensors:
        ot = plan[t.name][0] if t.name in plan else int(t.tensor_type)
        ne = [int(d) for d in t.shape]
        n_rows = int(np.prod(ne[1:], dtype=np.int64))
        nb = int(t.n_bytes) if ot == int(t.tensor_type) else \
            int(lib.ggml_row_size(ot, ne[0])) * n_rows
        sizes.append((t.name, ne, ot, nb))
    align = int(reader.alignment)
    slots = tensor_slots(sizes, align)
    version = int(reader.fields["GGUF.version"].contents())   # 2 and 3 share this layout
    return header(version, fields, slots, align), slots


def _write(out: Path, reader, head: bytes, slots, plan, infos, report: MergeReport) -> None:
    """Header, then every tensor: merged ones streamed, the rest copied byte for byte."""
    data = reader.data
    tensors = {t.name: t for t in reader.tensors}

    def write_tensor(fh, slot) -> None:
        t = tensors[slot.name]
        if t.name in plan:
            report.tensors.append(_write_merged(fh, data, t, infos[t.name], *plan[t.name]))
        else:
            fh.write(data[t.data_offset: t.data_offset + t.n_bytes])
            report.n_copied += 1

    with replacing(out) as tmp, open(tmp, "wb") as fh:
        report.bytes_written = write_gguf(fh, head, slots, write_tensor, str(out), MergeError)


def _merged_chunks(data, t, info, a: np.ndarray, b: np.ndarray, scale: float):
    """(merged float32 rows, their float64 update) of W + scale·B·A (or the embedding form),
    in row chunks, from the base tensor ``t``'s bytes."""
    n_rows, row_len = info.shape            # numpy [n_out, n_in] (embeddings: [n_vocab, n_embd])
    raw = data[t.data_offset: t.data_offset + t.n_bytes]          # uint8 view of the memmap
    src_row = int(lib.ggml_row_size(info.type, row_len))
    embd = info.name == "token_embd.weight"
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // row_len)
    for r0 in range(0, n_rows, rows_per_chunk):
        r1 = min(n_rows, r0 + rows_per_chunk)
        w = ggml.decode(raw[r0 * src_row: r1 * src_row], info.type, (r1 - r0) * row_len)
        w = w.reshape(r1 - r0, row_len)
        delta = scale * (a[r0:r1] @ b.T if embd else b[r0:r1] @ a)       # float64
        merged = (w.astype(np.float64) + delta).astype(np.float32)
        if not np.isfinite(merged).all():
            raise MergeError(f"{info.name}: merged values overflow float32")
        yield merged, delta


def _keep_updates(plan, reader, infos) -> int:
    """``auto``: each quantized tensor of ``plan`` whose requantization would erase its
    update is planned as F16 instead (F32 beyond F16's range); returns what that adds to the
    file, in bytes."""
    tensors = {t.name: t for t in reader.tensors}
    extra = 0
    for name, (ot, a, b, scale) in plan.items():
        info = infos[name]
        if ot in _FLOAT_TYPES:
            continue
        d_sq = r_sq = big = 0.0
        for merged, delta in _merged_chunks(reader.data, tensors[name], info, a, b, scale):
            back = ggml.decode(_encode(merged, ot, info.shape[1]), ot, merged.size)
            r_sq += float(np.square(back.reshape(merged.shape).astype(np.float64)
                                    - merged).sum())
            d_sq += float(np.square(delta).sum())
            big = max(big, float(np.abs(merged).max()))
        if _lost(math.sqrt(r_sq), math.sqrt(d_sq)):
            to = F16 if big <= _F16_MAX else F32
            plan[name] = (to, a, b, scale)
            rows = info.n_elements // info.shape[1]
            extra += int(lib.ggml_row_size(to, info.shape[1])) * rows - info.n_bytes
    return extra


def _write_merged(fh, data, t, info, ot: int, a: np.ndarray, b: np.ndarray, scale: float
                  ) -> TensorMerge:
    """Stream W + scale·B·A (or the embedding form) to ``fh`` in row chunks."""
    row_len = info.shape[1]
    d_sq = d_max = r_sq = r_max = 0.0
    for merged, delta in _merged_chunks(data, t, info, a, b, scale):
        if ot == F16 and float(np.abs(merged).max()) > _F16_MAX:
            raise MergeError(f"{info.name}: merged values beyond F16's range ({_F16_MAX}); use "
                             f"merged_type 'f32'")
        enc = _encode(merged, ot, row_len)
        if ot != F32:
            back = ggml.decode(enc, ot, merged.size).reshape(merged.shape)
            err = np.abs(back.astype(np.float64) - merged)
            r_sq += float(np.square(err).sum())
            r_max = max(r_max, float(err.max()))
        d_sq += float(np.square(delta).sum())
        d_max = max(d_max, float(np.abs(delta).max()))
        fh.write(enc)
    n = info.n_elements
    return TensorMerge(info.name, tuple(info.shape), info.type_name, ggml.type_name(ot),
                       int(b.shape[1]), float(scale), math.sqrt(d_sq / n), d_max,
                       math.sqrt(r_sq / n), r_max)
