"""The GGUF tokenizer reproduces llama.cpp: its own test vectors, special-token rules, BOS policy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

import build as native_build  # native/build.py (conftest puts native/ on sys.path)
from pytrain.formats.gguf_meta import read_metadata
from pytrain.data.tokenizer import Tokenizer, TokenizerError

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_MODEL = FIXTURES / "qwen35" / "gqa-f32.gguf"  # real Qwen3.5 format, 512-token vocab


def llama_models_dir() -> Path:
    d = native_build.llama_cpp_dir() / "models"
    if not (d / "ggml-vocab-qwen35.gguf").is_file():
        pytest.fail(f"{d}/ggml-vocab-qwen35.gguf not found: run `python native/build.py` to fetch "
                    "the pinned llama.cpp source")
    return d


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    """Parse ``.inp``/``.out`` exactly as tests/test-tokenizer-0.cpp does (raw bytes, no newline
    translation, no trailing empty case)."""
    d = llama_models_dir()
    raw = (d / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    outputs = (d / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    if outputs and outputs[-1] == "":
        outputs.pop()
    assert len(inputs) == len(outputs), f"{name}: {len(inputs)} inputs, {len(outputs)} outputs"
    return [(s, [int(x) for x in o.strip().split()]) for s, o in zip(inputs, outputs)]


@pytest.fixture(scope="module")
def qwen35_meta() -> dict:
    return read_metadata(llama_models_dir() / "ggml-vocab-qwen35.gguf")


@pytest.fixture(scope="module")
def qwen35(qwen35_meta) -> Tokenizer:
    return Tokenizer.from_metadata(qwen35_meta)


@pytest.fixture(scope="module")
def small() -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(FIXTURE_MODEL))


def check_vectors(tok: Tokenizer, name: str, expected_count: int) -> None:
    vectors = read_vectors(name)
    assert len(vectors) == expected_count
    # llama.cpp runs them with add_special=false, parse_special=false
    bad = [(s, want, got) for s, want in vectors
           if (got := tok.encode(s, add_special=False, parse_special=False)) != want]
    assert not bad, "\n".join(f"{s!r}: want {w} got {g}" for s, w, g in bad)
    bad_rt = [(s, tok.decode(tok.encode(s, parse_special=False))) for s, _ in vectors]
    bad_rt = [(s, d) for s, d in bad_rt if s != d]
    assert not bad_rt, bad_rt


def test_qwen35_vectors(qwen35):
    check_vectors(qwen35, "qwen35", 50)


def test_no_unicode_normalisation(qwen35):
    """transformers' Qwen3.5 tokenizer applies NFC; llama.cpp (the authority) does not."""
    assert qwen35.encode("Cafe\u0301") != qwen35.encode("Caf\u00e9")
    assert qwen35.decode(qwen35.encode("Cafe\u0301")) == "Cafe\u0301"


@pytest.mark.slow
@pytest.mark.parametrize("name,count", [("qwen2", 46), ("llama-bpe", 46), ("gpt-2", 46),
                                        ("starcoder", 46), ("refact", 46)])
def test_other_pre_tokenizer_vectors(name, count):
    tok = Tokenizer.from_metadata(read_metadata(llama_models_dir() / f"ggml-vocab-{name}.gguf"))
    check_vectors(tok, name, count)


def test_qwen35_ids_and_properties(qwen35):
    assert qwen35.vocab_size == 151936
    assert qwen35.bos_id == qwen35.eos_id == qwen35.pad_id == 151643
    assert qwen35.eot_id is None
    assert qwen35.add_bos is False
    assert qwen35.token_to_id("<|im_end|>") == 151645
    assert qwen35.id_to_token(151644) == "<|im_start|>"
    assert qwen35.token_to_id("Hello") == 9707 and qwen35.id_to_token(9707) == "Hello"
    assert qwen35.token_to_id("no such token at all") is None
    assert isinstance(qwen35.chat_template, str)
    assert qwen35.eog_ids == [151643, 151645]


