"""Chat rendering equals transformers' output; the loss mask covers exactly the assistant turns.

Goldens: tests/fixtures/chat_template_golden.json, made by scripts/make_chat_template_golden.py
through transformers 5.23's own apply_chat_template on llama.cpp's Qwen3.5-4B.jinja.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
from pathlib import Path

import jinja2
import pytest

import build as native_build  # native/build.py (conftest puts native/ on sys.path)
from pytrain.data.chat_template import (ChatTemplateError, encode_chat, render,
                                   render_with_assistant_spans, spans_to_mask)
from pytrain.data.tokenizer import Tokenizer
from pytrain.formats.gguf_meta import read_metadata

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = json.loads((FIXTURES / "chat_template_golden.json").read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in GOLDEN["cases"]}
EOT = ["<|im_end|>"]

TOOL_CALL = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
             '<parameter=days>\n2\n</parameter>\n<parameter=opts>\n{"unit": "°C", "list": [1, 2]}\n'
             '</parameter>\n</function>\n</tool_call>')
# What each case must train, written out by hand (see pytrain/data/chat_template.py for the rule):
# reasoning (after the "<think>\n" the generation prompt already holds) + content + <|im_end|>.
TARGETS = {
    "single_turn": ["I am a helpful assistant.<|im_end|>"],
    "system_prompt": ["Paris.<|im_end|>"],
    "multi_turn": ["4.<|im_end|>", "6.<|im_end|>", "7 is prime.<|im_end|>"],
    "multi_turn_no_system": ["4.<|im_end|>", "6.<|im_end|>", "7 is prime.<|im_end|>"],
    "generation_prompt": [],
    "generation_prompt_off": [],
    "generation_prompt_after_history": ["4.<|im_end|>"],
    "enable_thinking_false": [],
    "enable_thinking_false_with_answer": ["Hello!<|im_end|>"],
    "reasoning_content": ["91 / 7 = 13, so it is composite.\n</think>\n\nNo, 91 = 7 x 13.<|im_end|>"],
    "reasoning_multi_turn": ["No.<|im_end|>", "No divisor up to 9.\n</think>\n\nYes.<|im_end|>"],
    "reasoning_alias_field": ["91 = 7 * 13.\n</think>\n\nNo.<|im_end|>"],
    "inline_think": ["91 = 7 * 13.\n</think>\n\nNo, it is not.<|im_end|>"],
    "whitespace_and_unicode": ["Both spell cafe\u0301; NFC is not applied.<|im_end|>"],
    "content_parts": ["Got both parts.<|im_end|>"],
    "tools": [TOOL_CALL + "<|im_end|>", "It is 21 °C in Paris.<|im_end|>"],
}


def llama_cpp_dir() -> Path:
    d = native_build.llama_cpp_dir()
    if not (d / "models" / "ggml-vocab-qwen35.gguf").is_file():
        pytest.fail(f"pinned llama.cpp source not found under {d}: run `python native/build.py`")
    return d


@pytest.fixture(scope="module")
def template() -> str:
    text = (llama_cpp_dir() / GOLDEN["template"]).read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN["template_sha256"], \
        "Qwen3.5 template changed: rerun scripts/make_chat_template_golden.py"
    return text


_TOKENIZERS: dict[str, Tokenizer] = {}


@pytest.fixture(scope="module", params=["model-fixture", "vocab-qwen35"])
def tok(request) -> Tokenizer:
    """The Qwen3.5-format fixture model (``<think>`` is a token) and llama.cpp's 151,936-token
    qwen35 vocabulary (``<think>`` is plain text)."""
    if request.param not in _TOKENIZERS:
        path = (FIXTURES / "qwen35" / "gqa-f32.gguf" if request.param == "model-fixture"
                else llama_cpp_dir() / "models" / "ggml-vocab-qwen35.gguf")
        _TOKENIZERS[request.param] = Tokenizer.from_metadata(read_metadata(path))
    return _TOKENIZERS[request.param]


def split_kwargs(case: dict) -> tuple[bool, dict]:
    kw = dict(case["kwargs"])
    return kw.pop("add_generation_prompt", False), kw


def masked_runs(ids: list[int], mask: list[bool]) -> list[list[int]]:
    runs, cur = [], None
    for i, m in zip(ids, mask):
        if m:
            if cur is None:
                cur = []
                runs.append(cur)
            cur.append(i)
        else:
            cur = None
    return runs


# -- rendering -----------------------------------------------------------------------------
def test_golden_covers_the_brief():
    assert set(CASES) == set(TARGETS)
    assert GOLDEN["transformers_version"] == "5.23.0"


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_transformers(template, name):
    case = CASES[name]
    gen, kw = split_kwargs(case)
    messages = copy.deepcopy(case["messages"])
    assert render(template, messages, gen, **kw) == case["expected"]
    assert messages == case["messages"]  # inputs are not modified


@pytest.mark.parametrize("name", sorted(CASES))
def test_spans_text(template, name):
    case = CASES[name]
    gen, kw = split_kwargs(case)
    text, spans = render_with_assistant_spans(template, case["messages"], gen, end_of_turn=EOT, **kw)
    assert text == case["expected"]
    assert [text[a:b] for a, b in spans] == TARGETS[name]


# -- token mask ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_mask_is_exactly_the_assistant_turns(tok, template, name):
    case = CASES[name]
    gen, kw = split_kwargs(case)
    enc = encode_chat(tok, case["messages"], template, gen, **kw)
    assert enc.text == case["expected"]
    assert enc.ids == tok.encode(enc.text)  # the mask is over the ordinary tokenization
    assert len(enc.mask) == len(enc.ids)

    runs = masked_runs(enc.ids, enc.mask)
    assert [tok.decode(r) for r in runs] == TARGETS[name]
    assert all(r[-1] == tok.token_to_id("<|im_end|>") for r in runs)

    masked_text = "".join(tok.decode(r) for r in runs)
    assert "<|im_start|>" not in masked_text and "assistant\n" not in masked_text

    # system, user and tool text never reaches the mask
    _, offsets = tok.encode_with_offsets(enc.text)
    trained = {c for (s, e), m in zip(offsets, enc.mask) if m for c in range(s, e)}
    for msg in case["messages"]:
        if msg["role"] == "assistant" or not isinstance(msg.get("content"), str):
            continue
        needle = msg["content"].strip()
        at = enc.text.find(needle)
        assert at >= 0
        assert not trained & set(range(at, at + len(needle))), msg
    # the header and the empty-think placeholder stay prompt
    for at in range(len(enc.text)):
        if enc.text.startswith("<|im_start|>assistant\n", at):
            assert not trained & set(range(at, at + len("<|im_start|>assistant\n")))
        if enc.text.startswith("<think>\n\n</think>\n\n", at):
            assert not trained & set(range(at, at + len("<think>\n\n</think>\n\n")))


def test_multi_turn_masks_every_assistant_turn(tok, template):
    case = CASES["multi_turn"]
    enc = encode_chat(tok, case["messages"], template)
    assert len(masked_runs(enc.ids, enc.mask)) == 3
    assert len(enc.spans) == 3


@pytest.mark.parametrize("name", ["generation_prompt", "generation_prompt_after_history",
                                  "enable_thinking_false"])
def test_generation_prompt_leaves_no_target(tok, template, name):
    case = CASES[name]
    gen, kw = split_kwargs(case)
    assert gen
    enc = encode_chat(tok, case["messages"], template, gen, **kw)
    tail = enc.text.rindex("<|im_start|>assistant\n")
    _, offsets = tok.encode_with_offsets(enc.text)
    assert not any(m for (s, _), m in zip(offsets, enc.mask) if s >= tail)
    assert len(masked_runs(enc.ids, enc.mask)) == len(TARGETS[name])


def test_model_template_is_the_default(template):
    small = Tokenizer.from_metadata(read_metadata(FIXTURES / "qwen35" / "gqa-f32.gguf"))
    assert small.chat_template == template
    case = CASES["single_turn"]
    assert encode_chat(small, case["messages"]).text == case["expected"]
    small.chat_template = None
    with pytest.raises(ChatTemplateError, match="chat_template"):
        encode_chat(small, case["messages"])


# -- robustness of span location -----------------------------------------------------------
REWRITING = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n[earlier] {{ m.content | upper }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content | trim }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}")


def test_template_that_rewrites_earlier_turns():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": " see you "}]
    text, spans = render_with_assistant_spans(REWRITING, msgs, end_of_turn=EOT)
    assert text == render(REWRITING, msgs)
    assert not text.startswith(render(REWRITING, msgs[:2]))  # prefix rendering would be wrong
    assert [text[a:b] for a, b in spans] == ["HELLO<|im_end|>", "see you<|im_end|>"]


def test_qwen_history_turn_renders_differently_than_as_last(template):
    msgs = CASES["reasoning_multi_turn"]["messages"]
    assert not render(template, msgs).startswith(render(template, msgs[:2]))


def test_content_rendered_twice_is_rejected():
    tpl = "{% for m in messages %}{{ m.content }}|{{ m.content }}<|im_end|>{% endfor %}"
    with pytest.raises(ChatTemplateError, match="more than once"):
        render_with_assistant_spans(tpl, [{"role": "assistant", "content": "x"}], end_of_turn=EOT)


def test_end_of_turn_inside_content_is_rejected(template):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a<|im_end|>b"}]
    with pytest.raises(ChatTemplateError, match="end-of-turn"):
        render_with_assistant_spans(template, msgs, end_of_turn=EOT)


def test_missing_end_of_turn_is_rejected():
    tpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="no end-of-turn"):
        render_with_assistant_spans(tpl, [{"role": "assistant", "content": "x"}], end_of_turn=EOT)


def test_spans_to_mask_overlap_rule():
    offsets = [(0, 0), (0, 3), (3, 5), (5, 9), (9, 10), (10, 10)]
    # span 4..9 starts inside token (3, 5): that token is trained, zero-width ones never are
    assert spans_to_mask(offsets, [(4, 9)]) == [False, False, True, True, False, False]
    assert spans_to_mask(offsets, [(0, 3), (9, 10)]) == [False, True, False, False, True, False]
    assert spans_to_mask(offsets, []) == [False] * 6


# -- environment: transformers' Jinja setup ------------------------------------------------
def one(tpl: str, **kw) -> str:
    return render(tpl, [{"role": "user", "content": "u"}], **kw)


def test_raise_exception(template):
    with pytest.raises(ChatTemplateError, match="No user query found"):
        render(template, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        render(template, [])


def test_tojson_like_transformers():
    tpl = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ y | tojson(sort_keys=true) }}"
    out = one(tpl, x={"a": "é<b>&'"}, y={"b": 1, "a": [1.5, None, True]})
    assert out == ('{"a": "é<b>&\'"}|{\n  "a": "é<b>&\'"\n}|{"a": [1.5, null, true], "b": 1}')


def test_strftime_now_and_trim_blocks_and_loopcontrols():
    assert one("{{ strftime_now('%Y') }}") == str(datetime.datetime.now().year)
    assert one("  {% if true %}\nX\n  {% endif %}\nY") == "X\nY"
    assert one("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "1"
    assert one("{% generation %}A{% endgeneration %}B") == "AB"
    assert one("{{ dict(a=1)['a'] }}{% set ns = namespace(v=2) %}{{ ns.v }}") == "12"


def test_sandbox():
    with pytest.raises(jinja2.exceptions.SecurityError):
        one("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        one("{% set l = [] %}{{ l.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        one("{{ ''.__class__.__mro__ }}")


def test_none_keys_dropped_like_apply_chat_template():
    tpl = "{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}"
    assert render(tpl, [{"role": "assistant", "content": "x", "tool_calls": None}]) == "False"
