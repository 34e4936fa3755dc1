#!/usr/bin/env python3
"""Render Qwen3.5's chat template through transformers itself and save the texts as goldens.

pytrain re-implements transformers' chat-template rendering (pytrain/data/chat_template.py) so that
training needs neither transformers nor torch; these goldens are what keeps the two identical.
Run it in a throwaway environment, not the project's:

    python3 -m venv /opt/tplenv
    /opt/tplenv/bin/pip install transformers==5.23.0 jinja2 tokenizers
    python native/build.py --source-only          # extracts the pinned llama.cpp source
    /opt/tplenv/bin/python -m scripts.make_chat_template_golden

It goes through ``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)``, the path users
hit, with a one-token dummy vocabulary: rendering does not depend on the vocabulary.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from scripts import native_build

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat_template_golden.json"
TEMPLATE_REL = "models/templates/Qwen3.5-4B.jinja"

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville (°C) <b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def cases() -> list[dict]:
    u = lambda text: {"role": "user", "content": text}  # noqa: E731
    a = lambda text, **kw: {"role": "assistant", "content": text, **kw}  # noqa: E731
    pairs = [u("What is 2+2?"), a("4."), u("And 3+3?"), a("6."), u("Name a prime."), a("7 is prime.")]
    return [
        {"name": "single_turn", "messages": [u("Hello, who are you?"), a("I am a helpful assistant.")]},
        {"name": "system_prompt",
         "messages": [SYSTEM, u("Capital of France?"), a("Paris.")]},
        {"name": "multi_turn", "messages": [SYSTEM, *pairs]},
        {"name": "multi_turn_no_system", "messages": pairs},
        {"name": "generation_prompt", "messages": [SYSTEM, u("Capital of France?")],
         "kwargs": {"add_generation_prompt": True}},
        {"name": "generation_prompt_off", "messages": [SYSTEM, u("Capital of France?")],
         "kwargs": {"add_generation_prompt": False}},
        {"name": "generation_prompt_after_history", "messages": pairs[:3],
         "kwargs": {"add_generation_prompt": True}},
        {"name": "enable_thinking_false", "messages": [u("Capital of France?")],
         "kwargs": {"add_generation_prompt": True, "enable_thinking": False}},
        {"name": "enable_thinking_false_with_answer", "messages": [u("Hi"), a("Hello!")],
         "kwargs": {"enable_thinking": False}},
        {"name": "reasoning_content",
         "messages": [u("Is 91 prime?"),
                      a("No, 91 = 7 x 13.", reasoning_content="91 / 7 = 13, so it is composite.")]},
        {"name": "reasoning_multi_turn",
         "messages": [u("Is 91 prime?"), a("No.", reasoning_content="91 = 7 * 13."),
                      u("Is 97 prime?"), a("Yes.", reasoning_content="No divisor up to 9.")]},
        {"name": "reasoning_alias_field",
         "messages": [u("Is 91 prime?"), a("No.", reasoning="  91 = 7 * 13.\n")]},
        {"name": "inline_think",
         "messages": [u("Is 91 prime?"), a("<think>\n91 = 7 * 13.\n</think>\n\nNo, it is not.")]},
        {"name": "whitespace_and_unicode",
         "messages": [u("  Cafe\u0301 or café?\n"), a("\n  Both spell cafe\u0301; NFC is not applied.  \n")]},
        {"name": "content_parts",
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                                   {"type": "text", "text": "Part two."}]},
                      a("Got both parts.")]},
        {"name": "tools",
         "messages": [u("Weather in Paris?"),
                      a(None, tool_calls=[{"type": "function", "function": {
                          "name": "get_weather",
                          "arguments": {"city": "Paris", "days": 2, "opts": {"unit": "°C", "list": [1, 2]}}}}]),
                      {"role": "tool", "content": "{\"temp\": 21}"},
                      a("It is 21 °C in Paris.")],
         "kwargs": {"tools": [WEATHER_TOOL]}},
    ]


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    import transformers
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    template_path = native_build.load().llama_cpp_dir() / TEMPLATE_REL
    if not template_path.is_file():
        print(f"{template_path} missing: run `python native/build.py --source-only` first", file=sys.stderr)
        return 1
    template = template_path.read_text(encoding="utf-8")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=template)

    out = []
    for case in cases():
        kwargs = dict(case.get("kwargs", {}))
        text = tok.apply_chat_template(case["messages"], tokenize=False, **kwargs)
        out.append({"name": case["name"], "messages": case["messages"], "kwargs": kwargs,
                    "expected": text})
    doc = {
        "generator": "scripts/make_chat_template_golden.py",
        "transformers_version": transformers.__version__,
        "template": TEMPLATE_REL,
        "template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "cases": out,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} cases to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
