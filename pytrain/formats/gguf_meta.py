"""GGUF metadata as plain Python values, with errors that name the file.

``gguf.GGUFReader`` fails on bad input with bare numpy errors ("When changing to a larger
dtype...", "index 0 is out of bounds") that say nothing about which file or what is wrong.
Every caller that opens a user-supplied GGUF goes through :func:`open_gguf` so a wrong path,
a non-GGUF file or a half-downloaded model gives one actionable message instead.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from pytrain.errors import PytrainError

GGUF_MAGIC = b"GGUF"


class GGUFError(PytrainError, ValueError):
    """A GGUF file that cannot be used; the message names the file and the reason."""


class Reader(GGUFReader):
    """``GGUFReader`` with its arrays parsed from a plain ndarray view of the file.

    gguf-py builds every element of a metadata array as a slice of its ``np.memmap``, and a
    memmap slice costs microseconds (``__array_finalize__``): a 262144-token vocabulary
    (Gemma 3) took 13 s to open, Qwen3.5's 248320 tokens as long, at every ``train``,
    ``generate`` and ``inspect``.  The fields built here are the same (one part per element,
    the same ``data`` indices and types, so ``contents()`` and byte-exact copies of a field
    behave identically: tests/test_gguf_meta.py), as views of one ndarray over the same
    mapping, in a tenth of a second."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self.data.view(np.ndarray)        # the same uint8 bytes, without memmap's cost
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        if len(itype) < 1 or len(alen) < 1:
            raise ValueError(f"array header at byte {orig_offs} runs past the end of the file")
        sub, n, offs = GGUFValueType(int(itype[0])), int(alen[0]), orig_offs + 12
        parts: list[np.ndarray] = [itype, alen]
        if sub == GGUFValueType.STRING:           # each: a uint64 length, then the bytes
            u64 = np.dtype("<u8")
            for _ in range(n):
                if offs + 8 > len(plain):
                    raise ValueError(f"string array at byte {orig_offs} runs past the end of "
                                     f"the file")
                head = plain[offs:offs + 8].view(u64)
                end = offs + 8 + int(head[0])
                if end > len(plain):
                    raise ValueError(f"string at byte {offs} runs past the end of the file")
                parts += (head, plain[offs + 8:end])
                offs = end
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), \
                [GGUFValueType.ARRAY, sub]
        dtype = self.gguf_scalar_to_np.get(sub)
        if dtype is None:                         # arrays of arrays: gguf-py's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        size = np.dtype(dtype).itemsize
        if offs + n * size > len(plain):
            raise ValueError(f"array at byte {orig_offs} runs past the end of the file")
        values = plain[offs:offs + n * size].view(dtype)
        parts += (values[i:i + 1] for i in range(n))
        return 12 + n * size, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, sub]


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open ``path`` with ``GGUFReader``, turning its low-level failures into :class:`GGUFError`.

    The magic is checked here first because the reader's own check crashes on files shorter
    than four bytes. Tensor extents are checked against the file size because a file cut
    inside the tensor data otherwise parses "fine" until the data is touched.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(4)
        size = p.stat().st_size
    except OSError as e:
        raise GGUFError(f"{p}: cannot read GGUF file: {e.strerror or e}") from e
    if head != GGUF_MAGIC:
        if len(head) < 4 and GGUF_MAGIC.startswith(head) and head:
            raise GGUFError(f"{p}: truncated GGUF file ({size} bytes)")
        raise GGUFError(f"{p}: not a GGUF file (magic {head!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = Reader(p)
    except OSError as e:
        raise GGUFError(f"{p}: cannot read GGUF file: {e.strerror or e}") from e
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise GGUFError(f"{p}: truncated or corrupt GGUF file ({size} bytes): {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{p}: truncated GGUF file: tensor {t.name!r} ends at byte "
                            f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def metadata_from_reader(reader: GGUFReader) -> dict[str, Any]:
    """Key/value metadata as Python scalars, ``str`` and lists.

    The reader's pseudo-fields (``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``) are
    dropped: they describe the container, not the model, and llama.cpp does not expose them
    as keys either.
    """
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = field.contents()
        except UnicodeDecodeError as e:
            raise GGUFError(f"{reader.data.filename}: key {name!r} holds a string that is not "
                            f"UTF-8: {e}") from e
        if field.types and field.types[0] == GGUFValueType.ARRAY and meta[name] is None:
            meta[name] = []
    return meta


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of the GGUF at ``path`` (see :func:`metadata_from_reader`)."""
    return metadata_from_reader(open_gguf(path))
