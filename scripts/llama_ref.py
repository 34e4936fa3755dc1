"""A float64 numpy forward of llama.cpp's ``llama``, ``qwen2``, ``qwen3`` and ``gemma3`` graphs, from a GGUF
file alone.

Why: an independent reference for pytrain's ``models/llama.py`` (and the Qwen2 / Qwen3 entries
built on it) on any weight type: it reads the GGUF keys and tensors with the ``gguf`` package
(its own dequantizers), and computes what llama.cpp's src/models/llama.cpp, qwen2.cpp and
qwen3.cpp and gemma3.cpp compute, in float64: rope with the frequency scale and ``rope_freqs.weight``
factors, NORM (adjacent pairs) for llama and NEOX (the two halves of a head) for qwen2 and
qwen3, Qwen3's per-head q/k RMS norms before it, grouped-query attention, SwiGLU, optional
biases, tied or untied head; for gemma3 the embeddings scaled by sqrt(hidden), post-norms,
GELU-tanh, a sliding window on every layer but each 6th, with its own rope base.  No pytrain
code is used.  scripts/make_llama_fixtures.py uses it
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


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's GELU (GGML_GELU_FP16, ggml-cpu/vec.h): the input rounded to F16 looks up
    ``ggml_gelu_f32`` of that F16 value, stored as F16; 0 below -10 and x above 10."""
    h = x.astype(np.float32).astype(np.float16).astype(np.float64)
    y = (0.5 * h * (1 + np.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h))))
    y = y.astype(np.float32).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, y))


def forward(W: dict[str, np.ndarray], F: dict, tokens, types: dict[str, str] | None = None,
            lora: dict[str, tuple] | None = None, gelu_f16: bool = False) -> np.ndarray:
    """log-probabilities [T, V] of one sequence.  ``types`` (tensor name -> the type a
    computation keeps it in): the activations of each matmul are rounded as ggml-cpu rounds
    them for a weight of that type (``round_activations``); None: exact float64.  ``lora``
    (``blk.N.<t>.weight`` -> (A [r, in], B [out, r], scale)): adds scale·B·A·x to that
    projection, as llama.cpp's ``--lora`` does.  ``gelu_f16``: Gemma's GELU as ggml-cpu's
    table computes it (``gelu_f16_table``), else the exact tanh form."""
    tokens = list(tokens)
    net = _Net(W, F, len(tokens), types, lora, gelu_f16)
    x = W["token_embd.weight"][tokens]
    if net.gemma:
        x = x * np.sqrt(net.E)
    for i in range(net.L):
        x = net.layer(i, x)
    x = net.rms(x, W["output_norm.weight"])
    head = "output.weight" if "output.weight" in W else "token_embd.weight"
    logits = net.act(x, head) @ W[head].T
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


