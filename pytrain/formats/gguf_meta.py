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

from gguf import GGUFReader, GGUFValueType

from pytrain.errors import PytrainError

GGUF_MAGIC = b"GGUF"


class GGUFError(PytrainError, ValueError):
    """A GGUF file that cannot be used; the message names the file and the reason."""


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
        reader = GGUFReader(p)
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
