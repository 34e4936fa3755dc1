"""GGUF metadata reading: values come back as plain Python, bad files fail naming the file."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import build as native_build  # native/build.py (conftest puts native/ on sys.path)
from pytrain.formats.gguf_meta import GGUFError, open_gguf, read_metadata

FIXTURE_MODEL = Path(__file__).parent / "fixtures" / "qwen35" / "gqa-f32.gguf"


def vocab_gguf() -> Path:
    p = native_build.llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf"
    if not p.is_file():
        pytest.fail(f"{p} not found: run `python native/build.py` to fetch the pinned llama.cpp source")
    return p


@pytest.fixture(scope="module")
def vocab_meta() -> dict:
    return read_metadata(vocab_gguf())


def test_vocab_gguf_values_are_plain_python(vocab_meta):
    m = vocab_meta
    assert m["general.architecture"] == "qwen2"
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "qwen35"
    tokens = m["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 151936
    assert all(type(t) is str for t in tokens[:1000])
    assert tokens[151645] == "<|im_end|>"
    types = m["tokenizer.ggml.token_type"]
    assert len(types) == len(tokens) and type(types[0]) is int and types[151645] == 3
    assert type(m["tokenizer.ggml.merges"][0]) is str
    assert type(m["tokenizer.ggml.eos_token_id"]) is int and m["tokenizer.ggml.eos_token_id"] == 151643
    assert type(m["qwen2.rope.freq_base"]) is float and m["qwen2.rope.freq_base"] == 1e6
    assert type(m["tokenizer.chat_template"]) is str
    assert not any(k.startswith("GGUF.") for k in m)  # the reader's pseudo-keys are not metadata


def test_model_fixture_bools_and_arrays():
    m = read_metadata(FIXTURE_MODEL)
    assert m["tokenizer.ggml.add_bos_token"] is False
    assert m["qwen35.attention.recurrent_layers"] == [True, False, True, False]
    assert open_gguf(FIXTURE_MODEL).tensors  # the reader is reusable for tensors


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("this is not a model\n")
    with pytest.raises(GGUFError, match="not a GGUF") as e:
        read_metadata(p)
    assert str(p) in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("n", [0, 2, 4, 9, 24, 100, 5000, 2_000_000])
def test_truncated_vocab(tmp_path, n):
    data = vocab_gguf().read_bytes()
    p = tmp_path / f"cut-{n}.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(GGUFError) as e:
        read_metadata(p)
    assert str(p) in str(e.value)
    if n:  # an empty file has no magic at all
        assert "truncated" in str(e.value)


def test_truncated_tensor_data(tmp_path):
    data = FIXTURE_MODEL.read_bytes()
    p = tmp_path / "cut-tensors.gguf"
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match="truncated") as e:
        open_gguf(p)
    assert str(p) in str(e.value)


def test_tensor_extent_checked(tmp_path):
    """A cut that the reader itself tolerates (it only maps data) is still caught."""
    p = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(str(p), "test")
    w.add_tensor("t", np.arange(4096, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    open_gguf(p)
    data = p.read_bytes()
    p.write_bytes(data[:-8])
    with pytest.raises(GGUFError, match="truncated") as e:
        open_gguf(p)
    assert str(p) in str(e.value)


def test_unreadable(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(GGUFError, match="cannot read") as e:
        read_metadata(missing)
    assert str(missing) in str(e.value)
    with pytest.raises(GGUFError, match="cannot read"):
        read_metadata(tmp_path)  # a directory


def same_fields(path: Path) -> int:
    """pytrain's Reader against gguf-py's own GGUFReader on one file: the same fields (offsets,
    parts byte for byte with their dtypes, data indices, types, contents) and tensors."""
    from pytrain.formats.gguf_meta import Reader
    a, b = gguf.GGUFReader(path), Reader(path)
    assert list(a.fields) == list(b.fields)
    for k, fa in a.fields.items():
        fb = b.fields[k]
        assert (fa.offset, fa.data, fa.types) == (fb.offset, fb.data, fb.types), k
        assert [(x.dtype, x.tobytes()) for x in fa.parts] == \
            [(y.dtype, y.tobytes()) for y in fb.parts], k
        assert fa.contents() == fb.contents(), k
    assert [(t.name, t.data_offset, t.n_bytes) for t in a.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in b.tensors]
    return sum(len(f.data) for f in b.fields.values())


def every_value_type(path: Path, endian) -> Path:
    w = gguf.GGUFWriter(str(path), "test", endianess=endian)
    V = gguf.GGUFValueType
    for dt, vt in ((np.uint8, V.UINT8), (np.int8, V.INT8), (np.uint16, V.UINT16),
                   (np.int16, V.INT16), (np.uint32, V.UINT32), (np.int32, V.INT32),
                   (np.uint64, V.UINT64), (np.int64, V.INT64), (np.float32, V.FLOAT32),
                   (np.float64, V.FLOAT64)):
        w.add_key_value(f"a.{vt.name}", np.arange(-3, 300).astype(dt).tolist(), V.ARRAY, vt)
    w.add_array("a.bool", [True, False, True])
    w.add_array("a.str", ["", "x", "ünïcödé", "a" * 1000])
    w.add_array("a.empty", [])
    w.add_string("s", "plain")
    w.add_uint32("u", 7)
    w.add_tensor("t", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_reader_builds_gguf_pys_fields_for_every_value_type(tmp_path, endian):
    assert same_fields(every_value_type(tmp_path / "all.gguf", endian)) > 3000


def test_reader_builds_gguf_pys_fields_for_a_vocabulary_and_a_model():
    """A SentencePiece vocabulary of 32000 tokens with their scores and types (the arrays the
    fast path exists for; gguf-py's side takes seconds, so not the 151936-token one)."""
    assert same_fields(vocab_gguf().with_name("ggml-vocab-llama-spm.gguf")) > 3 * 32000
    same_fields(FIXTURE_MODEL)


@pytest.mark.parametrize("cut", [40, 200, 1000, 14000])
def test_arrays_cut_short_are_truncated_errors(tmp_path, cut):
    """A file cut inside a numeric or string array fails as truncated, naming the file."""
    data = every_value_type(tmp_path / "all.gguf", gguf.GGUFEndian.LITTLE).read_bytes()
    p = tmp_path / f"cut-{cut}.gguf"
    p.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated") as e:
        read_metadata(p)
    assert str(p) in str(e.value)
