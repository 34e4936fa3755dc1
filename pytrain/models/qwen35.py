"""Qwen3.5 (arch ``qwen35``): the forward graph pytrain trains through.

It computes what llama.cpp's src/models/qwen35.cpp computes, but only from ops with a
backward in ggml (see delta_net.py), on right-padded or packed batches [B, T]:

  x = token_embd[tokens]
  per layer:  h = x + mixer(rms_norm(x) · attn_norm)          mixer = attention | DeltaNet
              x = h + ffn(rms_norm(h) · post_attention_norm)
  logits = (rms_norm(x) · output_norm) @ (output | token_embd)ᵀ

Shapes in comments are ggml ne order (fastest first): E = n_embd, T tokens, B rows.
``seg`` [B, T] gives each token's sample id (-1 for padding): attention, conv taps and the
recurrent state never cross a change of id, so packed samples stay isolated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.models import ATTENTION_TARGETS, FFN_TARGETS, Architecture
from pytrain.models import delta_net as dn
from pytrain.formats import hf_qwen35
from pytrain.models.qwen35_config import Qwen35Config
from pytrain.models.transformer import (DecoderGraph, LoraFn, attention_input_values, sigmoid,
                                       softmax_attention, upload_inputs)


@dataclass
class GraphInputs:
    """Tensors the host fills before each compute, and how to fill them."""
    tokens: object                      # I32 [T·B]
    pos: object                         # I32 [T·B] position within its sample
    kq_mask: object                     # F32 [T, T, 1, B] 0 or -inf
    conv_zeros: object | None = None    # F32 [conv_channels, T + K - 1, B]
    conv_keep: object | None = None     # F32 [1, T, B, K]
    chunks: dn.ChunkInputs | None = None       # the chunked recurrence's constants
    gdn_reset: object | None = None     # F32 [1, 1, T, B] the fused recurrence's sample resets
    gdn_state: object | None = None     # F32 [S, S, Hv, B] its zero initial state
    rows: object | None = None          # I32 [R] flat positions (t + T·b) the head runs on


class Qwen35Graph(DecoderGraph):
    """Builds the forward graph from loaded weights (name → ggml tensor)."""

    # -- layers ----------------------------------------------------------------------
    def attention(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora):
        c, p = self.c, f"blk.{il}."
        hd, H, Hkv = c.head_dim, c.n_head, c.n_head_kv
        qg = self.mm(ctx, p + "attn_q.weight", x, lora)                 # [2·hd·H, T·B]
        # per head: [query (hd) | gate (hd)]
        q = lib.ggml_view_3d(ctx, qg, hd, H, T * B, 2 * hd * 4, 2 * hd * H * 4, 0)
        gate = lib.ggml_view_3d(ctx, qg, hd, H, T * B, 2 * hd * 4, 2 * hd * H * 4, hd * 4)
        gate = lib.ggml_cont_2d(ctx, gate, hd * H, T * B)
        k = lib.ggml_reshape_3d(ctx, self.mm(ctx, p + "attn_k.weight", x, lora), hd, Hkv, T * B)
        v = lib.ggml_reshape_3d(ctx, self.mm(ctx, p + "attn_v.weight", x, lora), hd, Hkv, T * B)
        q = self.norm(ctx, lib.ggml_cont(ctx, q), p + "attn_q_norm.weight")
        k = self.norm(ctx, k, p + "attn_k_norm.weight")
        rope = lambda t: lib.ggml_rope_ext(ctx, t, inp.pos, ggml.ffi.NULL, c.n_rot,
                                           lib.GGML_ROPE_TYPE_NEOX, 0, c.rope_base, 1.0, 0.0,
                                           1.0, 0.0, 0.0)
        q, k = rope(q), rope(k)                                           # [hd, H, T·B]
        o = softmax_attention(ctx, q, k, v, inp.kq_mask, 1.0 / float(np.sqrt(hd)), B, T)
        o = lib.ggml_mul(ctx, o, sigmoid(ctx, gate))
        return self.mm(ctx, p + "attn_output.weight", o, lora)

    def delta_net(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora, C: int):
        c, p = self.c, f"blk.{il}."
        S, Hk, Hv = c.ssm_state, c.ssm_k_heads, c.ssm_v_heads
        dv = c.ssm_head_v_dim
        ch = c.conv_channels
        mixed = self.mm(ctx, p + "attn_qkv.weight", x, lora)              # [ch, T·B]
        z = self.mm(ctx, p + "attn_gate.weight", x, lora)                 # [dv·Hv, T·B]
        beta = sigmoid(ctx, self.mm(ctx, p + "ssm_beta.weight", x, lora))   # [Hv, T·B]
        alpha = self.mm(ctx, p + "ssm_alpha.weight", x, lora)
        g = lib.ggml_mul(ctx, lib.ggml_softplus(ctx, lib.ggml_add(ctx, alpha, self.w[p + "ssm_dt.bias"])),
                         self.w[p + "ssm_a"])                             # log decay <= 0
        conv = dn.causal_conv(ctx, lib.ggml_reshape_3d(ctx, mixed, ch, T, B),
                              self.w[p + "ssm_conv1d.weight"], inp.conv_zeros, inp.conv_keep)
        conv = lib.ggml_silu(ctx, conv)                                   # [ch, T, B]
        row = conv.nb[1]

        def split(n_heads, dim, offset):
            t = lib.ggml_view_4d(ctx, conv, dim, n_heads, T, B, dim * 4, row, conv.nb[2], offset)
            return lib.ggml_cont(ctx, t)
        q = dn.l2_norm(ctx, split(Hk, S, 0))
        k = dn.l2_norm(ctx, split(Hk, S, Hk * S * 4))
        v = split(Hv, dv, 2 * Hk * S * 4)
        if Hv != Hk:  # GGUF value heads are tiled over key heads: head j reads key j % Hk
            q, k = dn.tile_heads(ctx, q, Hv), dn.tile_heads(ctx, k, Hv)
        g = lib.ggml_reshape_4d(ctx, g, 1, Hv, T, B)
        beta = lib.ggml_reshape_4d(ctx, beta, 1, Hv, T, B)
        if inp.gdn_state is not None:
            o = dn.fused_gated_delta_rule(ctx, q, k, v, g, beta, inp.gdn_reset, inp.gdn_state)
        else:
            o = dn.gated_delta_rule(ctx, q, k, v, g, beta, inp.chunks, C)    # [dv, Hv, T, B]
        o = lib.ggml_mul(ctx, self.norm(ctx, o, p + "ssm_norm.weight"),
                         lib.ggml_silu(ctx, lib.ggml_reshape_4d(ctx, z, dv, Hv, T, B)))
        return self.mm(ctx, p + "ssm_out.weight", lib.ggml_reshape_2d(ctx, o, dv * Hv, T * B), lora)

    # -- the whole model -------------------------------------------------------------
    def new_inputs(self, ctx, B: int, T: int) -> GraphInputs:
        """The per-batch inputs of a [B, T] graph (T already padded: see padded_length)."""
        c = self.c
        C = dn.chunk_size(T)
        assert T % C == 0, f"T={T} is not a multiple of the chunk size {C}"
        i32, f32 = lib.GGML_TYPE_I32, lib.GGML_TYPE_F32
        inp = GraphInputs(
            tokens=lib.ggml_new_tensor_1d(ctx, i32, T * B),
            pos=lib.ggml_new_tensor_1d(ctx, i32, T * B),
            kq_mask=lib.ggml_new_tensor_4d(ctx, f32, T, T, 1, B),
        )
        if any(c.recurrent):
            inp.conv_zeros = lib.ggml_new_tensor_3d(ctx, f32, c.conv_channels, T + c.conv_kernel - 1, B)
            inp.conv_keep = lib.ggml_new_tensor_4d(ctx, f32, 1, T, B, c.conv_kernel)
            lib.ggml_set_input(inp.conv_zeros)
            lib.ggml_set_input(inp.conv_keep)
            if self.fused_recurrence and c.ssm_state == c.ssm_head_v_dim:
                inp.gdn_reset = lib.ggml_new_tensor_4d(ctx, f32, 1, 1, T, B)
                inp.gdn_state = lib.ggml_new_tensor_4d(ctx, f32, c.ssm_state, c.ssm_state,
                                                       c.ssm_v_heads, B)
                lib.ggml_set_input(inp.gdn_reset)
                lib.ggml_set_input(inp.gdn_state)
            else:
                inp.chunks = dn.new_chunk_inputs(ctx, C, T // C, B)
        for t in (inp.tokens, inp.pos, inp.kq_mask):
            lib.ggml_set_input(t)
        return inp

    def layer(self, ctx, il: int, x, inp: GraphInputs, B: int, T: int, lora: LoraFn | None):
        """x [E, T·B] -> the output of layer ``il``."""
        p = f"blk.{il}."
        h = self.norm(ctx, x, p + "attn_norm.weight")
        if self.c.recurrent[il]:
            h = self.delta_net(ctx, il, h, inp, B, T, lora, dn.chunk_size(T))
        else:
            h = self.attention(ctx, il, h, inp, B, T, lora)
        x = lib.ggml_add(ctx, x, h)
        return lib.ggml_add(ctx, x, self.ffn(ctx, il, self.norm(ctx, x, p + "post_attention_norm.weight"), lora))


# --------------------------------------------------------------------------- host inputs

def padded_length(n_tokens: int) -> int:
    return dn.padded_length(n_tokens)


def input_values(config: Qwen35Config, tokens: np.ndarray, seg: np.ndarray) -> dict[str, np.ndarray]:
    """Numpy values for GraphInputs from tokens [B, T] and sample ids seg [B, T] (-1 = pad)."""
    B, T = tokens.shape
    vals = attention_input_values(tokens, seg)
    if any(config.recurrent):
        K = config.conv_kernel
        keep = np.zeros((K, B, T, 1), np.float32)
        for k in range(K):
            src = np.arange(T) - (K - 1) + k
            ok = src >= 0
            keep[k][:, ok, 0] = seg[:, src[ok]] == seg[:, ok]
        vals["conv_keep"] = keep
        vals["conv_zeros"] = np.zeros((B, T + K - 1, config.conv_channels), np.float32)
        vals.update({"chunk_" + k: v for k, v in
                     dn.chunk_input_values(seg, dn.chunk_size(T)).items()})
        vals["gdn_reset"] = dn.reset_values(seg)
        S = config.ssm_state
        vals["gdn_state"] = np.zeros((B, config.ssm_v_heads, S, S), np.float32)
    return vals


def set_inputs(inp: GraphInputs, vals: dict[str, np.ndarray]) -> None:
    """Upload ``input_values`` into the graph inputs that the allocated graph uses."""
    targets = {"tokens": inp.tokens, "pos": inp.pos, "kq_mask": inp.kq_mask,
               "conv_keep": inp.conv_keep, "conv_zeros": inp.conv_zeros,
               "gdn_reset": inp.gdn_reset, "gdn_state": inp.gdn_state}
    if inp.chunks is not None:
        targets.update({"chunk_" + k: v for k, v in vars(inp.chunks).items()})
    upload_inputs(targets, vals)


def layer_budget(config: Qwen35Config, T: int) -> int:
    """Nodes (and tensors) a forward graph of one layer may need; its backward gets twice
    this.  Every loop of the layer's code is counted: the DeltaNet recurrence adds a few dozen
    nodes per chunk, its causal convolution six per tap (forward; nine with the backward) of
    the file's ``ssm.conv_kernel``.  An uncounted loop let a file abort the process
    (GGML_ASSERT) instead of training; tests/test_cli_messages.py checks that the budget grows
    at least as fast as the graphs in each loop."""
    n_chunks = max(1, T // dn.chunk_size(T))
    return 2048 + (400 + 60 * n_chunks) * 3 + 16 * config.conv_kernel


ARCHITECTURE = Architecture(
    name="qwen35",
    config_from_metadata=Qwen35Config.from_metadata,
    graph=Qwen35Graph,
    input_values=input_values,
    set_inputs=set_inputs,
    padded_length=padded_length,
    layer_budget=layer_budget,
    targets=ATTENTION_TARGETS + FFN_TARGETS + tuple(hf_qwen35.DELTANET),
    hf_layout=hf_qwen35.QWEN35,
)
