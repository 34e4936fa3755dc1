"""A float64 numpy forward of llama.cpp's ``llama``, ``qwen2`` and ``qwen3`` graphs, from a GGUF
file alone.

Why: an independent reference for pytrain's ``models/llama.py`` (and the Qwen2 / Qwen3 entries
built on it) on any weight type: it reads the GGUF keys and tensors with the ``gguf`` package
(its own dequantizers), and computes what llama.cpp's src/models/llama.cpp, qwen2.cpp and
qwen3.cpp compute, in float64: rope with the frequency scale and ``rope_freqs.weight``
factors, NORM (adjacent pairs) for llama and NEOX (the two halves of a head) for qwen2 and
qwen3, Qwen3's per-head q/k RMS norms before it, grouped-query attention, SwiGLU, optional
biases, tied or untied head.  No pytrain code is used.  scripts/make_llama_fixtures.py uses it
for the fixtures' float64 goldens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def gguf_contents(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors as float64 in numpy order, metadata) of a GGUF."""
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(dequantize(t.data, t.tensor_type), np.float64)
               .reshape([int(n) for n in reversed(t.shape)]) for t in r.tensors}
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return tensors, fields


def gguf_types(path: Path) -> dict[str, str]:
    """Each tensor's type name in the file ("F32", "Q4_K", ...)."""
    import gguf
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


# ggml-cpu's MUL_MAT rounds its activations to the weight type's "vec_dot type" before the dot
# products (``type_traits_cpu[type].vec_dot_type``, ggml-cpu.c): float32 weights use them as
# they are, F16 weights round them to F16, the 32-blocks round them to Q8_0 (Q8_1 for the
# types with a block minimum, the same values), the K-quants to Q8_K (blocks of 256).  That
# rounding, and nothing else, is what keeping a weight type adds to the function.
VEC_DOT = {"F32": None, "F16": "F16", "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0",
           "Q4_1": "Q8_0", "Q5_1": "Q8_0", "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K",
           "Q5_K": "Q8_K", "Q6_K": "Q8_K"}


def round_activations(x: np.ndarray, vec_dot: str | None) -> np.ndarray:
    """x [rows, n] as ggml-cpu's quantize_row_<vec_dot>_ref stores it, back in float64."""
    if vec_dot is None:
        return x
    if vec_dot == "F16":
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    x32 = x.astype(np.float32)
    if vec_dot == "Q8_0":                 # d = amax/127 (kept as F16); q = round(x / d)
        b = x32.reshape(*x.shape[:-1], -1, 32)
        d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
        q = np.round(b * inv)             # roundf: ties away from zero; ties have measure 0
        return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    if vec_dot == "Q8_K":                 # iscale = -127 / (the value of largest |x|)
        b = x32.reshape(*x.shape[:-1], -1, 256)
        at = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)
        iscale = np.divide(np.float32(-127), at, out=np.zeros_like(at), where=at != 0)
        q = np.minimum(127, np.round(iscale * b))
        d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
        return (q.astype(np.float64) * d).reshape(x.shape)
    raise ValueError(vec_dot)


def forward(W: dict[str, np.ndarray], F: dict, tokens, types: dict[str, str] | None = None
            ) -> np.ndarray:
    """log-probabilities [T, V] of one sequence.  ``types`` (tensor name -> the type a
    computation keeps it in): the activations of each matmul are rounded as ggml-cpu rounds
    them for a weight of that type (``round_activations``); None: exact float64."""
    def act(x, weight):
        return round_activations(x, VEC_DOT[types[weight]]) if types else x

    arch = F.get("general.architecture", "llama")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise NotImplementedError(f"architecture {arch!r}")
    key = lambda k, d=None: F.get(f"{arch}.{k}", d)
    L, E = int(key("block_count")), int(key("embedding_length"))
    H = int(key("attention.head_count"))
    Hkv = int(key("attention.head_count_kv", H))
    hd = int(key("attention.key_length", E // H))
    eps = float(key("attention.layer_norm_rms_epsilon"))
    base = float(key("rope.freq_base", 1e4))
    kind = key("rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise NotImplementedError(f"rope scaling {kind!r} (the reference has none and linear)")
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)) or 0.0)
    scale = 1.0 / factor if factor and kind == "linear" else 1.0
    ff = W.get("rope_freqs.weight", np.ones(hd // 2))
    tokens = list(tokens)
    T = len(tokens)
    theta = np.arange(T)[:, None] * scale * base ** (-2.0 * np.arange(hd // 2) / hd) / ff

    def rope(x):                                        # x [T, heads, hd]
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        out = np.empty_like(x)
        if arch == "llama":                             # pairs (x_2i, x_2i+1)
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        else:                                           # pairs (x_i, x_i+hd/2)
            a, b = x[..., :hd // 2], x[..., hd // 2:]
            out[..., :hd // 2], out[..., hd // 2:] = a * c - b * s, a * s + b * c
        return out

    def lin(x, name):
        y = act(x, name + ".weight") @ W[name + ".weight"].T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    x = W["token_embd.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"])
        q = lin(h, p + "attn_q").reshape(T, H, hd)
        k = lin(h, p + "attn_k").reshape(T, Hkv, hd)
        if p + "attn_q_norm.weight" in W:               # per head, over hd
            q, k = rms(q, W[p + "attn_q_norm.weight"]), rms(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        v = lin(h, p + "attn_v").reshape(T, Hkv, hd)
        o = np.empty((T, H, hd))
        for j in range(H):
            kv = j // (H // Hkv)
            s = q[:, j] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + lin(o.reshape(T, H * hd), p + "attn_output")
        h = rms(x, W[p + "ffn_norm.weight"])
        g = lin(h, p + "ffn_gate")
        x = x + lin(g / (1 + np.exp(-g)) * lin(h, p + "ffn_up"), p + "ffn_down")
    x = rms(x, W["output_norm.weight"])
    head = "output.weight" if "output.weight" in W else "token_embd.weight"
    logits = act(x, head) @ W[head].T
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def forward_gguf(path: Path, tokens) -> np.ndarray:
    return forward(*gguf_contents(path), tokens)
