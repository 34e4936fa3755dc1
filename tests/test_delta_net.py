"""The differentiable Gated DeltaNet pieces against ggml's own fused ops (forward) and a
float64 token-by-token reference (forward and, by central finite differences, backward).

Tolerances (float32 graph): forward against the float64 reference within F32_SPREAD times
ggml's fused float32 op's own distance from it on the same input (at least 8 ulps of the
outputs: tests/bounds.py, ``f32_bound``), and against the fused op that plus its distance;
packed samples 2e-5 absolute on outputs of magnitude ~0.1-1; gradients vs finite differences
2e-4 absolute + 1e-3 relative.
"""
import numpy as np
import pytest

from pytrain.ggml import lib
from pytrain.models import delta_net as dn
from pytrain.models.transformer import sigmoid

import delta_ref
from bounds import f32_bound
from graph_harness import run


def assert_calibrated(what: str, ours, fused, ref64, measured) -> None:
    """``ours`` (float32) against the float64 reference, calibrated by the fused float32 op's
    own error on the same input; against the fused op, that bound plus its error."""
    e_fused = float(np.abs(fused - ref64).max())
    bound = f32_bound(e_fused, ref64)
    d64, dfused = float(np.abs(ours - ref64).max()), float(np.abs(ours - fused).max())
    measured(f"{what} vs float64, max |Δ|", d64, bound)
    measured(f"{what} vs the fused op, max |Δ|", dfused, bound + e_fused)
    assert d64 <= bound and dfused <= bound + e_fused, (d64, dfused, bound, e_fused)


def random_gdn(rng, B, T, H, S, Hk=None):
    Hk = Hk or H
    unit = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    q = unit(rng.normal(size=(B, T, Hk, S)))
    k = unit(rng.normal(size=(B, T, Hk, S)))
    v = rng.normal(size=(B, T, H, S))
    g = -np.log1p(np.exp(rng.normal(size=(B, T, H)))) * 0.5
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    return q, k, v, g, beta


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def build_ours(C, B, seg):
    """Our chunked rule on inputs given in ggml's layouts (numpy [B, T, H, S] = ne [S, H, T, B])."""
    vals = dn.chunk_input_values(seg, C)

    def build(ctx, t):
        ci = dn.ChunkInputs(**{name: t["_" + name] for name in vals})
        g = lib.ggml_reshape_4d(ctx, t["g"], 1, t["g"].ne[0], t["g"].ne[1], t["g"].ne[2])
        b = lib.ggml_reshape_4d(ctx, t["beta"], 1, t["beta"].ne[0], t["beta"].ne[1], t["beta"].ne[2])
        q, k = t["q"], t["k"]
        if q.ne[1] != t["v"].ne[1]:   # more value heads than key heads: tile (GGUF order)
            q = lib.ggml_repeat_4d(ctx, q, q.ne[0], t["v"].ne[1], q.ne[2], q.ne[3])
            k = lib.ggml_repeat_4d(ctx, k, k.ne[0], t["v"].ne[1], k.ne[2], k.ne[3])
        return dn.gated_delta_rule(ctx, q, k, t["v"], g, b, ci, C)
    return build, {"_" + k: v for k, v in vals.items()}


def pad_time(a, Tp):
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, Tp - a.shape[1])
    return np.pad(a, pad)


def fused(q, k, v, g, beta):
    B, T, H, S = v.shape

    def build(ctx, t):
        st = t["_state"]
        g4 = lib.ggml_reshape_4d(ctx, t["g"], 1, H, T, B)
        b4 = lib.ggml_reshape_4d(ctx, t["beta"], 1, H, T, B)
        out = lib.ggml_gated_delta_net(ctx, t["q"], t["k"], t["v"], g4, b4, st, 1)
        return lib.ggml_view_4d(ctx, out, S, H, T, B, S * 4, S * H * 4, S * H * T * 4, 0)

    inputs = dict(q=f32(q), k=f32(k), v=f32(v), g=f32(g), beta=f32(beta),
                  _state=np.zeros((B, H, S, S), np.float32))
    return run(lambda ctx, t: lib.ggml_cont(ctx, build(ctx, t)), inputs)


