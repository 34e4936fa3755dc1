"""Gemma 3 (arch ``gemma3``, the text models: 270M, 1B, and the text stack of 4B-27B): the
forward graph, what llama.cpp's src/models/gemma3.cpp computes, from ops with a backward:

  x = token_embd[tokens] · √E
  per layer:  h = x + post_norm_attn(attention(norm_attn(x)))
              x = h + post_norm_ffn(down(gelu_tanh(gate(h')) ⊙ up(h'))),  h' = norm_ffn(h)
  logits = norm_out(x) @ (output | token_embd)ᵀ

  attention:  q, k = rms_norm per head (attn_q_norm, attn_k_norm), then NEOX rope with the
              layer kind's base: sliding layers ``rope.freq_base_swa`` (10000 when absent, as
              llama.cpp), global layers ``rope.freq_base`` and the rope scaling; scale
              1/√head_dim (1/√(E/H) for the 62-layer 27B, as llama.cpp)
              sliding layers see the last ``attention.sliding_window`` positions of their own
              sample only (key position > query position - window); every 6th layer
              (il % 6 == 5) is global, the converter writing no pattern key

What the converter does to the weights (``Gemma3Model``): every ``*norm.weight`` is stored as
1 + w (HF's Gemma3RMSNorm multiplies by 1 + w), so ``norm`` is the plain rms_norm · w; no
q/k row permutation (NEOX rope: PEFT adapters move unpermuted).  GELU is the tanh form, as
``gelu_pytorch_tanh``: x·sigmoid(2·√(2/π)·(x + 0.044715·x³)), exactly 0.5·x·(1 + tanh(·)),
built from EXP and SOFTPLUS (GGML_OP_GELU has no backward; llama.cpp's CPU GELU also reads
an F16 table, a little coarser than this).  Final-logit soft-capping (Gemma 2) is refused.

Shapes in comments are ggml ne order (fastest first): E = n_embd, T tokens, B rows, hd the
head size, H / Hkv the query / key-value heads.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.formats import hf_llama
from pytrain.models import Architecture, llama, qwen2
from pytrain.models.llama_config import LlamaConfig, RopeParams
from pytrain.models.transformer import attention_input_values, sigmoid, upload_inputs

GLOBAL_EVERY = 6                    # llama.cpp's swa pattern for gemma3 without the key
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    arch: ClassVar[str] = "gemma3"
    n_swa: int = 0                              # 0: every layer global
    swa_layers: tuple[bool, ...] = ()           # per layer: True = sliding window
    rope_swa: RopeParams = RopeParams()         # the sliding layers' rope
    attn_scale: float = 1.0

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tensor_names: set[str] | None = None,
                      n_vocab: int | None = None, source: str = "") -> "Gemma3Config":
        base = qwen2.refuse_yarn(super().from_metadata(meta, tensor_names, n_vocab, source))
        key = lambda k, d=None: meta.get(f"gemma3.{k}", d)
        if key("final_logit_softcapping"):
            raise ValueError("gemma3.final_logit_softcapping is set: logit soft-capping (a Gemma "
                             "2 feature) is not supported")
        if key("attention.sliding_window_pattern") is not None:
            raise ValueError("gemma3.attention.sliding_window_pattern is set; pytrain knows "
                             "llama.cpp's default pattern only (every 6th layer global)")
        n_swa = int(key("attention.sliding_window", 0) or 0)
        swa = tuple(n_swa > 0 and il % GLOBAL_EVERY < GLOBAL_EVERY - 1
                    for il in range(base.n_layer))
        scale_dim = base.n_embd / base.n_head if base.n_layer == 62 else base.head_dim
        return dataclasses.replace(          # base is a Gemma3Config: from_metadata builds cls
            base, n_swa=n_swa, swa_layers=swa,
            rope_swa=RopeParams(base=float(key("rope.freq_base_swa", 10000.0))),
            attn_scale=1.0 / math.sqrt(scale_dim))

    @property
    def layer_kinds(self) -> list[str]:
        return ["sliding attention" if s else "attention" for s in self.swa_layers]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        s = super().tensor_shapes()
        for i in range(self.n_layer):
            s[f"blk.{i}.post_attention_norm.weight"] = (self.n_embd,)
            s[f"blk.{i}.post_ffw_norm.weight"] = (self.n_embd,)
        return s


@dataclasses.dataclass
class GraphInputs(llama.GraphInputs):
    kq_mask_swa: object = None          # F32 [T, T, 1, B] the causal mask within the window


def gelu_tanh(ctx, x):
    """x·sigmoid(2·√(2/π)·(x + 0.044715·x³)) = HF's gelu_pytorch_tanh."""
    x3 = lib.ggml_mul(ctx, lib.ggml_sqr(ctx, x), x)
    inner = lib.ggml_add(ctx, x, lib.ggml_scale(ctx, x3, 0.044715))
    return lib.ggml_mul(ctx, x, sigmoid(ctx, lib.ggml_scale(ctx, inner, 2.0 * SQRT_2_OVER_PI)))


