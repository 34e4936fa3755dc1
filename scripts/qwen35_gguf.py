"""The GGUF side of the Qwen3.5 reference fixtures (not part of the pytrain package): a
converted file read with the pinned gguf-py, our own statement of the converter's tensor
transforms checked against it, and an independent float64 forward pass over the file.

Why apart from scripts/qwen35_reference.py: none of it needs torch or transformers, only numpy
and the gguf-py of the pinned llama.cpp archive (the one whose converter wrote the files), and it
is the second reading of the format that the parity goldens rest on.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace

from scripts import native_build
from scripts.qwen35_reference import llama_cpp_dir


def pinned_gguf() -> ModuleType:
    """The archive's gguf-py imported as ``gguf``, never an installed gguf (its reader and
    dequantizers must be the converter's); later ``import gguf`` statements get this one."""
    init = llama_cpp_dir() / "gguf-py" / "gguf" / "__init__.py"
    mod = native_build.import_file("gguf", init, package=True)
    if Path(mod.__file__).resolve() != init.resolve():
        raise RuntimeError(f"a different gguf package is already imported: {mod.__file__}")
    return mod


# --------------------------------------------------------------------------------------------
# GGUF inspection and an independent layout check
# --------------------------------------------------------------------------------------------

def gguf_summary(path: Path) -> str:
    gguf = pinned_gguf()
    r = gguf.GGUFReader(str(path))
    lines = [f"# {path.name}: {path.stat().st_size} bytes, {len(r.tensors)} tensors"]
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            lines.append(f"{k} = [{len(f.data)} entries]")
            continue
        if k == "tokenizer.chat_template":
            lines.append(f"{k} = <{len(f.contents())} chars>")
            continue
        lines.append(f"{k} = {f.contents()!r}")
    for t in r.tensors:
        lines.append(f"  {t.name:32s} {t.tensor_type.name:5s} ne={list(int(x) for x in t.shape)}")
    return "\n".join(lines)


def gguf_tensors_f32(path: Path) -> dict:
    """name -> float32 numpy array in ggml order reversed (numpy shape = ne reversed)."""
    gguf = pinned_gguf()
    import numpy as np
    from gguf.quants import dequantize
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        a = dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(a, dtype=np.float32).reshape(shape)
    return out


