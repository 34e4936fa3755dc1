"""Adapter GGUF I/O: round trip, the checks llama.cpp's loader makes (refused here first, with
the file named), base-model matching, and atomic writes.  The llama.cpp load itself is
tests/test_llama_cpp_adapter.py."""
import os
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from pytrain.formats import adapter_gguf as AG
from pytrain.formats.adapter_gguf import AdapterError, check_adapter_matches, read_lora_gguf, \
    write_lora_gguf
from pytrain.formats.gguf_meta import GGUFError
from pytrain.models.model_file import open_model

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def pair(rng, base="blk.3.attn_q.weight", r=4, n_in=64, n_out=128):
    return {f"{base}.lora_a": rng.standard_normal((r, n_in)).astype(np.float32),
            f"{base}.lora_b": rng.standard_normal((n_out, r)).astype(np.float32)}


def raw_gguf(path, kv, tensors, arch="qwen35"):
    """A GGUF written without our validation, to feed the reader bad files."""
    w = GGUFWriter(path, arch)
    for k, v in kv.items():
        if isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_string(k, v)
    for n, a in tensors.items():
        w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


ADAPTER_KV = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0}


def test_round_trip_is_exact(tmp_path, rng):
    t = {**pair(rng), **pair(rng, "blk.3.attn_output.weight", n_in=64, n_out=64)}
    meta = {"general.name": "demo", "pytrain.steps": 12, "pytrain.lr": 0.5,
            "adapter.alora.invocation_tokens": [1, 2, 3], "pytrain.targets": ["attn_q", "x"]}
    p = write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, t, meta)
    arch, alpha, got, got_meta = read_lora_gguf(p, arch="qwen35")
    assert (arch, alpha) == ("qwen35", 8.0)
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == np.float32 and np.array_equal(got[k], t[k])
    assert got_meta == meta
    assert list(tmp_path.iterdir()) == [p]          # no temp file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask   # not mkstemp's 0600


def test_file_layout_is_what_llama_cpp_reads(tmp_path, rng):
    """Keys and types, F32 tensors, ne order ([n_in, r] / [r, n_out]), 32-byte alignment."""
    from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType
    p = write_lora_gguf(tmp_path / "a.gguf", "qwen35", 16, pair(rng, r=4, n_in=64, n_out=128))
    r = GGUFReader(p)
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["general.architecture"].contents() == "qwen35"
    assert r.fields["adapter.type"].contents() == "lora"
    f = r.fields["adapter.lora.alpha"]
    assert f.types == [GGUFValueType.FLOAT32] and f.contents() == 16.0
    assert "general.alignment" not in r.fields
    ne = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert ne == {"blk.3.attn_q.weight.lora_a": [64, 4], "blk.3.attn_q.weight.lora_b": [4, 128]}
    for t in r.tensors:
        assert t.tensor_type == GGMLQuantizationType.F32
        assert t.data_offset % 32 == 0


def test_reader_accepts_f16_tensors(tmp_path, rng):
    """convert_lora_to_gguf.py can write F16; llama.cpp loads it, so pytrain reads it too."""
    t = {k: v.astype(np.float16) for k, v in pair(rng).items()}
    p = raw_gguf(tmp_path / "h.gguf", ADAPTER_KV, t)
    _, _, got, _ = read_lora_gguf(p)
    for k in t:
        assert got[k].dtype == np.float32 and np.array_equal(got[k], t[k].astype(np.float32))


def test_reader_skips_norm_tensors_like_llama_cpp(tmp_path, rng):
    t = {**pair(rng), "blk.3.attn_norm.weight": np.ones(64, np.float32)}
    _, _, got, _ = read_lora_gguf(raw_gguf(tmp_path / "n.gguf", ADAPTER_KV, t))
    assert set(got) == set(pair(rng))


# --------------------------------------------------------------------------- write errors