@pytest.mark.parametrize("T,Hk", [(1, 2), (37, 2), (64, 2), (150, 2), (150, 1)])
def test_gated_delta_rule_matches_fused_op(T, Hk, measured):
    rng = np.random.default_rng(T)
    B, H, S = 2, 2, 16
    q, k, v, g, beta = random_gdn(rng, B, T, H, S, Hk)
    Tp = dn.padded_length(T)
    C = dn.chunk_size(Tp)
    seg = np.zeros((B, Tp), np.int64)
    build, extra = build_ours(C, B, seg)
    ours = run(build, {**dict(q=f32(pad_time(q, Tp)), k=f32(pad_time(k, Tp)), v=f32(pad_time(v, Tp)),
                               g=f32(pad_time(g, Tp)), beta=f32(pad_time(beta, Tp))), **extra})[:, :T]
    ref_fused = fused(q, k, v, g, beta)
    qr, kr = (np.tile(a, (1, 1, H // Hk, 1)) for a in (q, k))
    ref64 = delta_ref.gated_delta_rule(qr, kr, v, g, beta)
    assert_calibrated(f"chunked gated delta rule T={T} Hk={Hk} (fused: GATED_DELTA_NET)", ours,
                      ref_fused, ref64, measured)


def test_packed_samples_do_not_share_state():
    """Sample ids change mid-chunk and exactly at a chunk start: each sample's outputs equal
    the sample run alone."""
    rng = np.random.default_rng(3)
    B, T, H, S, C = 2, 12, 2, 8, 4
    q, k, v, g, beta = random_gdn(rng, B, T, H, S)
    seg = np.array([[0] * 5 + [1] * 3 + [2] * 4, [0] * 12])
    build, extra = build_ours(C, B, seg)
    ours = run(build, {**dict(q=f32(q), k=f32(k), v=f32(v), g=f32(g), beta=f32(beta)), **extra})
    ref = delta_ref.gated_delta_rule(q, k, v, g, beta, seg=seg)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
    alone = delta_ref.gated_delta_rule(q[:1, 5:8], k[:1, 5:8], v[:1, 5:8], g[:1, 5:8], beta[:1, 5:8])
    np.testing.assert_allclose(ours[0, 5:8], alone[0], atol=2e-5, rtol=0)


def _loss64(inputs, seg, seed):
    """Σ seed · (the float64 reference's output), as a function of the inputs."""
    return lambda vals: (delta_ref.gated_delta_rule(*[vals[n] for n in inputs], seg=seg) * seed).sum()


def central_fd(loss, inputs: dict, name: str, h: float) -> np.ndarray:
    """d loss / d inputs[name], element by element, by float64 central differences."""
    a = inputs[name]
    fd = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        p, m = {**inputs, name: a.copy()}, {**inputs, name: a.copy()}
        p[name][idx] += h
        m[name][idx] -= h
        fd[idx] = (loss(p) - loss(m)) / (2 * h)
    return fd


def test_gated_delta_rule_gradients():
    """Three chunks of 4 with a packed boundary: every input's gradient vs central FD."""
    rng = np.random.default_rng(5)
    B, T, H, S, C = 1, 12, 2, 4, 4
    q, k, v, g, beta = random_gdn(rng, B, T, H, S)
    seg = np.array([[0] * 6 + [1] * 6])
    build, extra = build_ours(C, B, seg)
    seed = rng.normal(size=(B, T, H, S))
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    _, grads = run(build, {**{n: f32(a) for n, a in inputs.items()}, **extra},
                   grad_of=tuple(inputs), seed_grad=seed)

    loss = _loss64(inputs, seg, seed)
    for name, a in inputs.items():
        fd = central_fd(loss, inputs, name, 1e-6)
        np.testing.assert_allclose(grads[name].reshape(a.shape), fd, atol=2e-4, rtol=1e-3,
                                   err_msg=f"gradient of {name}")


# ---------------------------------------------------------------- the fused rule (patch 0020)

def build_fused(seg, H, S):
    """ggml's GATED_DELTA_NET through ``dn.fused_gated_delta_rule`` (numpy [B, T, H, S])."""
    B, T = seg.shape

    def build(ctx, t):
        g = lib.ggml_reshape_4d(ctx, t["g"], 1, H, T, B)
        b = lib.ggml_reshape_4d(ctx, t["beta"], 1, H, T, B)
        return lib.ggml_cont(ctx, dn.fused_gated_delta_rule(ctx, t["q"], t["k"], t["v"], g, b,
                                                            t["_reset"], t["_state"]))
    return build, {"_reset": dn.reset_values(seg), "_state": np.zeros((B, H, S, S), np.float32)}


def test_fused_rule_packed_samples_equal_each_sample_alone():
    """The reset (e^g = 0 at a sample's first token) clears the state exactly: each packed
    sample's outputs are bit for bit those of the sample run alone from the zero state, with a
    boundary inside a 32-token block of the backward's checkpoints and one at a block start."""
    rng = np.random.default_rng(11)
    B, T, H, S = 2, 70, 2, 16
    q, k, v, g, beta = random_gdn(rng, B, T, H, S)
    seg = np.array([[0] * 20 + [1] * 12 + [2] * 38, [0] * 32 + [1] * 38])
    build, extra = build_fused(seg, H, S)
    ins = dict(q=f32(q), k=f32(k), v=f32(v), g=f32(g), beta=f32(beta))
    packed = run(build, {**ins, **extra})
    for b, (t0, t1) in [(0, (0, 20)), (0, (20, 32)), (0, (32, 70)), (1, (0, 32)), (1, (32, 70))]:
        one = {n: np.ascontiguousarray(a[b:b + 1, t0:t1]) for n, a in ins.items()}
        build1, extra1 = build_fused(np.zeros((1, t1 - t0), np.int64), H, S)
        np.testing.assert_array_equal(packed[b, t0:t1], run(build1, {**one, **extra1}).reshape(t1 - t0, H, S),
                                      err_msg=f"row {b} tokens {t0}:{t1}")




def _calibration(inputs, seg, seed, grads_of, fd_of, what, measured):
    """Each input's gradient (as ``fd_of`` reduces it) from the fused rule against the float64
    finite differences, within f32_bound of the composed chunked rule's own distance from them
    on the same input: both are float32 evaluations of the same gradient."""
    B, T = seg.shape
    H, S = inputs["v"].shape[2], inputs["v"].shape[3]
    C = dn.chunk_size(T)
    build_c, extra_c = build_ours(C, B, seg)
    build_f, extra_f = build_fused(seg, H, S)
    ins = {n: f32(a) for n, a in inputs.items()}
    _, g_chunked = run(build_c, {**ins, **extra_c}, grad_of=tuple(inputs), seed_grad=seed)
    _, g_fused = run(build_f, {**ins, **extra_f}, grad_of=tuple(inputs), seed_grad=seed)
    for name, a in inputs.items():
        fd = fd_of(name, a)
        ours = grads_of(name, g_fused[name].reshape(a.shape))
        theirs = grads_of(name, g_chunked[name].reshape(a.shape))
        bound = f32_bound(float(np.abs(theirs - fd).max()), fd)
        d = float(np.abs(ours - fd).max())
        measured(f"{what}: d{name} vs float64 finite differences, max |Δ|", d, bound)
        assert d <= bound, (name, d, bound)


def test_fused_rule_gradients_match_finite_differences(measured):
    """Every input's gradient through GATED_DELTA_NET_BACK, element by element, on two
    checkpoint blocks with packed boundaries (inside a block and at a block start)."""
    rng = np.random.default_rng(7)
    B, T, H, S = 1, 64, 2, 4
    q, k, v, g, beta = random_gdn(rng, B, T, H, S)
    seg = np.array([[0] * 20 + [1] * 12 + [2] * 32])
    seed = rng.normal(size=(B, T, H, S))
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    loss = _loss64(inputs, seg, seed)
    _calibration(inputs, seg, seed, lambda name, gr: gr,
                 lambda name, a: central_fd(loss, inputs, name, 1e-6), "S=4", measured)


def test_fused_rule_gradients_full_width_directional(measured):
    """At a real head width (S = 64: the vector kernels' full lanes, no scalar tails) and
    three checkpoint blocks: each gradient's projection on random directions against the
    float64 central difference along them."""
    rng = np.random.default_rng(9)
    B, T, H, S = 1, 96, 2, 64
    q, k, v, g, beta = random_gdn(rng, B, T, H, S)
    seg = np.array([[0] * 50 + [1] * 46])
    seed = rng.normal(size=(B, T, H, S))
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
    loss = _loss64(inputs, seg, seed)
    dirs = {n: rng.normal(size=(3,) + a.shape) for n, a in inputs.items()}
    h = 1e-5

    def fd_of(name, a):
        return np.array([(loss({**inputs, name: a + h * d}) - loss({**inputs, name: a - h * d}))
                         / (2 * h) for d in dirs[name]])
    _calibration(inputs, seg, seed, lambda name, gr: (dirs[name] * gr).reshape(3, -1).sum(1),
                 fd_of, "S=64", measured)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_causal_conv_matches_ssm_conv(T, measured):
    rng = np.random.default_rng(T)
    B, C, K = 2, 24, 4
    x = rng.normal(size=(B, T, C))
    w = rng.normal(size=(C, K))
    seg = np.zeros((B, T), np.int64)

    def ours(ctx, t):
        return dn.causal_conv(ctx, t["x"], t["w"], t["zeros"], t["keep"])
    keep = conv_keep(seg, K)
    got = run(ours, dict(x=f32(x), w=f32(w), zeros=np.zeros((B, T + K - 1, C), np.float32),
                         keep=keep))

    def fused_conv(ctx, t):
        xt = lib.ggml_cont(ctx, lib.ggml_transpose(ctx, t["xpad"]))   # [T+K-1, C, B]
        return lib.ggml_ssm_conv(ctx, xt, t["w"])
    xpad = np.concatenate([np.zeros((B, K - 1, C)), x], axis=1)
    ref_fused = run(fused_conv, dict(xpad=f32(xpad), w=f32(w)))
    ref64 = delta_ref.causal_conv(x, w)
    assert_calibrated(f"causal conv T={T} (fused: SSM_CONV)", got, ref_fused, ref64, measured)


def conv_keep(seg, K):
    B, T = seg.shape
    keep = np.zeros((K, B, T, 1), np.float32)
    for k in range(K):
        src = np.arange(T) - (K - 1) + k
        ok = src >= 0
        keep[k][:, ok, 0] = (seg[:, src[ok]] == seg[:, ok])
    return keep


def test_causal_conv_packed_and_gradient():
    rng = np.random.default_rng(9)
    B, T, C, K = 1, 9, 3, 4
    x = rng.normal(size=(B, T, C))
    w = rng.normal(size=(C, K))
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    seed = rng.normal(size=(B, T, C))

    def ours(ctx, t):
        return dn.causal_conv(ctx, t["x"], t["w"], t["zeros"], t["keep"])
    got, grads = run(ours, dict(x=f32(x), w=f32(w), zeros=np.zeros((B, T + K - 1, C), np.float32),
                                keep=conv_keep(seg, K)), grad_of=("x",), seed_grad=seed)
    np.testing.assert_allclose(got.reshape(x.shape), delta_ref.causal_conv(x, w, seg), atol=1e-5)
    # the conv is linear in x: its gradient is the adjoint, checked exactly by FD
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = 1.0
        fd[idx] = (delta_ref.causal_conv(e, w, seg) * seed).sum()
    np.testing.assert_allclose(grads["x"].reshape(x.shape), fd, atol=1e-5)


def test_sigmoid_and_l2_norm_forward_and_gradients():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(3, 2, 8)) * 3
    seed = rng.normal(size=x.shape)
    ref_sig = 1 / (1 + np.exp(-x))
    ref_l2 = x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    for fn, ref, f64 in ((sigmoid, ref_sig, lambda a: 1 / (1 + np.exp(-a))),
                         (dn.l2_norm, ref_l2, lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6))):
        out, grads = run(lambda ctx, t: fn(ctx, t["x"]), dict(x=f32(x)), grad_of=("x",), seed_grad=seed)
        np.testing.assert_allclose(out, ref, atol=2e-6, rtol=1e-5)
        fd = np.zeros_like(x)
        h = 1e-6
        for idx in np.ndindex(x.shape):
            p, m = x.copy(), x.copy()
            p[idx] += h
            m[idx] -= h
            fd[idx] = ((f64(p) - f64(m)) * seed).sum() / (2 * h)
        np.testing.assert_allclose(grads["x"].reshape(x.shape), fd, atol=1e-5, rtol=1e-3)


def test_a_cpu_training_graph_runs_the_fused_recurrence(monkeypatch):
    """On the CPU the DeltaNet layers' training graph holds GATED_DELTA_NET and, for the
    layers under an adapter, its backward, in place of the chunked rule's many nodes;
    PYTRAIN_FUSED_RECURRENCE=0 gives the chunked rule a GPU runs."""
    from pathlib import Path

    import pytrain
    from pytrain import ggml
    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.step.graphs import GradGraph
    ops = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PYTRAIN_FUSED_RECURRENCE", fused)
        m = pytrain.load_model(Path(__file__).parent / "fixtures" / "qwen35" / "gqa-f32.gguf",
                               device="cpu", threads=2)
        try:
            ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
            g = GradGraph(m, ad, 2, 64, rows=64)
            ops[fused] = [ggml.op_name(lib.ggml_graph_node(g.graph, i))
                          for i in range(lib.ggml_graph_n_nodes(g.graph))]
            g.close()
            n_recurrent = sum(m.config.recurrent)
        finally:
            m.close()
    assert ops["1"].count("GATED_DELTA_NET") == n_recurrent
    assert ops["1"].count("GATED_DELTA_NET_BACK") >= 1
    assert "GATED_DELTA_NET" not in ops["0"] and "GATED_DELTA_NET_BACK" not in ops["0"]
    # the chunked rule: a few dozen nodes per chunk and layer, forward and backward
    assert len(ops["0"]) > len(ops["1"]) + 40 * n_recurrent, (len(ops["0"]), len(ops["1"]))