def gguf_fields(path: Path) -> dict:
    gguf = pinned_gguf()
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def expected_gguf_tensors(model) -> dict:
    """Our own statement of the converter's transforms: HF state dict -> GGUF name -> array.

    Independent of the converter code; comparing it with a converted F32 file proves the layout
    notes in docs/formats.md (norm +1 except the DeltaNet gated norm, ssm_a = -exp(A_log), conv squeezed,
    value heads grouped -> tiled, attn_q rows per head [query | gate], tied embeddings).
    """
    import numpy as np
    cfg = model.config
    nk, nv, dk = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    dv = cfg.linear_value_head_dim
    r = nv // nk

    def tile_v(a, axis, hd):
        # grouped (k head major) -> tiled (repeat index major) along `axis` of size nv*hd
        a = np.moveaxis(a, axis, 0)
        rest = a.shape[1:]
        a = a.reshape(nk, r, hd, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(nv * hd, *rest)
        return np.moveaxis(a, 0, axis)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {}
    simple = {
        "input_layernorm.weight": ("attn_norm.weight", True),
        "post_attention_layernorm.weight": ("post_attention_norm.weight", True),
        "mlp.gate_proj.weight": ("ffn_gate.weight", False),
        "mlp.up_proj.weight": ("ffn_up.weight", False),
        "mlp.down_proj.weight": ("ffn_down.weight", False),
        "self_attn.q_proj.weight": ("attn_q.weight", False),
        "self_attn.k_proj.weight": ("attn_k.weight", False),
        "self_attn.v_proj.weight": ("attn_v.weight", False),
        "self_attn.o_proj.weight": ("attn_output.weight", False),
        "self_attn.q_norm.weight": ("attn_q_norm.weight", True),
        "self_attn.k_norm.weight": ("attn_k_norm.weight", True),
        "linear_attn.norm.weight": ("ssm_norm.weight", False),
    }
    for name, a in sd.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a + 1
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = a
        elif name.startswith("model.layers."):
            parts = name.split(".")
            bid, rest = int(parts[2]), ".".join(parts[3:])
            pre = f"blk.{bid}."
            if rest in simple:
                g, plus1 = simple[rest]
                out[pre + g] = a + 1 if plus1 else a
            elif rest == "linear_attn.in_proj_qkv.weight":
                q, k, v = a[:nk * dk], a[nk * dk:2 * nk * dk], a[2 * nk * dk:]
                out[pre + "attn_qkv.weight"] = np.concatenate([q, k, tile_v(v, 0, dv)], 0)
            elif rest == "linear_attn.in_proj_z.weight":
                out[pre + "attn_gate.weight"] = tile_v(a, 0, dv)
            elif rest == "linear_attn.in_proj_b.weight":
                out[pre + "ssm_beta.weight"] = tile_v(a, 0, 1)
            elif rest == "linear_attn.in_proj_a.weight":
                out[pre + "ssm_alpha.weight"] = tile_v(a, 0, 1)
            elif rest == "linear_attn.A_log":
                out[pre + "ssm_a"] = -np.exp(tile_v(a, 0, 1))
            elif rest == "linear_attn.dt_bias":
                out[pre + "ssm_dt.bias"] = tile_v(a, 0, 1)
            elif rest == "linear_attn.conv1d.weight":
                w = a[:, 0, :]                        # [C, K]
                qk = w[:2 * nk * dk]
                out[pre + "ssm_conv1d.weight"] = np.concatenate([qk, tile_v(w[2 * nk * dk:], 0, dv)], 0)
            elif rest == "linear_attn.out_proj.weight":
                out[pre + "ssm_out.weight"] = tile_v(a, 1, dv)
            else:
                raise RuntimeError(f"unmapped HF tensor {name}")
        else:
            raise RuntimeError(f"unmapped HF tensor {name}")
    return out


def check_gguf_layout(model, gguf_path: Path, atol: float = 0.0) -> None:
    """Assert the GGUF holds exactly the expected tensors (names, shapes, values)."""
    import numpy as np
    got = gguf_tensors_f32(gguf_path)
    exp = expected_gguf_tensors(model)
    if set(got) != set(exp):
        raise AssertionError(f"tensor names differ: only GGUF {sorted(set(got) - set(exp))}, "
                             f"only expected {sorted(set(exp) - set(got))}")
    for k in sorted(exp):
        e = exp[k]
        g = got[k].reshape(e.shape) if got[k].size == e.size else got[k]
        if g.shape != e.shape:
            raise AssertionError(f"{k}: shape {got[k].shape} vs expected {e.shape}")
        err = float(np.max(np.abs(g - e))) if e.size else 0.0
        tol = atol + (1e-6 * float(np.max(np.abs(e))) if atol == 0.0 else 0.0)
        if err > tol:
            raise AssertionError(f"{k}: max abs diff {err:.3g} > {tol:.3g}")


# --------------------------------------------------------------------------------------------
# an independent forward pass over the GGUF tensors (numpy, float64, token-by-token DeltaNet)
# --------------------------------------------------------------------------------------------

def _hparams(path: Path) -> SimpleNamespace:
    """The qwen35.* hyperparameters the forward pass reads, as the GGUF states them."""
    F = gguf_fields(path)
    a = "qwen35."
    nv = int(F[a + "ssm.time_step_rank"])
    return SimpleNamespace(
        n_layer=int(F[a + "block_count"]), eps=float(F[a + "attention.layer_norm_rms_epsilon"]),
        n_head=int(F[a + "attention.head_count"]), n_kv=int(F[a + "attention.head_count_kv"]),
        hd=int(F[a + "attention.key_length"]), n_rot=int(F[a + "rope.dimension_count"]),
        theta=float(F[a + "rope.freq_base"]), recurrent=list(F[a + "attention.recurrent_layers"]),
        dk=int(F[a + "ssm.state_size"]), nk=int(F[a + "ssm.group_count"]), nv=nv,
        dv=int(F[a + "ssm.inner_size"]) // nv, K=int(F[a + "ssm.conv_kernel"]))


def _rms(x, w, eps: float):
    import numpy as np
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    import numpy as np
    return x / (1 + np.exp(-x))


def _l2n(x):
    import numpy as np
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _rope(q, cos, sin, n_rot: int):
    """NEOX rope on the first ``n_rot`` dims of q [T, H, hd]: pairs (i, i + n_rot/2)."""
    q = q.copy()
    h = n_rot // 2
    a0, a1 = q[..., :h].copy(), q[..., h:n_rot].copy()
    q[..., :h] = a0 * cos - a1 * sin
    q[..., h:n_rot] = a1 * cos + a0 * sin
    return q


def _deltanet(h, W: dict, p: str, hp: SimpleNamespace):
    """A DeltaNet block: causal conv, then the gated delta rule as the plain recurrence (value
    head j reads key head j % n_k), the gated norm and the out projection."""
    import numpy as np
    T, nk, nv, dk, dv, K = len(h), hp.nk, hp.nv, hp.dk, hp.dv, hp.K
    qkv = h @ W[p + "attn_qkv.weight"].T
    z = (h @ W[p + "attn_gate.weight"].T).reshape(T, nv, dv)
    beta = 1 / (1 + np.exp(-(h @ W[p + "ssm_beta.weight"].T)))
    alpha = h @ W[p + "ssm_alpha.weight"].T
    g = W[p + "ssm_a"] * np.logaddexp(0, alpha + W[p + "ssm_dt.bias"])     # [T, nv], <= 0
    cw = W[p + "ssm_conv1d.weight"]                                          # [C, K]
    xp = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], 0)
    conv = sum(cw[:, k][None, :] * xp[k:k + T] for k in range(K))
    conv = _silu(conv)
    q = _l2n(conv[:, :nk * dk].reshape(T, nk, dk)) / np.sqrt(dk)
    kk = _l2n(conv[:, nk * dk:2 * nk * dk].reshape(T, nk, dk))
    v = conv[:, 2 * nk * dk:].reshape(T, nv, dv)
    o = np.zeros((T, nv, dv))
    for j in range(nv):
        kh = j % nk
        S = np.zeros((dk, dv))
        for t in range(T):
            S = S * np.exp(g[t, j])
            delta = (v[t, j] - kk[t, kh] @ S) * beta[t, j]
            S = S + np.outer(kk[t, kh], delta)
            o[t, j] = q[t, kh] @ S
    o = _rms(o, W[p + "ssm_norm.weight"], hp.eps) * _silu(z)
    return o.reshape(T, nv * dv) @ W[p + "ssm_out.weight"].T


