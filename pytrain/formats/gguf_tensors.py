"""A GGUF's tensor index: names, types, shapes in numpy order, and where the bytes are.

Reading only (no ggml backend, no model): the model loader, the merge writer and the
checkpoint reader all start here, so a truncated file or a type ggml cannot convert is refused
with the same message naming the tensor, whoever opened it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from pytrain import ggml
from pytrain.formats.gguf_meta import GGUFError, Reader, open_gguf
from pytrain.ggml import ffi, lib

F32 = lib.GGML_TYPE_F32
# Element-wise consumers need F32 whatever their rank; matched as name suffixes.
_ELEMENTWISE_SUFFIXES = ("ssm_conv1d.weight",)


class WeightsError(GGUFError):
    """A model file whose tensors cannot be loaded; names the file and the tensor."""


def type_supported(t: int) -> bool:
    """Types ggml can turn into floats: F32 itself, or any type with a ``to_float``."""
    if t < 0 or t >= lib.GGML_TYPE_COUNT or lib.ggml_blck_size(t) <= 0:
        return False
    return t == F32 or lib.ggml_get_type_traits(t).to_float != ffi.NULL


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a GGUF tensor index, with the shape in numpy order ([out, in])."""
    name: str
    type: int
    shape: tuple[int, ...]
    n_bytes: int
    offset: int

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def type_name(self) -> str:
        return ggml.type_name(self.type)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _IndexOnlyReader(Reader):
    """Parses the header and tensor index but builds no data views, so it survives the files
    ``GGUFReader`` refuses with anonymous numpy errors: a data section cut short or a type id
    gguf-py does not know.  Used only to explain such failures by tensor name."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # noqa: D401
        self.index = []
        for f in fields:
            _nlen, name_data, _ndims, dims, raw_dtype, offset_tensor = f.parts
            self.index.append((bytes(name_data).decode("utf-8", "replace"), int(raw_dtype[0]),
                               [int(d) for d in dims], int(start_offs + offset_tensor[0])))
        self.tensors = []


def _explain_failure(path: Path) -> str | None:
    """Why ``GGUFReader`` failed on a file with a readable index, naming the tensor."""
    try:
        idx = _IndexOnlyReader(path).index
    except Exception:
        return None
    size = path.stat().st_size
    for name, t, ne, off in idx:
        if not type_supported(t):
            known = t < lib.GGML_TYPE_COUNT and lib.ggml_blck_size(t) > 0
            what = f"type {ggml.type_name(t)} (id {t})" if known else f"unknown type id {t}"
            return f"tensor {name!r} has {what}, which pytrain cannot load"
        nbytes = int(lib.ggml_row_size(t, ne[0])) * int(np.prod(ne[1:], dtype=np.int64))
        if off + nbytes > size:
            return (f"truncated GGUF file: tensor {name!r} needs bytes {off}..{off + nbytes} "
                    f"but the file has {size} bytes")
    return None


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """``open_gguf`` with its generic "truncated or corrupt" failures traced to a tensor."""
    p = Path(path)
    try:
        return open_gguf(p)
    except GGUFError as e:
        why = _explain_failure(p) if p.is_file() else None
        if why:
            raise WeightsError(f"{p}: {why}") from e
        raise


def tensor_infos(reader: GGUFReader) -> dict[str, TensorInfo]:
    """The tensor index in file order; shapes converted from ggml ``ne`` to numpy order."""
    out: dict[str, TensorInfo] = {}
    for t in reader.tensors:
        ne = [int(d) for d in t.shape]
        out[t.name] = TensorInfo(t.name, int(t.tensor_type), tuple(reversed(ne)),
                                 int(t.n_bytes), int(t.data_offset))
    return out


def is_elementwise(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors consumed by element-wise ops (never MUL_MAT's src0): kept in F32."""
    return len(shape) <= 1 or name.endswith(_ELEMENTWISE_SUFFIXES)
