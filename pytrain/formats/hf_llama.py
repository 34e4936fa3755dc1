"""The Llama family in Hugging Face's layout: the HF module of each GGUF tensor pytrain can adapt, and how
a LoRA pair of q or k moves between the two (``LlamaForCausalLM``, module names
``model.layers.N.<module>``; the exact inverse of llama.cpp's ``convert_lora_to_gguf.py``,
which runs the base converter's ``LlamaModel.modify_tensors`` on each pair):

    GGUF ``blk.N.<t>.weight``   HF ``model.layers.N.<module>``   converter transform
    attn_q                      self_attn.q_proj     B: rows permuted within each head
    attn_k                      self_attn.k_proj     B: rows permuted within each kv head
    attn_v / attn_output        self_attn.v_proj / o_proj            none
    ffn_gate / ffn_up / ffn_down  mlp.gate_proj / up_proj / down_proj  none

The permutation is ``LlamaModel.permute``: HF's rotary embedding rotates the two halves of a
head (``rotate_half``, NEOX order), llama.cpp's llama graph rotates adjacent pairs (NORM mode),
so the converter reorders each head's rows from ``[x_0 .. x_{d/2-1} | y_0 .. y_{d/2-1}]`` to
``[x_0, y_0, x_1, y_1, ...]``; on a LoRA pair that is a permutation of B's rows (W = B·A), exact
both ways.  It needs the head counts (a ``LlamaConfig``, or anything with ``n_head``,
``n_head_kv`` and ``head_dim``).

Qwen2, Qwen3 and Gemma 3 name their modules as Llama does; their GGUF rows are not permuted
(llama.cpp runs them with NEOX rope, HF's order), so their pairs move unchanged.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pytrain.formats.hf_layout import HFLayout, PeftAdapterError

ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
HF_MODULES = {**ATTENTION, **FFN}
PERMUTED = ("attn_q", "attn_k")


def hf_to_gguf_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """The converter's ``permute`` as an index: ``gguf[i] = hf[idx[i]]`` over the
    ``n_heads * head_dim`` output rows of q or k."""
    if head_dim % 2:
        raise PeftAdapterError(f"rope needs an even head size, got {head_dim}")
    return np.arange(n_heads * head_dim).reshape(n_heads, 2, head_dim // 2) \
        .transpose(0, 2, 1).reshape(-1)


def convert_pair(base: str, a: np.ndarray, b: np.ndarray, model_config: Any, where: str,
                 to_hf: bool) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of ``blk.N.attn_q.weight`` or ``attn_k`` from GGUF to HF order (``to_hf``) or
    back: B's rows permuted within each head."""
    short = base.split(".")[2]
    if model_config is None:
        raise PeftAdapterError(f"{where}: {base!r} has the rows llama.cpp's converter permutes for rope; "
                     f"pass model_config (the model's LlamaConfig) to convert it exactly")
    try:
        heads = int(model_config.n_head if short == "attn_q" else model_config.n_head_kv)
        hd = int(model_config.head_dim)
    except AttributeError as e:
        raise PeftAdapterError(f"{where}: model_config lacks the attention sizes ({e})") from None
    idx = hf_to_gguf_rows(heads, hd)
    if b.shape[0] != len(idx):
        raise PeftAdapterError(f"{where}: {base!r} has {b.shape[0]} outputs but the model's heads give "
                     f"{len(idx)} (an adapter for a different model?)")
    perm = np.argsort(idx) if to_hf else idx      # hf = gguf[argsort(idx)], gguf = hf[idx]
    return a, np.ascontiguousarray(b[perm])


def _plain(classes: tuple[str, ...], parent_library: str) -> HFLayout:
    """A Llama-named layout whose pairs move unchanged."""
    return HFLayout(HF_MODULES, {False: frozenset(ATTENTION)}, {}, classes, parent_library)


LLAMA = HFLayout(HF_MODULES, {False: frozenset(ATTENTION)},
                 {t: convert_pair for t in PERMUTED}, ("LlamaForCausalLM", "MistralForCausalLM"),
                 "transformers.models.llama.modeling_llama")
QWEN2 = _plain(("Qwen2ForCausalLM",), "transformers.models.qwen2.modeling_qwen2")
QWEN3 = _plain(("Qwen3ForCausalLM",), "transformers.models.qwen3.modeling_qwen3")
GEMMA3 = _plain(("Gemma3ForCausalLM",), "transformers.models.gemma3.modeling_gemma3")
