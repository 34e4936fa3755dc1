"""The blocks every decoder pytrain trains shares, as ggml ops that have a backward.

Like llama.cpp's ``llm_graph_context`` (``build_norm``, ``build_ffn``, ``build_attn``), this is
what the architecture files (``qwen35.py``, ``llama.py``) build their layers from, so a fix or a
speed-up here reaches every architecture, and each architecture file says only what is its own:

  mm      W·x (+ bias) + the adapter's (alpha/r)·B·(A·x)
  norm    rms_norm(x) · w
  ffn     down(silu(gate(x)) ⊙ up(x))
  softmax_attention   softmax(q·kᵀ/√d + mask) · v over [head dim, heads, T·B], grouped heads
  head    rms_norm(x) · output_norm, then (output | token_embd) on all or on R picked rows

Shapes in comments are ggml ne order (fastest first): E = n_embd, T tokens, B rows, hd the head
dimension, H query heads, Hkv key/value heads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pytrain import ggml
from pytrain.ggml import lib

# a LoRA hook: (ctx, base tensor name, input x) -> delta to add to W·x, or None
LoraFn = Callable[[object, str, object], object]


@dataclass
class Forward:
    logits: object                      # F32 [V, T, B], or [V, R, 1] with rows
    inputs: object                      # the architecture's graph inputs
    B: int
    T: int                              # padded length the graph runs on
    extra: dict = field(default_factory=dict)


class DecoderGraph:
    """Builds a forward graph from loaded weights (name → ggml tensor).  Subclasses give
    ``new_inputs(ctx, B, T)`` and ``layer(ctx, il, x, inp, B, T, lora)``; the config needs
    ``rms_eps``, ``n_layer``, ``n_vocab`` and ``tied_embeddings``."""

    # Recurrent layers through ggml's fused ops and their ggml-cpu backward (patch 0020) rather
    # than the composed ops every backend has: set by the model when its runtime is the CPU.
    fused_recurrence = False

    def __init__(self, config, weights: dict[str, object]):
        self.c = config
        self.w = weights

    # -- building blocks -------------------------------------------------------------
    def mm(self, ctx, name: str, x, lora: LoraFn | None):
        """W·x, plus the bias when the model has one and the adapter's contribution when
        ``name`` is adapted."""
        y = lib.ggml_mul_mat(ctx, self.w[name], x)
        bias = self.w.get(name.removesuffix(".weight") + ".bias")
        if bias is not None:
            y = lib.ggml_add(ctx, y, bias)
        if lora is not None:
            d = lora(ctx, name, x)
            if d is not None:
                y = lib.ggml_add(ctx, y, d)
        return y

    def norm(self, ctx, x, weight: str):
        return lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, self.c.rms_eps), self.w[weight])

    def gated(self, ctx, gate, up):
        """The gated FFN's inner value act(gate) ⊙ up: SwiGLU as ggml's split GLU op, which
        computes silu(gate)·up with the same float32 operations as SILU then MUL (the same
        bits), and whose backward recomputes silu(gate) instead of keeping it: one [FFN, T]
        tensor per layer fewer held for the backward (0.28 GiB at the Qwen3.5-2B shape, batch
        1 x 512).  Gemma's GELU overrides it."""
        return lib.ggml_swiglu_split(ctx, gate, up)

    def ffn(self, ctx, il: int, x, lora):
        p = f"blk.{il}."
        gate = self.mm(ctx, p + "ffn_gate.weight", x, lora)
        up = self.mm(ctx, p + "ffn_up.weight", x, lora)
        return self.mm(ctx, p + "ffn_down.weight", self.gated(ctx, gate, up), lora)

    # -- the whole model -------------------------------------------------------------
    def embed(self, ctx, inp):
        return lib.ggml_get_rows(ctx, self.w["token_embd.weight"], inp.tokens)   # [E, T·B]

    def head(self, ctx, x, inp, B: int, T: int, rows: int | None = None, row_mask=None):
        """x [E, T·B] after the last layer -> logits [V, T, B], or [V, R, 1] on the R rows of
        the I32 input ``inp.rows`` (made here).

        ``row_mask`` [1, N] (the loss's, 0 on an ignored row) multiplies the head's input, not
        its logits: an ignored row's input is then exactly 0, so whatever the loss hands back
        for that row, nothing upstream of the head receives a bit of it, and the multiply
        touches E·N values instead of V·N (the logits are the step's largest tensor)."""
        c = self.c
        x = self.norm(ctx, x, "output_norm.weight")
        if rows is not None:                                               # [E, R]
            inp.rows = lib.ggml_new_tensor_1d(ctx, lib.GGML_TYPE_I32, rows)
            lib.ggml_set_input(inp.rows)
            x = lib.ggml_get_rows(ctx, x, inp.rows)
            T, B = rows, 1
        if row_mask is not None:
            x = lib.ggml_mul(ctx, x, row_mask)                             # [E, N] ⊙ [1, N]
        head = "token_embd.weight" if c.tied_embeddings else "output.weight"
        logits = lib.ggml_mul_mat(ctx, self.w[head], x)                   # [V, T·B]
        return lib.ggml_reshape_3d(ctx, logits, c.n_vocab, T, B)

    def build(self, ctx, B: int, T: int, lora: LoraFn | None = None,
              rows: int | None = None, row_mask=None) -> Forward:
        """The forward graph for B rows of T tokens (T already padded: see padded_length).

        The LM head is the largest matmul of a small model and its [V, N] logits the largest
        tensors, so it can run on fewer positions: with ``rows``, on R positions picked per
        batch through the I32 input ``inputs.rows`` ([V, R, 1]; the loss's target positions,
        or the last position of each row for generation).  ``row_mask``: see ``head``."""
        inp = self.new_inputs(ctx, B, T)
        x = self.embed(ctx, inp)
        for il in range(self.c.n_layer):
            x = self.layer(ctx, il, x, inp, B, T, lora)
        return Forward(self.head(ctx, x, inp, B, T, rows, row_mask), inp, B, T)


