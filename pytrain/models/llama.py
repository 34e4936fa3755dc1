"""Llama family (arch ``llama``: Llama 2/3, SmolLM2, Mistral, TinyLlama): the forward graph.

It computes what llama.cpp's src/models/llama.cpp computes, from ops that all have a backward
in ggml, on right-padded or packed batches [B, T]:

  x = token_embd[tokens]
  per layer:  h = x + attention(rms_norm(x) · attn_norm)
              x = h + ffn(rms_norm(h) · ffn_norm)
  logits = (rms_norm(x) · output_norm) @ (output | token_embd)ᵀ

  attention:  q, k, v = W_q·x (+b), W_k·x (+b), W_v·x (+b)      heads of head_dim, GQA
              q, k = rope(q), rope(k)       NORM mode: adjacent pairs (the converter permuted
                                            q/k rows so this equals HF's rotate_half)
              o = W_o · softmax(q·kᵀ/√head_dim + mask) · v

Shapes in comments are ggml ne order (fastest first): E = n_embd, T tokens, B rows, hd the head
size, H / Hkv the query / key-value heads.  ``seg`` [B, T] gives each token's sample id (-1 for
padding): attention never crosses a change of id, so packed samples stay isolated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.models import Architecture
from pytrain.formats import hf_llama
from pytrain.models.llama_config import LlamaConfig
from pytrain.models.transformer import (DecoderGraph, LoraFn, attention_input_values,
                                       softmax_attention, upload_inputs)

ROPE_NORM = 0          # ggml's default rope mode: rotate (x_2i, x_2i+1) pairs
ROPE_NEOX = 2          # rotate (x_i, x_i+hd/2): HF's rotate_half, for unpermuted q/k rows


@dataclass
class GraphInputs:
    """Tensors the host fills before each compute."""
    tokens: object                      # I32 [T·B]
    pos: object                         # I32 [T·B] position within its sample
    kq_mask: object                     # F32 [T, T, 1, B] 0 or -inf ([n_past + n, n, 1, 1] in decode)
    rows: object | None = None          # I32 [R] flat positions (t + T·b) the head runs on


class LlamaGraph(DecoderGraph):
    """Builds the forward graph from loaded weights (name → ggml tensor)."""
    rope_mode = ROPE_NORM
    inputs_class = GraphInputs          # a subclass adds its own inputs (Gemma's second mask)

    def rope(self, ctx, t, inp: GraphInputs, il: int):
        """Rotary embedding with the model's scaling (Llama 3's per-frequency factors come
        from ``rope_freqs.weight``); the same for every layer ``il``."""
        r = self.c.rope
        freqs = self.w.get("rope_freqs.weight", ggml.ffi.NULL)
        return lib.ggml_rope_ext(ctx, t, inp.pos, freqs, self.c.n_rot, self.rope_mode, r.n_ctx_orig,
                                 r.base, r.freq_scale, r.ext_factor, r.attn_factor,
                                 r.beta_fast, r.beta_slow)

    def qkv(self, ctx, il: int, x, inp: GraphInputs, N: int, lora):
        """q [hd, H, N], k and v [hd, Hkv, N] of N = T·B tokens, q and k rotated (after
        their per-head RMS norms, where the model has them: Qwen3)."""
        c, p = self.c, f"blk.{il}."
        hd, H, Hkv = c.head_dim, c.n_head, c.n_head_kv
        q = lib.ggml_reshape_3d(ctx, self.mm(ctx, p + "attn_q.weight", x, lora), hd, H, N)
        k = lib.ggml_reshape_3d(ctx, self.mm(ctx, p + "attn_k.weight", x, lora), hd, Hkv, N)
        v = lib.ggml_reshape_3d(ctx, self.mm(ctx, p + "attn_v.weight", x, lora), hd, Hkv, N)
        if c.qk_norm:                                   # rms over hd, per head and token
            q = self.norm(ctx, q, p + "attn_q_norm.weight")
            k = self.norm(ctx, k, p + "attn_k_norm.weight")
        return self.rope(ctx, q, inp, il), self.rope(ctx, k, inp, il), v

    def kq_mask(self, inp: GraphInputs, il: int):
        """The mask layer ``il`` attends with (one for every layer here)."""
        return inp.kq_mask

    @property
    def attn_scale(self) -> float:
        return 1.0 / float(np.sqrt(self.c.head_dim))

    def attention(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora,
                  cache=None, n_past: int = 0, stores: list | None = None):
        """x [E, T·B] -> attention output [E, T·B]; with a KV cache (B = 1), the T new
        tokens also attend to the n_past cached ones, and their keys/values are stored."""
        q, k, v = self.qkv(ctx, il, x, inp, T * B, lora)                  # [hd, H, T·B]
        if cache is not None:
            k, v = cache.keys_values(ctx, il, k, v, n_past, stores)       # [hd, Hkv, n_kv]
        o = softmax_attention(ctx, q, k, v, self.kq_mask(inp, il), self.attn_scale, B, T)
        return self.mm(ctx, f"blk.{il}.attn_output.weight", o, lora)     # [E, T·B]

    def decode(self, ctx, cache, n_past: int, n: int, lora: LoraFn | None = None):
        """The graph of n new tokens after the n_past in ``cache``: (logits of the last one
        [V, 1, 1], inputs, the cache stores to compute with it)."""
        inp = self.new_inputs(ctx, 1, n, n_kv=n_past + n)
        stores: list = []
        x = self.embed(ctx, inp)
        for il in range(self.c.n_layer):
            x = self.layer(ctx, il, x, inp, 1, n, lora, cache, n_past, stores)
        return self.head(ctx, x, inp, 1, n, rows=1), inp, stores

    def new_inputs(self, ctx, B: int, T: int, n_kv: int | None = None) -> GraphInputs:
        """The inputs of a [B, T] graph; with a KV cache, T new tokens see n_kv keys."""
        i32, f32 = lib.GGML_TYPE_I32, lib.GGML_TYPE_F32
        inp = self.inputs_class(
            tokens=lib.ggml_new_tensor_1d(ctx, i32, T * B),
            pos=lib.ggml_new_tensor_1d(ctx, i32, T * B),
            kq_mask=lib.ggml_new_tensor_4d(ctx, f32, n_kv or T, T, 1, B),
        )
        for t in (inp.tokens, inp.pos, inp.kq_mask):
            lib.ggml_set_input(t)
        return inp

    def layer(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora: LoraFn | None,
              cache=None, n_past: int = 0, stores: list | None = None):
        """x [E, T·B] -> the output of layer ``il`` (with ``cache``: see ``attention``)."""
        p = f"blk.{il}."
        h = self.norm(ctx, x, p + "attn_norm.weight")
        x = lib.ggml_add(ctx, x, self.attention(ctx, il, h, inp, B, T, lora, cache, n_past,
                                                stores))
        return lib.ggml_add(ctx, x, self.ffn(ctx, il, self.norm(ctx, x, p + "ffn_norm.weight"), lora))


# --------------------------------------------------------------------------- host inputs

def padded_length(n_tokens: int) -> int:
    return n_tokens


def decode_values(config: LlamaConfig, n_past: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of ``LlamaGraph.decode``: the new tokens, their positions, and a mask that lets
    new token i see every cached position and the new ones up to itself."""
    n = len(tokens)
    mask = np.zeros((n, n_past + n), np.float32)
    mask[:, n_past:] = np.where(np.tril(np.ones((n, n), bool)), 0.0, -np.inf)
    return {"tokens": np.asarray(tokens, np.int32), "pos": np.arange(n_past, n_past + n,
                                                                     dtype=np.int32),
            "kq_mask": mask[None, None]}


def input_values(config: LlamaConfig, tokens: np.ndarray, seg: np.ndarray) -> dict[str, np.ndarray]:
    """Numpy values for GraphInputs from tokens [B, T] and sample ids seg [B, T] (-1 = pad)."""
    return attention_input_values(tokens, seg)


def set_inputs(inp: GraphInputs, vals: dict[str, np.ndarray]) -> None:
    upload_inputs({"tokens": inp.tokens, "pos": inp.pos, "kq_mask": inp.kq_mask}, vals)


def layer_budget(config: LlamaConfig, T: int) -> int:
    """Nodes (and tensors) a forward graph of one layer may need, with its backward."""
    return 1024


ARCHITECTURE = Architecture(
    name="llama",
    config_from_metadata=LlamaConfig.from_metadata,
    graph=LlamaGraph,
    input_values=input_values,
    set_inputs=set_inputs,
    padded_length=padded_length,
    layer_budget=layer_budget,
    hf_layout=hf_llama.LLAMA,
    decode_values=decode_values,
)
