"""Chat templates rendered as transformers renders them, and which characters are trained.

Rendering mirrors transformers 5.23 (``utils/chat_template_utils.py`` and
``apply_chat_template``): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
``lstrip_blocks`` and ``loopcontrols``; its ``tojson`` (plain ``json.dumps``, no HTML escaping,
non-ASCII kept); ``raise_exception``; ``strftime_now``; the restricted ``dict`` and
``namespace`` globals; the ``{% generation %}`` tag (rendered transparently); message keys whose
value is ``None`` dropped; ``reasoning``/``thinking``/``reasoning_content`` aliased to each other;
inputs rebuilt from plain JSON types.  ``tests/fixtures/chat_template_golden.json`` is
transformers' own output and the tests hold this module to it byte for byte.

What an assistant turn trains (the loss mask)
----------------------------------------------
Trained: what the model must generate after the generation prompt, and nothing the prompt
already contains.  For each assistant message that is

* the rendered reasoning, when the message has any, from its first character through the
  closing ``</think>`` and the blank line after it;
* the rendered content and tool calls;
* the end-of-turn token (``<|im_end|>``) so the model learns to stop.

Not trained: the role header (``<|im_start|>assistant\\n``), the ``<think>\\n`` opener that
Qwen3.5's generation prompt already writes, the empty ``<think>\\n\\n</think>\\n\\n`` placeholder
the template inserts in recent turns when a message has no reasoning (it is exactly the
``enable_thinking=False`` generation prompt, so it is prompt, not answer), the newline after the
end-of-turn token, every system/user/tool message, and a trailing generation prompt.  Reasoning
the template drops from older turns is not in the text, so it is not trained either.

How the trained characters are found
------------------------------------
Rendering prefixes of the conversation does not work: Qwen3.5 renders an assistant turn
differently (with or without a think block) depending on where the last user query is, so a
prefix render is not a prefix of the full render.  Instead, for each assistant message the
conversation is rendered again with that message's content replaced by a unique private-use
sentinel and its reasoning removed.  Everything before the first and after the last differing
character is identical in both renders, so the differing stretch of the real render is exactly
what this message's reasoning and content became; the trained span runs from its start to the
end of the first end-of-turn string after it.  The returned text is always the plain render;
renders must be deterministic and a span may not contain an end-of-turn string, or the
conversation is rejected rather than masked wrongly.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pytrain.errors import PytrainError

if TYPE_CHECKING:
    from pytrain.data.tokenizer import Tokenizer

Span = tuple[int, int]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(PytrainError, ValueError):
    """A conversation that cannot be rendered or masked reliably."""


class TemplateSecurityError(ChatTemplateError, jinja2.exceptions.SecurityError):
    """A template that tried what the sandbox forbids: a fault of the template (of the model
    file or the template file), never of one record, so never skipped as one."""


# -- environment (transformers' _cached_compile_jinja_template) ----------------------------
class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: parsed so such templates load; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per template string; templates come from model files, so sandboxed."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


# -- inputs (apply_chat_template + render_jinja_template) ----------------------------------
def _plain(value: Any) -> Any:
    """Rebuild from plain JSON types, so the sandbox never sees objects with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"chat messages must be dicts, got {m!r}")
        msg = {k: v for k, v in _plain(m).items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _render_prepared(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     tools: Sequence[Mapping[str, Any]] | None, documents: Any,
                     kwargs: dict[str, Any]) -> str:
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be JSON-schema dicts")
    try:
        return compile_template(template).render(
            messages=messages, tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    except jinja2.exceptions.SecurityError as e:
        raise TemplateSecurityError(f"the chat template tried what the sandbox forbids ({e}); "
                                    f"refusing to use it") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except Exception as e:       # a Python error inside the template on this conversation
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


# -- content parts (llama.cpp's common/chat.cpp: messages_inp_normalizer) -------------------
_PROBE = "\ue000probe\ue001"


@lru_cache(maxsize=16)
def wants_string_content(template: str) -> bool:
    """True for a template that renders a message's content as a string and not as a list of
    ``{"type": "text", "text": ...}`` parts (SmolLM2's concatenates it: a list raises
    ``TypeError``; Gemma's ``| trim`` prints the list's repr).  Probed once per template, as
    llama.cpp probes its templates' capabilities: one user message rendered with string
    content and with the same text as a part; different output means the parts are not
    understood.  A template that fails on the string probe (it wants other turns) is left
    as it is."""
    def probe(content: Any) -> str | None:
        try:
            return compile_template(template).render(
                messages=[{"role": "user", "content": content}], add_generation_prompt=False,
                bos_token="", eos_token="", pad_token="")     # as transformers passes them
        except Exception:
            return None
    as_string = probe(_PROBE)
    return (as_string is not None and _PROBE in as_string
            and probe([{"type": "text", "text": _PROBE}]) != as_string)


def _joined_content(template: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose content is a list of text parts, joined with a newline (llama.cpp's
    ``concat_content_parts``) where the template wants strings; unchanged otherwise (what
    transformers passes, for templates that read the parts themselves)."""
    if not any(isinstance(m.get("content"), list) for m in messages) or \
            not wants_string_content(template):
        return messages
    return [{**m, "content": "\n".join(p.get("text", "") for p in m["content"]
                                        if p.get("type", "text") == "text")}
            if isinstance(m.get("content"), list) else m for m in messages]


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
           *, tools: Sequence[Mapping[str, Any]] | None = None, documents: Any = None,
           **kwargs: Any) -> str:
    """The text ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` would give.

    ``kwargs`` become template variables (``enable_thinking``, ``bos_token``, ...); transformers
    also passes the tokenizer's special-token strings, which :func:`encode_chat` does.
    """
    return _render_prepared(template, _joined_content(template, _prepare_messages(messages)),
                            add_generation_prompt, tools, documents, kwargs)


# -- assistant spans -----------------------------------------------------------------------
def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on slice equality: C-speed compares instead of a char loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sentinel(index: int, avoid: str) -> str:
    for k in range(0x1000):
        s = f"\ue000{chr(0xE100 + (index + k) % 0x1700)}\ue001"
        if s not in avoid:
            return s
    raise ChatTemplateError("no free private-use sentinel for this conversation")


def render_with_assistant_spans(
        template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
        *, end_of_turn: Sequence[str], tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Any = None, **kwargs: Any) -> tuple[str, list[Span]]:
    """The plain render and, per rendered assistant message, the ``[start, end)`` character
    range that is trained (see the module docstring): reasoning if any, content, tool calls,
    through the first of the ``end_of_turn`` strings that follows.
    """
    eots = [e for e in end_of_turn if e]
    if not eots:
        raise ChatTemplateError("end_of_turn must name at least one end-of-turn string")
    msgs = _joined_content(template, _prepare_messages(messages))
    text = _render_prepared(template, msgs, add_generation_prompt, tools, documents, kwargs)
    assistant = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if assistant and _render_prepared(template, msgs, add_generation_prompt, tools, documents,
                                      kwargs) != text:
        raise ChatTemplateError("the chat template does not render deterministically; "
                                "assistant turns cannot be located")
    avoid = text + json.dumps(msgs, ensure_ascii=False)
    spans: list[Span] = []
    for i in assistant:
        sentinel = _sentinel(i, avoid)
        probe = list(msgs)
        probe[i] = {k: v for k, v in msgs[i].items() if k not in _REASONING_FIELDS}
        probe[i]["content"] = sentinel
        ptext = _render_prepared(template, probe, add_generation_prompt, tools, documents, kwargs)
        found = ptext.count(sentinel)
        if found == 0:
            continue  # the template does not render this message: nothing of it to train
        if found > 1:
            raise ChatTemplateError(f"message {i}: the template renders an assistant message's "
                                    "content more than once; cannot tell which copy is trained")
        start = _common_prefix(text, ptext)
        end = len(text) - _common_suffix(text, ptext, min(len(text), len(ptext)) - start)
        s_at = ptext.index(sentinel)
        if not start <= s_at <= len(ptext) - (len(text) - end) - len(sentinel):
            raise ChatTemplateError(f"message {i}: the template changes text outside this "
                                    "message when its content changes; cannot locate its turn")
        inside = [e for e in eots if e in text[start:end]]
        if inside:
            raise ChatTemplateError(
                f"message {i}: end-of-turn {inside[0]!r} inside an assistant turn (literal in the "
                "content, or the template renders other turns differently when this one changes)")
        hits = [(text.find(e, end), -len(e), e) for e in eots]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            raise ChatTemplateError(f"message {i}: no end-of-turn string ({', '.join(eots)}) after "
                                    "the assistant content")
        pos, _, eot = min(hits)
        if spans and start < spans[-1][1]:
            raise ChatTemplateError(f"message {i}: assistant turns overlap or are out of order")
        spans.append((start, pos + len(eot)))
    return text, spans


# -- tokens and mask -----------------------------------------------------------------------
def spans_to_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[bool]:
    """True for each token whose character range overlaps a span.

    Overlap (not containment) so that a token straddling a span edge, which the model still
    has to produce, is never silently dropped; zero-width tokens (an added BOS) never match.
    """
    mask = []
    j = 0
    for s, e in offsets:
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        mask.append(j < len(spans) and s < e and s < spans[j][1] and e > spans[j][0])
    return mask


@dataclasses.dataclass
class ChatEncoding:
    """A rendered conversation as token ids with the per-token training mask."""

    text: str
    ids: list[int]
    mask: list[bool]
    spans: list[Span]


def encode_chat(tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                template: str | None = None, add_generation_prompt: bool = False, *,
                add_special: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                **kwargs: Any) -> ChatEncoding:
    """Render with the tokenizer's (or the given) template, tokenize, and mask assistant turns.

    ``add_special`` defaults to False as in transformers: the template writes any BOS itself.
    Each span must end on an end-of-generation token, so a template/vocabulary mismatch (an
    end-of-turn string that does not tokenize to one token) fails here, not in training.
    """
    template = template if template is not None else tokenizer.chat_template
    if not template:
        raise ChatTemplateError("the model has no tokenizer.chat_template; pass a template")
    eog = tokenizer.eog_ids
    kw = {**tokenizer.special_tokens_map(), **kwargs}
    text, spans = render_with_assistant_spans(
        template, messages, add_generation_prompt,
        end_of_turn=[tokenizer.id_to_token(i) for i in eog], tools=tools, **kw)
    ids, offsets = tokenizer.encode_with_offsets(text, add_special=add_special, parse_special=True)
    mask = spans_to_mask(offsets, spans)
    starts = [s for s, _ in offsets]
    for start, end in spans:
        last = bisect.bisect_left(starts, end) - 1  # last token starting before the span ends
        if last < 0 or ids[last] not in eog or offsets[last] != (end - len(tokenizer.id_to_token(
                ids[last])), end):
            raise ChatTemplateError(f"assistant span {text[start:end]!r} does not end on an "
                                    "end-of-generation token")
    return ChatEncoding(text=text, ids=ids, mask=mask, spans=spans)
