"""Regression test for native/patches/0001-soft-max-back-alias-safe.patch.

ggml-alloc may run SOFT_MAX_BACK in place over its second source (the softmax output y); the
upstream CPU kernel copied dy into dx before reading y, so with dx == y the gradient was
wrong (errors of ~40x the gradient's size in q/k, here and in LoRA training).  The graph is
the attention core pytrain trains through: grouped-query MUL_MAT -> SOFT_MAX with a 4-D mask
broadcast over heads -> MUL_MAT, gradients vs central finite differences in float64.
"""
import numpy as np

from pytrain.ggml import lib

from graph_harness import run

HD, T, H, HKV, B = 4, 5, 4, 2, 2


def reference(q, k, v, mask, scale=0.5):
    out = np.zeros((H * B, T, HD))
    for i in range(H * B):
        b, h = divmod(i, H)
        j = b * HKV + h // (H // HKV)
        s = q[i] @ k[j].T * scale + mask[b, 0]
        s = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (s / s.sum(-1, keepdims=True)) @ v[j].T
    return out


def test_attention_core_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(H * B, T, HD)).astype(np.float32)      # ne [HD, T, H·B]
    k = rng.normal(size=(HKV * B, T, HD)).astype(np.float32)
    v = rng.normal(size=(HKV * B, HD, T)).astype(np.float32)    # ne [T, HD, HKV·B]
    mask = np.broadcast_to(np.where(np.tril(np.ones((T, T), bool)), 0, -np.inf),
                           (B, 1, T, T)).astype(np.float32).copy()
    mask[1, 0, 3:, :3] = -np.inf                                 # a packed boundary in row 1
    seed = rng.normal(size=(H * B, T, HD))

    def build(ctx, t):
        kq = lib.ggml_reshape_4d(ctx, lib.ggml_mul_mat(ctx, t["k"], t["q"]), T, T, H, B)
        p = lib.ggml_soft_max_ext(ctx, kq, t["mask"], 0.5, 0.0)
        return lib.ggml_mul_mat(ctx, t["v"], lib.ggml_reshape_3d(ctx, p, T, T, H * B))

    out, grads = run(build, dict(q=q, k=k, v=v, mask=mask), grad_of=("q", "k", "v"),
                     seed_grad=seed)
    np.testing.assert_allclose(out, reference(q, k, v, mask), atol=1e-6)
    x = dict(q=q.astype(np.float64), k=k.astype(np.float64), v=v.astype(np.float64))
    for name, a in x.items():
        fd = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            p, m = {**x, name: a.copy()}, {**x, name: a.copy()}
            p[name][idx] += 1e-6
            m[name][idx] -= 1e-6
            fd[idx] = ((reference(p["q"], p["k"], p["v"], mask)
                        - reference(m["q"], m["k"], m["v"], mask)) * seed).sum() / 2e-6
        np.testing.assert_allclose(grads[name].reshape(a.shape), fd, atol=1e-5, rtol=1e-4,
                                   err_msg=f"gradient of {name}")