def test_special_tokens_parsed(qwen35):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = qwen35.encode(text)
    assert ids[0] == 151644 and 151645 in ids
    assert qwen35.decode(ids) == text
    assert qwen35.decode(ids, skip_special=True) == "user\nhi\n"
    raw = qwen35.encode(text, parse_special=False)
    assert 151644 not in raw and 151645 not in raw
    assert qwen35.decode(raw) == text


def test_user_defined_tokens_always_parsed(qwen35, small):
    """llama.cpp splits USER_DEFINED tokens out even with parse_special=false."""
    for parse_special in (True, False):
        ids = qwen35.encode("a [PAD151646] b", parse_special=parse_special)
        assert ids == [64, 220, 151646, 293]
    think = small.token_to_id("<think>")
    assert small.token_type(think) == 4
    for parse_special in (True, False):
        assert think in small.encode("x<think>\ny", parse_special=parse_special)
    assert small.decode(small.encode("<think>\nhm</think>"), skip_special=True) == "<think>\nhm</think>"
    im_end = small.token_to_id("<|im_end|>")
    assert im_end in small.encode("ok<|im_end|>")
    assert im_end not in small.encode("ok<|im_end|>", parse_special=False)


def test_offsets(qwen35):
    text = "Hi 🦙<|im_end|>\n<|im_start|>x"
    ids, offsets = qwen35.encode_with_offsets(text)
    assert len(ids) == len(offsets)
    assert ids == qwen35.encode(text)
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    assert [s for s, _ in offsets] == sorted(s for s, _ in offsets)
    by_id = dict(zip(ids, offsets))
    assert text[slice(*by_id[151645])] == "<|im_end|>"
    assert text[slice(*by_id[151644])] == "<|im_start|>"
    # the llama is split over several byte-level tokens, each pointing at the same character
    assert sum(1 for s, e in offsets if text[s:e] == "🦙") >= 2


def test_bos_follows_add_bos_token(qwen35_meta):
    plain = Tokenizer.from_metadata(qwen35_meta)
    assert plain.encode("Hello", add_special=True) == [9707]  # key absent: qwen35 adds no BOS
    with_bos = Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("Hello", add_special=True) == [151643, 9707]
    assert with_bos.encode("Hello", add_special=False) == [9707]
    ids, offsets = with_bos.encode_with_offsets("Hello", add_special=True)
    assert offsets[0] == (0, 0)
    llama3 = Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.pre": "llama-bpe"})
    assert llama3.add_bos  # llama.cpp's default for that pre-tokenizer
    assert Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.pre": "llama-bpe",
                                    "tokenizer.ggml.add_bos_token": False}).add_bos is False


def test_unsupported_pre_tokenizer(qwen35_meta):
    with pytest.raises(TokenizerError, match="'made-up-pre'"):
        Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.pre": "made-up-pre"})
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.model": "t5"})
    with pytest.raises(TokenizerError, match="add_space_prefix"):      # Llama 2 style SPM
        Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_metadata({**qwen35_meta, "tokenizer.ggml.model": "llama",
                                 "tokenizer.ggml.add_space_prefix": False})
    meta = dict(qwen35_meta)
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(meta)


def test_small_model_matches_hf_tokenizer_json(small):
    """The fixture GGUF came from this tokenizer.json; on NFC-stable text they must agree."""
    hf = HFTokenizer.from_file(str(FIXTURES / "qwen35" / "tokenizer" / "tokenizer.json"))
    golden = json.loads((FIXTURES / "chat_template_golden.json").read_text(encoding="utf-8"))
    texts = [c["expected"] for c in golden["cases"] if c["name"] != "whitespace_and_unicode"]
    texts += ["The quick brown fox's 123 jumps!\n\n  indented\tline  ", "déjà vu — 東京 🦙"]
    for text in texts:
        assert small.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
    assert small.eos_id == small.token_to_id("<|im_end|>") and small.bos_id is None