@pytest.mark.parametrize("tensors, match", [
    ({"blk.3.attn_q.weight.lora_a": np.zeros((4, 64), np.float32)}, "missing 'blk.3.attn_q"),
    ({"blk.3.attn_q.weight.lora_b": np.zeros((128, 4), np.float32)}, "missing 'blk.3.attn_q"),
    ({"blk.3.attn_q.weight": np.zeros((128, 64), np.float32)}, "does not end in"),
    ({"blk.3.attn_q.weight.lora_a": np.zeros((4, 64), np.float32),
      "blk.3.attn_q.weight.lora_b": np.zeros((128, 8), np.float32)}, "disagree on the rank"),
    ({"blk.3.attn_q.weight.lora_a": np.zeros((64, 4), np.float32),     # A stored [n_in, r]
      "blk.3.attn_q.weight.lora_b": np.zeros((128, 4), np.float32)}, "disagree on the rank"),
    ({"blk.3.attn_q.weight.lora_a": np.zeros((4, 64, 1), np.float32),
      "blk.3.attn_q.weight.lora_b": np.zeros((128, 4), np.float32)}, "must be 2-D"),
    ({}, "no LoRA tensors"),
    ({"blk.3.attn_q.weight.lora_a": np.full((4, 64), np.nan, np.float32),
      "blk.3.attn_q.weight.lora_b": np.zeros((128, 4), np.float32)}, "NaN or Inf"),
    ({"x" * 60 + ".lora_a": np.zeros((4, 64), np.float32),
      "x" * 60 + ".lora_b": np.zeros((128, 4), np.float32)}, "63-byte limit"),
])
def test_write_refuses_what_llama_cpp_would(tmp_path, tensors, match):
    p = tmp_path / "bad.gguf"
    with pytest.raises(AdapterError, match=match) as e:
        write_lora_gguf(p, "qwen35", 8, tensors)
    assert str(p) in str(e.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("alpha", [0, 0.0, float("nan"), float("inf"), 1e39, "x"])
def test_write_refuses_alpha_llama_cpp_misreads(tmp_path, rng, alpha):
    """alpha 0 means scale 1 in llama.cpp but 0 in pytrain: refuse rather than disagree."""
    with pytest.raises(AdapterError, match="alpha"):
        write_lora_gguf(tmp_path / "a.gguf", "qwen35", alpha, pair(rng))


def test_write_refuses_reserved_metadata_and_bad_arch(tmp_path, rng):
    with pytest.raises(AdapterError, match="set by the writer"):
        write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, pair(rng), {"general.type": "model"})
    with pytest.raises(AdapterError, match="arch"):
        write_lora_gguf(tmp_path / "a.gguf", "", 8, pair(rng))
    with pytest.raises(AdapterError, match="unsupported type"):
        write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, pair(rng), {"k": {"a": 1}})
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- read errors

def test_read_refuses_a_base_model():
    with pytest.raises(AdapterError, match=r"gqa-f32.gguf: not an adapter.*'model'"):
        read_lora_gguf(FIX / "gqa-f32.gguf")


def test_read_refuses_wrong_arch(tmp_path, rng):
    p = write_lora_gguf(tmp_path / "a.gguf", "llama", 8, pair(rng))
    with pytest.raises(AdapterError, match=r"a.gguf: adapter is for architecture 'llama', but "
                                           r"the model is 'qwen35'"):
        read_lora_gguf(p, arch="qwen35")


@pytest.mark.parametrize("kv, match", [
    ({"general.type": "adapter", "adapter.type": "control_vector",
      "adapter.lora.alpha": 8.0}, "adapter.type is 'control_vector'"),
    ({"general.type": "adapter", "adapter.type": "lora"}, "no adapter.lora.alpha"),
    ({"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 0.0},
     "non-zero"),
])
def test_read_refuses_bad_keys(tmp_path, rng, kv, match):
    p = raw_gguf(tmp_path / "k.gguf", kv, pair(rng))
    with pytest.raises(AdapterError, match=match) as e:
        read_lora_gguf(p)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("drop, match", [("lora_a", "missing 'blk.3.attn_q.weight.lora_a'"),
                                         ("lora_b", "missing 'blk.3.attn_q.weight.lora_b'")])
def test_read_refuses_missing_pair(tmp_path, rng, drop, match):
    t = {k: v for k, v in pair(rng).items() if not k.endswith(drop)}
    p = raw_gguf(tmp_path / "m.gguf", ADAPTER_KV, t)
    with pytest.raises(AdapterError, match=match):
        read_lora_gguf(p)


def test_read_refuses_bad_shapes_and_suffixes(tmp_path, rng):
    t = pair(rng)
    t["blk.3.attn_q.weight.lora_b"] = t["blk.3.attn_q.weight.lora_b"].T.copy()   # [r, n_out]
    with pytest.raises(AdapterError, match="disagree on the rank"):
        read_lora_gguf(raw_gguf(tmp_path / "s.gguf", ADAPTER_KV, t))
    t = {**pair(rng), "blk.3.attn_q.weight": np.zeros((128, 64), np.float32)}
    with pytest.raises(AdapterError, match="does not end in"):
        read_lora_gguf(raw_gguf(tmp_path / "x.gguf", ADAPTER_KV, t))


def test_read_refuses_non_gguf_and_truncated(tmp_path, rng):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="junk.gguf: not a GGUF"):
        read_lora_gguf(p)
    good = write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, pair(rng))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="cut.gguf: truncated"):
        read_lora_gguf(cut)


# --------------------------------------------------------------------------- base matching

@pytest.fixture(scope="module")
def gqa_config():
    return open_model(FIX / "gqa-f32.gguf")[3]


