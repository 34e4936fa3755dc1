"""A GGUF file written by its bytes: header, key/value fields, tensor index, aligned data.

gguf-py's ``GGUFWriter`` builds fields from Python values and holds the tensors it writes;
the merge needs neither: it copies a base model's fields byte for byte (types, order and
values untouched) and streams each tensor, in its own type, straight to the file.  So this
writer takes fields as raw bytes (``field_bytes`` copies one from a ``GGUFReader``) and
tensors as their sizes plus a callback that writes each one's bytes.  Little-endian only;
GGUF versions 2 and 3 share this layout.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Sequence

from pytrain.formats.gguf_meta import GGUFError

GGUF_MAGIC = b"GGUF"
ARRAY, STRING = 9, 8          # GGUFValueType ids


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor goes: ``shape`` in GGUF order (``ne``, fastest dimension first, as
    gguf-py's ``ReaderTensor.shape``), ``type`` a ggml type id, ``offset`` from the start of
    the data section (aligned)."""
    name: str
    shape: tuple[int, ...]
    type: int
    n_bytes: int
    offset: int


def gguf_string(s: str) -> bytes:
    """A GGUF string: uint64 byte length, then UTF-8 bytes."""
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def string_array_field(key: str, values: Sequence[str]) -> bytes:
    """One key/value field: ``key`` holding an array of strings."""
    out = gguf_string(key) + struct.pack("<IIQ", ARRAY, STRING, len(values))
    return out + b"".join(gguf_string(v) for v in values)


def field_bytes(reader, field) -> bytes:
    """The bytes of ``field`` (a ``ReaderField`` of ``reader``) as stored in its file: key,
    type and value, ready to be copied into another file."""
    nbytes = sum(int(p.nbytes) for p in field.parts)
    return bytes(reader.data[field.offset: field.offset + nbytes])


def pad(n: int, align: int) -> int:
    """Bytes of padding that bring ``n`` to a multiple of ``align``."""
    return (align - n % align) % align


def tensor_slots(tensors: Iterable[tuple[str, Sequence[int], int, int]], align: int
                 ) -> list[TensorSlot]:
    """Each ``(name, shape, type, n_bytes)`` placed in the data section, in order, each
    starting at a multiple of ``align``."""
    slots, off = [], 0
    for name, shape, typ, nb in tensors:
        off += pad(off, align)
        slots.append(TensorSlot(name, tuple(int(d) for d in shape), int(typ), int(nb), off))
        off += int(nb)
    return slots


def header(version: int, fields: Sequence[bytes], slots: Sequence[TensorSlot], align: int
           ) -> bytes:
    """Everything before the data section: magic, version, counts, the ``fields`` as given,
    the tensor index, and the padding to ``align``.  ``align`` must be what the fields say
    (``general.alignment``, 32 when absent), or a reader will look for the data elsewhere."""
    index = b"".join(
        gguf_string(s.name) + struct.pack("<I", len(s.shape))
        + struct.pack(f"<{len(s.shape)}Q", *s.shape)
        + struct.pack("<IQ", s.type, s.offset) for s in slots)
    head = (GGUF_MAGIC + struct.pack("<IQQ", version, len(slots), len(fields))
            + b"".join(fields) + index)
    return head + b"\0" * pad(len(head), align)


def write_gguf(fh: BinaryIO, head: bytes, slots: Sequence[TensorSlot],
               write_tensor: Callable[[BinaryIO, TensorSlot], None], where: str,
               error: type[Exception] = GGUFError) -> int:
    """``head`` (from ``header``), then each tensor at its offset: ``write_tensor(fh, slot)``
    must write exactly ``slot.n_bytes`` (checked; ``error`` otherwise, naming ``where``).
    ``fh`` starts empty; returns the bytes written."""
    fh.write(head)
    pos = 0
    for s in slots:
        fh.write(b"\0" * (s.offset - pos))
        write_tensor(fh, s)
        pos = s.offset + s.n_bytes
        if fh.tell() != len(head) + pos:
            raise error(f"{where}: internal error: tensor {s.name!r} wrote "
                        f"{fh.tell() - len(head) - s.offset} bytes, expected {s.n_bytes}")
    return fh.tell()