class _Net:
    """The sizes a GGUF's keys give, and the blocks of the forward over T tokens."""

    def __init__(self, W, F, T: int, types, lora, gelu_f16: bool):
        self.W, self.types, self.lora, self.gelu_f16 = W, types, lora, gelu_f16
        arch = self.arch = F.get("general.architecture", "llama")
        if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
            raise NotImplementedError(f"architecture {arch!r}")
        key = lambda k, d=None: F.get(f"{arch}.{k}", d)  # noqa: E731
        self.L, self.E = int(key("block_count")), int(key("embedding_length"))
        self.H = int(key("attention.head_count"))
        self.Hkv = int(key("attention.head_count_kv", self.H))
        self.hd = int(key("attention.key_length", self.E // self.H))
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        kind = key("rope.scaling.type", "linear")
        if kind not in ("none", "linear"):
            raise NotImplementedError(f"rope scaling {kind!r} (the reference has none and linear)")
        factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)) or 0.0)
        self.gemma = arch == "gemma3"
        n_swa = int(key("attention.sliding_window", 0) or 0) if self.gemma else 0
        self.swa = [n_swa > 0 and i % 6 < 5 for i in range(self.L)]   # llama.cpp's gemma3 pattern
        ff = W.get("rope_freqs.weight", np.ones(self.hd // 2))
        self.theta_global = self.angles(T, float(key("rope.freq_base", 1e4)),
                                        1.0 / factor if factor and kind == "linear" else 1.0, ff)
        self.theta_swa = self.angles(T, float(key("rope.freq_base_swa", 1e4)), 1.0, ff)
        # 1/sqrt(head_dim), as llama.cpp (the 62-layer Gemma 3 27B: 1/sqrt(E/H))
        self.att_scale = 1 / np.sqrt(self.E / self.H if self.gemma and self.L == 62 else self.hd)
        self.causal = np.triu(np.full((T, T), -np.inf), 1)
        rel = np.arange(T)[:, None] - np.arange(T)[None]
        self.window = np.where(rel >= max(n_swa, 1), -np.inf, self.causal)

    def angles(self, T: int, base: float, scale: float, ff) -> np.ndarray:
        hd = self.hd
        return np.arange(T)[:, None] * scale * base ** (-2.0 * np.arange(hd // 2) / hd) / ff

    def act(self, x, weight):
        return round_activations(x, VEC_DOT[self.types[weight]]) if self.types else x

    def rope(self, x, theta):                           # x [T, heads, hd]
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        out, half = np.empty_like(x), self.hd // 2
        if self.arch == "llama":                        # pairs (x_2i, x_2i+1)
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        else:                                           # pairs (x_i, x_i+hd/2)
            a, b = x[..., :half], x[..., half:]
            out[..., :half], out[..., half:] = a * c - b * s, a * s + b * c
        return out

    def lin(self, x, name):
        W, lora = self.W, self.lora
        y = self.act(x, name + ".weight") @ W[name + ".weight"].T
        if lora and name + ".weight" in lora:
            a, b, s = lora[name + ".weight"]
            y = y + s * (x @ np.asarray(a, np.float64).T) @ np.asarray(b, np.float64).T
        return y + W[name + ".bias"] if name + ".bias" in W else y

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def act_fn(self, g):
        if self.gemma and self.gelu_f16:
            return gelu_f16_table(g)
        if self.gemma:                                  # gelu_pytorch_tanh
            return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        return g / (1 + np.exp(-g))                     # silu

    def attention(self, i: int, h):
        p, W, T, H, Hkv, hd = f"blk.{i}.", self.W, h.shape[0], self.H, self.Hkv, self.hd
        mask, theta = (self.window, self.theta_swa) if self.swa[i] else \
            (self.causal, self.theta_global)
        q = self.lin(h, p + "attn_q").reshape(T, H, hd)
        k = self.lin(h, p + "attn_k").reshape(T, Hkv, hd)
        if p + "attn_q_norm.weight" in W:               # per head, over hd
            q, k = self.rms(q, W[p + "attn_q_norm.weight"]), self.rms(k, W[p + "attn_k_norm.weight"])
        q, k = self.rope(q, theta), self.rope(k, theta)
        v = self.lin(h, p + "attn_v").reshape(T, Hkv, hd)
        o = np.empty((T, H, hd))
        for j in range(H):
            kv = j // (H // Hkv)
            s = q[:, j] @ k[:, kv].T * self.att_scale + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, j] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        return self.lin(o.reshape(T, H * hd), p + "attn_output")

    def layer(self, i: int, x):
        p, W = f"blk.{i}.", self.W
        a = self.attention(i, self.rms(x, W[p + "attn_norm.weight"]))
        x = x + (self.rms(a, W[p + "post_attention_norm.weight"]) if self.gemma else a)
        h = self.rms(x, W[p + "ffn_norm.weight"])
        f = self.lin(self.act_fn(self.lin(h, p + "ffn_gate")) * self.lin(h, p + "ffn_up"),
                     p + "ffn_down")
        return x + (self.rms(f, W[p + "post_ffw_norm.weight"]) if self.gemma else f)


def forward_gguf(path: Path, tokens) -> np.ndarray:
    return forward(*gguf_contents(path), tokens)