def test_matches_own_base(gqa_config):
    """What check_adapter_matches accepts for gqa is exactly what llama.cpp's loader accepts for
    the tensors llama.cpp's converter wrote: base shapes read from the fixture GGUF with gguf-py's
    GGUFReader (not pytrain's config), pair shapes by llama.cpp's rule; one off in any dimension
    is refused, and so is every tensor that is not a matrix."""
    from gguf import GGUFReader
    tensors = {t.name: [int(d) for d in t.shape] for t in GGUFReader(FIX / "gqa-f32.gguf").tensors}
    mats = {n: ne for n, ne in tensors.items() if len(ne) == 2}
    assert len(mats) == 33 and len(tensors) == 52

    def adapter(name, a_shape, b_shape):
        return {name + ".lora_a": np.zeros(a_shape, np.float32),
                name + ".lora_b": np.zeros(b_shape, np.float32)}

    def shapes(name, r):
        """numpy (A, B) shapes and the axes of A and B that must equal a base dimension."""
        n0, n1 = mats[name]                     # ggml ne: ne[0] = row length
        if name == "token_embd.weight":         # a->ne[1] == ne[1], b->ne[1] == ne[0]
            return (n1, r), (n0, r), 0, 0
        return (r, n0), (n1, r), 1, 0           # a->ne[0] == ne[0], b->ne[1] == ne[1]

    whole = {}
    for name in mats:
        for r in (1, 4, 7):                     # the rank is the adapter's choice
            a, b, _, _ = shapes(name, r)
            check_adapter_matches(gqa_config, adapter(name, a, b))       # accepted
        a, b, ax_a, ax_b = shapes(name, 4)
        whole.update(adapter(name, a, b))
        for d in (-1, 1):                       # one off in either base dimension: refused
            for bad in ((a[:ax_a] + (a[ax_a] + d,) + a[ax_a + 1:], b),
                        (a, b[:ax_b] + (b[ax_b] + d,) + b[ax_b + 1:])):
                with pytest.raises(AdapterError, match=re.escape(repr(name))):
                    check_adapter_matches(gqa_config, adapter(name, *bad))
    check_adapter_matches(gqa_config, whole)    # all 33 matrices at once
    for name, ne in tensors.items():
        if len(ne) != 2:
            with pytest.raises(AdapterError, match="not a matrix"):
                check_adapter_matches(gqa_config, adapter(name, (4, ne[0]), (ne[0], 4)))


def test_refuses_adapter_for_another_base(gqa_config, rng):
    # gqa: hidden 64, 4 layers, attention at layer 3; attn_q is [128, 64]
    with pytest.raises(AdapterError, match=r"'blk.7.attn_q.weight' does not exist in the base"):
        check_adapter_matches(gqa_config, pair(rng, "blk.7.attn_q.weight"))
    with pytest.raises(AdapterError, match=r"'blk.3.attn_q.weight' is \(128, 64\) in the base "
                                           r"model but the adapter has A \(4, 96\)"):
        check_adapter_matches(gqa_config, pair(rng, n_in=96), source="x.gguf")
    with pytest.raises(AdapterError, match="B \\(256, 4\\)"):
        check_adapter_matches(gqa_config, pair(rng, n_out=256))
    with pytest.raises(AdapterError, match="not a matrix"):
        check_adapter_matches(gqa_config, pair(rng, "blk.3.attn_norm.weight"))


def test_token_embd_uses_llama_cpp_flipped_convention(rng):
    shapes = {"token_embd.weight": (512, 64)}               # [n_vocab, n_embd]
    ok = {"token_embd.weight.lora_a": np.zeros((512, 4), np.float32),     # get_rows(A, tok)
          "token_embd.weight.lora_b": np.zeros((64, 4), np.float32)}      # then B·that
    check_adapter_matches(shapes, ok)
    bad = {"token_embd.weight.lora_a": np.zeros((64, 4), np.float32),
           "token_embd.weight.lora_b": np.zeros((512, 4), np.float32)}
    with pytest.raises(AdapterError, match=r"token_embd.*expected A \[512, r\] and B \[64, r\]"):
        check_adapter_matches(shapes, bad)
    as_linear = {"token_embd.weight.lora_a": np.zeros((4, 512), np.float32),
                 "token_embd.weight.lora_b": np.zeros((64, 4), np.float32)}
    with pytest.raises(AdapterError, match="need A \\[n_vocab, r\\]"):
        check_adapter_matches(shapes, as_linear)


# --------------------------------------------------------------------------- atomicity

def test_failed_write_keeps_previous_file(tmp_path, rng, monkeypatch):
    p = write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, pair(rng))
    before = p.read_bytes()

    def half_then_fail(self, *a, **k):
        self.fout[0].write(b"\0" * 64)      # some tensor bytes reach the temp file...
        self.fout[0].flush()
        raise OSError(28, "No space left on device")   # ...then the disk fills up

    monkeypatch.setattr(AG.GGUFWriter, "write_tensors_to_file", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        write_lora_gguf(p, "qwen35", 8, pair(np.random.default_rng(9)))
    assert p.read_bytes() == before
    assert list(tmp_path.iterdir()) == [p]          # the temp file is gone too
    read_lora_gguf(p)


def test_failed_fsync_keeps_previous_file_and_no_file_when_new(tmp_path, rng, monkeypatch):
    p = write_lora_gguf(tmp_path / "a.gguf", "qwen35", 8, pair(rng))
    before = p.read_bytes()

    def boom(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(AG.os, "fsync", boom)
    with pytest.raises(OSError):
        write_lora_gguf(p, "qwen35", 8, pair(np.random.default_rng(9)))
    with pytest.raises(OSError):
        write_lora_gguf(tmp_path / "new.gguf", "qwen35", 8, pair(rng))
    assert p.read_bytes() == before
    assert list(tmp_path.iterdir()) == [p]