class Gemma3Graph(llama.LlamaGraph):
    """The Llama graph's attention (q/k norms, grouped heads, the KV cache of generation)
    with Gemma's embedding scale, per-kind rope and mask, post-norms and GELU."""
    rope_mode = llama.ROPE_NEOX

    inputs_class = GraphInputs

    def new_inputs(self, ctx, B: int, T: int, n_kv: int | None = None) -> GraphInputs:
        inp = super().new_inputs(ctx, B, T, n_kv)
        inp.kq_mask_swa = lib.ggml_new_tensor_4d(ctx, lib.GGML_TYPE_F32, n_kv or T, T, 1, B)
        lib.ggml_set_input(inp.kq_mask_swa)
        return inp

    def embed(self, ctx, inp):
        return lib.ggml_scale(ctx, super().embed(ctx, inp), math.sqrt(self.c.n_embd))

    def rope(self, ctx, t, inp: GraphInputs, il: int):
        r = self.c.rope_swa if self.c.swa_layers[il] else self.c.rope
        return lib.ggml_rope_ext(ctx, t, inp.pos, ggml.ffi.NULL, self.c.head_dim,
                                 self.rope_mode, r.n_ctx_orig, r.base, r.freq_scale,
                                 r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)

    def kq_mask(self, inp: GraphInputs, il: int):
        return inp.kq_mask_swa if self.c.swa_layers[il] else inp.kq_mask

    @property
    def attn_scale(self) -> float:
        return self.c.attn_scale

    def gated(self, ctx, gate, up):
        return lib.ggml_mul(ctx, gelu_tanh(ctx, gate), up)

    def layer(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora,
              cache=None, n_past: int = 0, stores: list | None = None):
        p = f"blk.{il}."
        a = self.attention(ctx, il, self.norm(ctx, x, p + "attn_norm.weight"), inp, B, T, lora,
                           cache, n_past, stores)
        h = lib.ggml_add(ctx, x, self.norm(ctx, a, p + "post_attention_norm.weight"))
        f = self.ffn(ctx, il, self.norm(ctx, h, p + "ffn_norm.weight"), lora)
        return lib.ggml_add(ctx, h, self.norm(ctx, f, p + "post_ffw_norm.weight"))


def windowed(config: Gemma3Config, mask: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray
             ) -> np.ndarray:
    """``mask`` [..., q, k] with every key ``n_swa`` or more positions before its query
    hidden too (positions within the sample: q_pos [..., q], k_pos [..., k])."""
    if not config.n_swa:
        return mask
    far = (q_pos[..., :, None] - k_pos[..., None, :]) >= config.n_swa
    return np.where(far, np.float32(-np.inf), mask).astype(np.float32)


def input_values(config: Gemma3Config, tokens: np.ndarray, seg: np.ndarray) -> dict:
    """The Llama inputs, and the sliding layers' mask."""
    vals = attention_input_values(tokens, seg)
    pos = vals["pos"].reshape(tokens.shape)[:, None]                      # [B, 1, T]
    vals["kq_mask_swa"] = windowed(config, vals["kq_mask"], pos, pos)    # [B, 1, q, k]
    return vals


def decode_values(config: Gemma3Config, n_past: int, tokens: np.ndarray) -> dict:
    """``llama.decode_values`` and the window over the cached and new positions."""
    vals = llama.decode_values(config, n_past, tokens)
    q_pos = vals["pos"].astype(np.int64)
    vals["kq_mask_swa"] = windowed(config, vals["kq_mask"], q_pos,
                                   np.arange(n_past + len(tokens)))
    return vals


def set_inputs(inp: GraphInputs, vals: dict) -> None:
    upload_inputs({"tokens": inp.tokens, "pos": inp.pos, "kq_mask": inp.kq_mask,
                   "kq_mask_swa": inp.kq_mask_swa}, vals)


ARCHITECTURE = Architecture(
    name="gemma3",
    config_from_metadata=Gemma3Config.from_metadata,
    graph=Gemma3Graph,
    input_values=input_values,
    set_inputs=set_inputs,
    padded_length=llama.padded_length,
    layer_budget=llama.layer_budget,
    hf_layout=hf_llama.GEMMA3,
    decode_values=decode_values,
)