def sigmoid(ctx, x):
    """sigmoid(x) = exp(-softplus(-x)): SIGMOID itself has no backward in ggml."""
    return lib.ggml_exp(ctx, lib.ggml_neg(ctx, lib.ggml_softplus(ctx, lib.ggml_neg(ctx, x))))


def softmax_attention(ctx, q, k, v, kq_mask, scale: float, B: int, T: int):
    """q [hd, H, T·B], k and v [hd, Hkv, Tk·B] (after rope and any q/k norm) -> [hd·H, T·B].

    ``kq_mask`` [Tk, T, 1, B] is 0 where a query may see a key, -inf elsewhere (causal, and
    never across a change of sample id).  Tk = T in training; with a KV cache the keys are
    the cached ones plus the T new ones."""
    hd, H, Hkv = q.ne[0], q.ne[1], k.ne[1]
    Tk = k.ne[2] // B

    def heads_last(t, n, T):                                          # -> [hd, T, n·B]
        t = lib.ggml_reshape_4d(ctx, t, hd, n, T, B)
        return lib.ggml_reshape_3d(ctx, lib.ggml_cont(ctx, lib.ggml_permute(ctx, t, 0, 2, 1, 3)),
                                   hd, T, n * B)
    q3, k3 = heads_last(q, H, T), heads_last(k, Hkv, Tk)
    # B merged behind the heads keeps MUL_MAT's grouped broadcast (q head h reads kv head
    # h // (H/Hkv), as HF's repeat_kv) inside 3-D tensors, which its backward supports
    kq = lib.ggml_mul_mat(ctx, k3, q3)                                # [Tk, T, H·B]
    kq = lib.ggml_reshape_4d(ctx, kq, Tk, T, H, B)
    probs = lib.ggml_soft_max_ext(ctx, kq, kq_mask, scale, 0.0)
    probs = lib.ggml_reshape_3d(ctx, probs, Tk, T, H * B)
    vT = lib.ggml_reshape_4d(ctx, v, hd, Hkv, Tk, B)
    vT = lib.ggml_reshape_3d(ctx, lib.ggml_cont(ctx, lib.ggml_permute(ctx, vT, 1, 2, 0, 3)),
                             Tk, hd, Hkv * B)                        # [Tk, hd, Hkv·B]
    o = lib.ggml_mul_mat(ctx, vT, probs)                              # [hd, T, H·B]
    o = lib.ggml_reshape_4d(ctx, o, hd, T, H, B)
    return lib.ggml_cont_2d(ctx, lib.ggml_permute(ctx, o, 0, 2, 1, 3), hd * H, T * B)


