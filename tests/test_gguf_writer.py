"""pytrain.formats.gguf_writer, the raw GGUF writer the merge uses, read back by gguf-py.

A source file written by gguf-py's own ``GGUFWriter`` supplies fields of every value kind; the
writer copies them raw (as the merge copies a base model's), adds a string array (as the merge
adds its record) and writes tensors of the types a merge writes (float ones and requantized
ones) from given bytes.  ``GGUFReader`` must then see every key with its types and value,
every tensor's name, type, shape and bytes, at offsets aligned as the fields say.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q

from pytrain.formats.gguf_writer import (field_bytes, header, string_array_field, tensor_slots,
                                         write_gguf)

RECORD_KEY = "pytrain.merged_adapters"
RECORDS = ['{"adapter":"a","alpha":8}', "ünïcode ✓", ""]
# (name, shape in GGUF order: ne, fastest first, type)
TENSORS = [("f32.weight", (5, 3), Q.F32), ("f16.weight", (7,), Q.F16),
           ("bf16.weight", (8, 2, 2), Q.BF16), ("q8_0.weight", (64, 3), Q.Q8_0),
           ("q4_k.weight", (256, 2), Q.Q4_K), ("q6_k.weight", (512, 1), Q.Q6_K)]


def source_file(path, alignment: int | None):
    """A tensor-less GGUF with one field of each kind, written by gguf-py; its fields in order."""
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("general.name", "tiny ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strings", ["a", "", "ß"])
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFReader(path)


def n_bytes(shape, typ) -> int:
    block, size = GGML_QUANT_SIZES[typ]
    return int(np.prod(shape)) // block * size


@pytest.mark.parametrize("alignment", [None, 64])
def test_written_file_reads_back_exactly(tmp_path, alignment):
    src = source_file(tmp_path / "src.gguf", alignment)
    keys = [k for k in src.fields if not k.startswith("GGUF.")]
    assert len(keys) >= 15                      # every kind above, plus general.architecture
    fields = [field_bytes(src, src.fields[k]) for k in keys]
    fields.append(string_array_field(RECORD_KEY, RECORDS))

    rng = np.random.default_rng(0)
    blobs = {name: rng.integers(0, 256, n_bytes(shape, typ), dtype=np.uint8).tobytes()
             for name, shape, typ in TENSORS}
    align = alignment or 32
    slots = tensor_slots([(name, shape, int(typ), len(blobs[name]))
                          for name, shape, typ in TENSORS], align)
    out = tmp_path / "out.gguf"
    with open(out, "wb") as fh:
        written = write_gguf(fh, header(3, fields, slots, align), slots,
                             lambda f, slot: f.write(blobs[slot.name]), str(out))
    assert written == out.stat().st_size

    back = GGUFReader(out)
    assert back.alignment == align
    assert int(back.fields["GGUF.version"].contents()) == 3
    assert list(back.fields) == ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count",
                                 *keys, RECORD_KEY]
    for k in keys:
        mine, theirs = back.fields[k], src.fields[k]
        assert mine.types == theirs.types, k
        assert mine.contents() == theirs.contents(), k
        assert field_bytes(back, mine) == field_bytes(src, theirs), k
    assert back.fields[RECORD_KEY].contents() == RECORDS
    assert back.fields[RECORD_KEY].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]

    assert [t.name for t in back.tensors] == [name for name, _, _ in TENSORS]
    for t, (name, shape, typ) in zip(back.tensors, TENSORS):
        assert t.tensor_type == typ, name
        assert tuple(int(d) for d in t.shape) == shape, name
        assert t.n_bytes == len(blobs[name]), name
        assert (t.data_offset - back.data_offset) % align == 0, name
        assert np.ascontiguousarray(t.data).tobytes() == blobs[name], name


def test_a_tensor_of_the_wrong_size_is_refused(tmp_path):
    slots = tensor_slots([("a", (4,), int(Q.F32), 16), ("b", (4,), int(Q.F32), 16)], 32)
    out = tmp_path / "bad.gguf"
    with open(out, "wb") as fh, pytest.raises(ValueError, match=r"bad.gguf: internal error: "
                                              r"tensor 'a' wrote 12 bytes, expected 16"):
        write_gguf(fh, header(3, [], slots, 32), slots, lambda f, slot: f.write(b"\0" * 12),
                   str(out))
