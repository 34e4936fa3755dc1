"""Greedy generations from a few fixed prompts while training (``train.sample_every``): the
quickest way to see what the adapter is learning, as TRL's and axolotl's sample callbacks.

The prompts are ``train.sample_prompts`` (a user message each, through the chat template when
the training records went through it: chat records, conversational preference pairs; else raw
text), or the prompts of the first validation examples: their tokens up to the first target,
exactly what the model is asked there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from pytrain.run.folder import run_file

if TYPE_CHECKING:
    from pytrain.config import Config
    from pytrain.data import DataSplits
    from pytrain.models.model import Model

SAMPLES_FILE = run_file("samples.jsonl", "the samples (train.sample_every)")


@dataclass
class Prompt:
    text: str               # as shown (the decoded tokens)
    ids: list[int]


def prompts_for(cfg: "Config", model: "Model", splits: "DataSplits") -> list[Prompt]:
    """The sample prompts of a run: the configured ones, else the first validation (or
    training) examples'."""
    t, tok = cfg.train, model.tokenizer
    if t.sample_prompts:
        if splits.train_stats.templated:       # as the training records were rendered
            from pytrain.data.chat_template import encode_chat
            from pytrain.data.template_files import read_template
            template = read_template(cfg.data.chat_template, "data.chat_template")[0] \
                if cfg.data.chat_template else None
            ids = [encode_chat(tok, [{"role": "user", "content": p}], template,
                               add_generation_prompt=True).ids for p in t.sample_prompts]
        else:
            bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
            ids = [bos + tok.encode(p, add_special=False, parse_special=True)
                   for p in t.sample_prompts]
    else:
        ids = [_prompt_of(e) for e in (splits.valid or splits.train)[:t.sample_count]]
    return [Prompt(tok.decode(i, skip_special=False), list(i)) for i in ids]


def _prompt_of(example) -> list[int]:
    """An SFT example's tokens before its first target, or a preference pair's prompt."""
    if hasattr(example, "prompt"):
        return example.prompt.tolist()
    first = int(np.argmax(example.train_mask))
    return example.tokens[:max(first, 1)].tolist()


def generate(model: "Model", adapter, prompts: Sequence[Prompt], max_new_tokens: int
             ) -> list[dict]:
    """Greedy completions of ``prompts`` with the adapter as it is now."""
    out = []
    for p in prompts:
        ids = model.generate(p.ids, max_new_tokens, lora=adapter.hook)
        out.append({"prompt": p.text, "completion": model.tokenizer.decode(ids, skip_special=True),
                    "tokens": len(ids)})
    return out