class KVCache:
    """Keys and values of the tokens generated so far, per layer, for one sequence: F32
    [hd, Hkv, n_ctx] tensors in a buffer of the runtime's primary backend.  Generation then
    computes each new token's layers once instead of the whole prefix again."""

    def __init__(self, runtime, n_layer: int, head_dim: int, n_head_kv: int, n_ctx: int):
        self.runtime, self.n_ctx = runtime, n_ctx
        self.ctx = ggml.Context(n_tensors=2 * n_layer)
        f32 = lib.GGML_TYPE_F32
        self.k = [lib.ggml_new_tensor_3d(self.ctx.ptr, f32, head_dim, n_head_kv, n_ctx)
                  for _ in range(n_layer)]
        self.v = [lib.ggml_new_tensor_3d(self.ctx.ptr, f32, head_dim, n_head_kv, n_ctx)
                  for _ in range(n_layer)]
        try:
            self.buffer = runtime.alloc(self.ctx)
        except BaseException:
            self.ctx.close()
            raise

    def keys_values(self, ctx, il: int, k, v, n_past: int, stores: list):
        """The cached keys/values of layer ``il`` followed by the new ``k``, ``v`` [hd, Hkv,
        n]; the copies that store the new ones (positions n_past...) go to ``stores``, for the
        caller to add to the graph."""
        out = []
        for cache, new in ((self.k[il], k), (self.v[il], v)):
            n = new.ne[2]
            if n_past + n > self.n_ctx:
                raise ValueError(f"KV cache of {self.n_ctx} positions is full")
            dst = lib.ggml_view_3d(ctx, cache, cache.ne[0], cache.ne[1], n, cache.nb[1],
                                   cache.nb[2], n_past * cache.nb[2])
            stores.append(lib.ggml_cpy(ctx, new, dst))
            if n_past == 0:
                out.append(new)
            else:
                past = lib.ggml_view_3d(ctx, cache, cache.ne[0], cache.ne[1], n_past,
                                        cache.nb[1], cache.nb[2], 0)
                out.append(lib.ggml_concat(ctx, past, new, 2))
        return out

    def close(self) -> None:
        try:
            if self.buffer is not None:
                self.runtime.free(self.buffer)
        except ValueError:          # the runtime was closed first and freed it already
            pass
        finally:
            self.buffer = None
            self.ctx.close()


# --------------------------------------------------------------------------- host inputs

def attention_input_values(tokens: np.ndarray, seg: np.ndarray) -> dict[str, np.ndarray]:
    """Token ids, positions within each sample and the causal same-sample mask, from tokens
    [B, T] and sample ids seg [B, T] (-1 = padding)."""
    B, T = tokens.shape
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        start = 0
        for t in range(T):
            if t > 0 and seg[b, t] != seg[b, t - 1]:
                start = t
            pos[b, t] = t - start
    same = seg[:, :, None] == seg[:, None, :]                            # [B, q, k]
    causal = np.tril(np.ones((T, T), bool))
    mask = np.where(same & causal, 0.0, -np.inf).astype(np.float32)[:, None]   # [B, 1, q, k]
    return {"tokens": tokens.astype(np.int32).reshape(-1), "pos": pos.reshape(-1),
            "kq_mask": mask}


def upload_inputs(targets: dict[str, object], vals: dict[str, np.ndarray]) -> None:
    """Upload each value into its graph input, for the inputs the allocated graph uses (a
    graph that never reads an input, e.g. the layers above the last adapter, leaves it
    unallocated)."""
    for name, t in targets.items():
        if t is not None and ggml.is_allocated(t):
            ggml.from_numpy(t, vals[name])
