"""Qwen3.5 in Hugging Face's layout: the HF module of each GGUF tensor pytrain can adapt, and
how a LoRA pair's rows or columns move between the two (``Qwen3_5ForCausalLM``, module names
``model.layers.N.<module>``; the exact inverse of llama.cpp's ``convert_lora_to_gguf.py``,
pinned source ``conversion/qwen.py``):

    GGUF ``blk.N.<t>.weight``   HF ``model.layers.N.<module>``   converter transform
    attn_q / attn_k / attn_v    self_attn.q_proj / k_proj / v_proj   none
    attn_output                 self_attn.o_proj                     none
    ffn_gate / ffn_up / ffn_down  mlp.gate_proj / up_proj / down_proj  none
    attn_qkv                    linear_attn.in_proj_qkv   B: value rows grouped → tiled
    attn_gate                   linear_attn.in_proj_z     B: rows grouped → tiled (head_v_dim)
    ssm_beta / ssm_alpha        linear_attn.in_proj_b / in_proj_a   B: rows grouped → tiled (1)
    ssm_out                     linear_attn.out_proj      A: columns grouped → tiled (head_v_dim)

The DeltaNet (``linear_attn``) transforms are the converter's ``_reorder_v_heads`` applied to a
LoRA pair: HF stores value heads grouped by key head ``[K0: v0..v{g-1}, K1: ...]``, GGUF tiled
``[v0 of K0, v0 of K1, ..., v1 of K0, ...]``; the converter permutes B's rows (outputs) or A's
columns (inputs) with ``idx = arange(n).reshape(n_k, n_v / n_k, hd).transpose(0, 1)``, and
``in_proj_qkv`` keeps its q and k rows and permutes only the value rows.  A permutation of B's
rows or A's columns is exact, so these targets convert both ways without loss; they need the
model's DeltaNet head counts (a ``Qwen35Config``, or anything with ``ssm_k_heads``,
``ssm_v_heads``, ``ssm_state``, ``ssm_inner``).  With equal key and value head counts the
permutation is the identity.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pytrain.formats.hf_layout import HFLayout, PeftAdapterError

ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
DELTANET = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
            "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
            "ssm_out": "linear_attn.out_proj"}
HF_MODULES = {**ATTENTION, **FFN, **DELTANET}
# the targets only one kind of layer has: softmax attention (recurrent False) or DeltaNet (True)
LAYER_KIND_MODULES = {False: frozenset(ATTENTION), True: frozenset(DELTANET)}


def _grouped_to_tiled(n_k: int, n_v: int, hd: int) -> np.ndarray:
    """The converter's ``_reorder_v_heads`` index: ``gguf[i] = hf[idx[i]]`` on an axis of
    ``n_v * hd`` entries."""
    if n_k <= 0 or n_v <= 0 or n_v % n_k:
        raise PeftAdapterError(f"DeltaNet value heads ({n_v}) must be a multiple of key heads ({n_k})")
    return np.arange(n_v * hd).reshape(n_k, n_v // n_k, hd).transpose(1, 0, 2).reshape(-1)


def _deltanet_dims(model_config: Any, base: str, where: str) -> tuple[int, int, int, int]:
    if model_config is None:
        raise PeftAdapterError(
            f"{where}: {base!r} is a DeltaNet tensor whose value heads llama.cpp's converter "
            f"re-orders; pass model_config (the model's Qwen35Config) to convert it exactly")
    try:
        n_k, n_v = int(model_config.ssm_k_heads), int(model_config.ssm_v_heads)
        dk, inner = int(model_config.ssm_state), int(model_config.ssm_inner)
    except AttributeError as e:
        raise PeftAdapterError(f"{where}: model_config lacks the DeltaNet sizes ({e})") from None
    if n_v <= 0 or inner % n_v:
        raise PeftAdapterError(f"{where}: inconsistent DeltaNet sizes in model_config "
                     f"(ssm_inner {inner}, ssm_v_heads {n_v})")
    return n_k, n_v, dk, inner // n_v


def convert_pair(base: str, a: np.ndarray, b: np.ndarray, model_config: Any, where: str,
                 to_hf: bool) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of the DeltaNet target ``base`` (``blk.N.<t>.weight``) from GGUF to HF order
    (``to_hf``) or back."""
    short = base.split(".")[2]
    n_k, n_v, dk, dv = _deltanet_dims(model_config, base, where)
    if short == "attn_qkv":
        idx = np.concatenate([np.arange(2 * n_k * dk),
                              2 * n_k * dk + _grouped_to_tiled(n_k, n_v, dv)])
        axis = "rows"
    elif short == "attn_gate":
        idx, axis = _grouped_to_tiled(n_k, n_v, dv), "rows"
    elif short in ("ssm_beta", "ssm_alpha"):
        idx, axis = _grouped_to_tiled(n_k, n_v, 1), "rows"
    else:                                   # ssm_out: input columns
        idx, axis = _grouped_to_tiled(n_k, n_v, dv), "cols"
    n = b.shape[0] if axis == "rows" else a.shape[1]
    if n != len(idx):
        raise PeftAdapterError(
            f"{where}: {base!r} has {n} {'outputs' if axis == 'rows' else 'inputs'} but the "
            f"model's DeltaNet sizes give {len(idx)} (an adapter for a different model?)")
    perm = np.argsort(idx) if to_hf else idx     # hf = gguf[argsort(idx)], gguf = hf[idx]
    if axis == "rows":
        return a, np.ascontiguousarray(b[perm])
    return np.ascontiguousarray(a[:, perm]), b


QWEN35 = HFLayout(HF_MODULES, LAYER_KIND_MODULES, {t: convert_pair for t in DELTANET},
                  ("Qwen3_5ForCausalLM",))
