"""Forward and backward of a small attention block through pytrain.ggml on the CPU backend.

The graph uses every op the training graph leans on (GET_ROWS, RMS_NORM, MUL, MUL_MAT, ROPE
NEOX on part of the head, SOFT_MAX with a causal mask, ADD, SILU, CROSS_ENTROPY_LOSS).  The
reference is a float64 numpy re-implementation; gradients are checked against central finite
differences of that reference, so neither side's autodiff is trusted.

Tolerances: forward |ggml - numpy| <= 2e-5 + 1e-4·|numpy| (ggml computes in float32); gradients
|ggml - fd| <= 1e-5 + 1e-3·max|fd| per parameter tensor (float32 backward vs float64 FD with
step 1e-6, whose own error is ~1e-9).
"""
import numpy as np
import pytest

from pytrain import ggml
from pytrain.ggml import ffi, lib

V, D, T, H, HD, NROT = 11, 16, 5, 2, 8, 4
EPS, BASE = 1e-6, 10000.0


def make_params(rng):
    return {
        "emb": rng.normal(0, 0.5, (V, D)),
        "g": rng.normal(1, 0.2, (D,)),
        "wq": rng.normal(0, 0.4, (D, D)),
        "wk": rng.normal(0, 0.4, (D, D)),
        "wv": rng.normal(0, 0.4, (D, D)),
        "wo": rng.normal(0, 0.4, (D, D)),
        "bias": rng.normal(0, 0.1, (D,)),
    }


def rope_neox(x, pos):
    """x [T, H, HD]; NEOX pairs (i, i + NROT/2) over the first NROT dims."""
    half = NROT // 2
    inv = BASE ** (-np.arange(half) * 2.0 / NROT)
    ang = pos[:, None] * inv[None, :]          # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    x0, x1 = x[..., :half], x[..., half:NROT]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:NROT] = x0 * sin + x1 * cos
    return out


