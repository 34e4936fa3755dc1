"""Qwen2 and Qwen2.5 (arch ``qwen2``): the Llama graph with biases on q, k and v and NEOX rope.

What llama.cpp's src/models/qwen2.cpp computes differs from ``llama.py`` in two places only:

* rope rotates the two halves of each head (NEOX mode, HF's ``rotate_half``): the converter
  (``Qwen2Model``) leaves the q/k rows in HF's order, where Llama's permutes them for NORM
  rope.  So PEFT adapters move between the two layouts unchanged: no pair conversion.
* q, k and v carry biases (``blk.N.attn_{q,k,v}.bias``); ``transformer.mm`` adds them.

Sizes come from the ``qwen2.*`` keys, read as the Llama family's (``llama_config.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pytrain.formats import hf_llama
from pytrain.models import llama
from pytrain.models.llama_config import LlamaConfig


def refuse_yarn(config: LlamaConfig) -> LlamaConfig:
    """llama.cpp applies YaRN per architecture; pytrain has it for ``llama`` only."""
    if config.rope.scaling == "yarn":
        raise ValueError(f"{config.arch}.rope.scaling.type is 'yarn', which pytrain supports "
                         f"for llama models only")
    return config


@dataclasses.dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    arch: ClassVar[str] = "qwen2"

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], *args, **kwargs) -> "Qwen2Config":
        return refuse_yarn(super().from_metadata(meta, *args, **kwargs))


class Qwen2Graph(llama.LlamaGraph):
    rope_mode = llama.ROPE_NEOX


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE,
    name="qwen2",
    config_from_metadata=Qwen2Config.from_metadata,
    graph=Qwen2Graph,
    hf_layout=hf_llama.QWEN2,
)