def _attention(h, W: dict, p: str, hp: SimpleNamespace, cos, sin):
    """A gated attention block: attn_q rows per head [query | gate], q/k norms, rope, GQA
    (head h reads kv head h // (n_head / n_head_kv)), causal softmax, sigmoid gate."""
    import numpy as np
    T, n_head, n_kv, hd = len(h), hp.n_head, hp.n_kv, hp.hd
    qg = (h @ W[p + "attn_q.weight"].T).reshape(T, n_head, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ W[p + "attn_k.weight"].T).reshape(T, n_kv, hd)
    v = (h @ W[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
    q = _rope(_rms(q, W[p + "attn_q_norm.weight"], hp.eps), cos, sin, hp.n_rot)
    k = _rope(_rms(k, W[p + "attn_k_norm.weight"], hp.eps), cos, sin, hp.n_rot)
    o = np.zeros((T, n_head, hd))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for hh in range(n_head):
        kv = hh // (n_head // n_kv)
        s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
    o = o * (1 / (1 + np.exp(-gate)))
    return o.reshape(T, n_head * hd) @ W[p + "attn_output.weight"].T


def numpy_forward_gguf(path: Path, tokens: list[int]):
    """log-probabilities [T, V] computed from the GGUF alone, in GGUF order and conventions.

    A second, independent reading of the format (value head j uses key head j % n_k; conv tap 3
    is the current token; attn_q rows per head [query | gate]; NEOX rope on the first
    rope.dimension_count dims; GQA head h uses kv head h // (n_head / n_head_kv)), with the
    gated delta rule run as the plain recurrence rather than HF's chunked form.
    """
    import numpy as np
    W = {k: v.astype(np.float64) for k, v in gguf_tensors_f32(path).items()}
    hp = _hparams(path)
    T = len(tokens)
    x = W["token_embd.weight"][np.asarray(tokens)]
    pos = np.arange(T, dtype=np.float64)
    inv = hp.theta ** (-np.arange(0, hp.n_rot, 2, dtype=np.float64) / hp.n_rot)
    ang = pos[:, None] * inv[None, :]                       # [T, n_rot/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"], hp.eps)
        x = x + (_deltanet(h, W, p, hp) if hp.recurrent[il] else _attention(h, W, p, hp, cos, sin))
        h = _rms(x, W[p + "post_attention_norm.weight"], hp.eps)
        x = x + (_silu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    x = _rms(x, W["output_norm.weight"], hp.eps)
    logits = x @ W.get("output.weight", W["token_embd.weight"]).T
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
