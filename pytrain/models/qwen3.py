"""Qwen3 (arch ``qwen3``, the dense models): Qwen2's graph with per-head RMS norms of q and k.

llama.cpp's src/models/qwen3.cpp: q, k, v without biases; each head of q and of k
RMS-normalised over its head_dim and scaled by ``blk.N.attn_q_norm`` / ``attn_k_norm``
[head_dim], then NEOX rope (the converter's ``Qwen3Model`` keeps HF's row order, as for
Qwen2); the head size is ``qwen3.attention.key_length`` (128 on every Qwen3, wider than
n_embd / n_head on the small ones).  ``LlamaGraph.qkv`` applies the norms when the file has
them (``LlamaConfig.qk_norm``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pytrain.formats import hf_llama
from pytrain.models import qwen2
from pytrain.models.llama_config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    arch: ClassVar[str] = "qwen3"

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], *args, **kwargs) -> "Qwen3Config":
        config = qwen2.refuse_yarn(super().from_metadata(meta, *args, **kwargs))
        if not config.qk_norm:
            raise ValueError("a qwen3 model without blk.0.attn_q_norm.weight (the per-head q/k "
                             "norms every Qwen3 has)")
        return config


ARCHITECTURE = dataclasses.replace(
    qwen2.ARCHITECTURE,
    name="qwen3",
    config_from_metadata=Qwen3Config.from_metadata,
    hf_layout=hf_llama.QWEN3,
)