def reference(p, tokens, labels):
    x = p["emb"][tokens]                                               # [T, D]
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * p["g"]
    pos = np.arange(T, dtype=np.float64)
    q = rope_neox((n @ p["wq"].T).reshape(T, H, HD), pos)
    k = rope_neox((n @ p["wk"].T).reshape(T, H, HD), pos)
    v = (n @ p["wv"].T).reshape(T, H, HD)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
    s = s + np.triu(np.full((T, T), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    a = s / s.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", a, v).reshape(T, D)
    z = o @ p["wo"].T + p["bias"]
    h = z / (1 + np.exp(-z))
    logits = h @ p["emb"].T                                            # [T, V]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    loss = -(labels * logp).sum() / T
    return logits, loss


class Block:
    """The same computation as a ggml graph with its backward."""

    def __init__(self, params):
        self.rt = ggml.Runtime("cpu", threads=2)
        self.wctx = ggml.Context(n_tensors=len(params))
        self.w = {}
        for k, v in params.items():
            t = lib.ggml_new_tensor(self.wctx.ptr, lib.GGML_TYPE_F32, v.ndim,
                                    ffi.new("int64_t[]", list(reversed(v.shape))))
            ggml.set_name(t, k)
            lib.ggml_set_param(t)
            self.w[k] = t
        self.rt.alloc(self.wctx)
        self.set_params(params)
        self.ctx = ggml.Context(n_tensors=4096, graph_size=4096, grads=True)
        c = self.ctx.ptr
        w = self.w
        self.tokens = lib.ggml_new_tensor_1d(c, lib.GGML_TYPE_I32, T)
        self.pos = lib.ggml_new_tensor_1d(c, lib.GGML_TYPE_I32, T)
        self.mask = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, T, T)
        self.labels = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, V, T)
        for t in (self.tokens, self.pos, self.mask, self.labels):
            lib.ggml_set_input(t)
        x = lib.ggml_get_rows(c, w["emb"], self.tokens)                 # ne [D, T]
        n = lib.ggml_mul(c, lib.ggml_rms_norm(c, x, EPS), w["g"])

        def heads(wt):                                                   # ne [HD, H, T]
            return lib.ggml_reshape_3d(c, lib.ggml_mul_mat(c, wt, n), HD, H, T)

        def rope(t):
            return lib.ggml_rope_ext(c, t, self.pos, ffi.NULL, NROT, lib.GGML_ROPE_TYPE_NEOX,
                                     0, BASE, 1.0, 0.0, 1.0, 0.0, 0.0)

        q = lib.ggml_permute(c, rope(heads(w["wq"])), 0, 2, 1, 3)        # ne [HD, T, H]
        k = lib.ggml_permute(c, rope(heads(w["wk"])), 0, 2, 1, 3)
        v = lib.ggml_cont(c, lib.ggml_permute(c, heads(w["wv"]), 1, 2, 0, 3))  # ne [T, HD, H]
        kq = lib.ggml_mul_mat(c, k, q)                                    # ne [Tk, Tq, H]
        a = lib.ggml_soft_max_ext(c, kq, self.mask, 1.0 / np.sqrt(HD), 0.0)
        o = lib.ggml_mul_mat(c, v, a)                                     # ne [HD, Tq, H]
        o = lib.ggml_cont_2d(c, lib.ggml_permute(c, o, 0, 2, 1, 3), D, T)
        z = lib.ggml_add(c, lib.ggml_mul_mat(c, w["wo"], o), w["bias"])
        self.logits = lib.ggml_mul_mat(c, w["emb"], lib.ggml_silu(c, z))   # ne [V, T]
        lib.ggml_set_output(self.logits)
        self.loss = lib.ggml_cross_entropy_loss(c, self.logits, self.labels)
        gf = ggml.new_graph(self.ctx, 4096, grads=True)
        lib.ggml_build_forward_expand(gf, self.loss)
        self.graph = ggml.build_backward(self.ctx, gf, self.loss)
        self.grads = {}
        for k_, t in w.items():
            g = ggml.grad_of(self.graph, t)
            lib.ggml_set_output(g)
            self.grads[k_] = g
        self.rt.alloc_graph(self.graph, self.ctx)

    def set_params(self, params):
        for k, v in params.items():
            ggml.from_numpy(self.w[k], v.astype(np.float32))

    def run(self, tokens, labels):
        ggml.from_numpy(self.tokens, tokens.astype(np.int32))
        ggml.from_numpy(self.pos, np.arange(T, dtype=np.int32))
        ggml.from_numpy(self.mask, np.triu(np.full((T, T), -np.inf, np.float32), 1))
        ggml.from_numpy(self.labels, labels.astype(np.float32))
        lib.ggml_graph_reset(self.graph)
        self.rt.compute(self.graph)
        return (ggml.to_numpy(self.logits), float(ggml.to_numpy(self.loss)[0]),
                {k: ggml.to_numpy(g) for k, g in self.grads.items()})


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(7)
    params = make_params(rng)
    tokens = rng.integers(0, V, T)
    labels = np.eye(V)[rng.integers(0, V, T)]
    block = Block(params)
    return params, tokens, labels, block


def test_forward_matches_numpy(case):
    params, tokens, labels, block = case
    logits, loss, _ = block.run(tokens, labels)
    ref_logits, ref_loss = reference(params, tokens, labels)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=2e-5)
    assert abs(loss - ref_loss) <= 2e-5 + 1e-4 * abs(ref_loss)


def test_backward_matches_finite_differences(case):
    params, tokens, labels, block = case
    _, _, grads = block.run(tokens, labels)
    h = 1e-6
    for name_, p in params.items():
        fd = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            plus = {**params, name_: p.copy()}
            minus = {**params, name_: p.copy()}
            plus[name_][idx] += h
            minus[name_][idx] -= h
            fd[idx] = (reference(plus, tokens, labels)[1] - reference(minus, tokens, labels)[1]) / (2 * h)
        g = grads[name_].reshape(p.shape)
        tol = 1e-5 + 1e-3 * np.abs(fd).max()
        err = np.abs(g - fd).max()
        assert err <= tol, f"grad of {name_}: max error {err:.3g} > {tol:.3g}"
        assert np.abs(fd).max() > 1e-4, f"grad of {name_} is trivially small"


def test_gradients_are_recomputed_not_accumulated(case):
    """Two computes with the same inputs give the same gradients (ggml_graph_reset resets)."""
    params, tokens, labels, block = case
    g1 = block.run(tokens, labels)[2]
    g2 = block.run(tokens, labels)[2]
    for k in g1:
        np.testing.assert_array_equal(g1[k], g2[k])
