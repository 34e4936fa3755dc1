"""Gated DeltaNet pieces with a backward pass.

llama.cpp computes these with fused ops (GATED_DELTA_NET, SSM_CONV) or with ops that have no
backward (CUMSUM, TRI, SOLVE_TRI, PAD, CONCAT, L2_NORM, SIGMOID).  LoRA sits in the attention
layers, under DeltaNet layers, so gradients must flow through the recurrence.  Two ways:

- ``fused_gated_delta_rule``: ggml's own GATED_DELTA_NET, whose backward
  (GATED_DELTA_NET_BACK) pytrain's patch 0020 adds to ggml-cpu only.  One node each way per
  layer: on the CPU it is the fast path.
- ``gated_delta_rule``: the chunked rule made of MUL_MAT, MUL, ADD/SUB, EXP, SOFTPLUS, ACC,
  views and repeats, whose backward ggml already has and whose kernels ggml-cuda and
  ggml-vulkan have too (DIAG_MASK_INF's backward, DIAG_MASK_ZERO, has none on CUDA): the path
  for a GPU, where an op left to the CPU would copy every layer's activations across.

Forward results are tested against the fused ops, gradients against finite differences.

Layouts (ggml ne order, fastest first):
  per-token features  [d, H, T, B]
  chunked             [d, C, NC, B*H]  (T = C·NC; dim 3 is b + B·h so host masks of shape
                                        [.., NC, B] broadcast over heads)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytrain.ggml import lib

# The Neumann product in _neumann_inverse squares L up to L^(C/2), whose entries grow with C
# before they cancel: on the untied F32 fixture (T = 100) C = 64 put pytrain 1.2e-4 off the
# float64 log-probabilities, C = 32 6.0e-5, about HF float32's own error there
# (bench_results/parity.md).
CHUNK = 32


def chunk_size(n_tokens: int) -> int:
    """The chunk length for a (padded) sequence length: whole chunks of CHUNK, or one chunk."""
    return CHUNK if n_tokens >= CHUNK else n_tokens


def padded_length(n_tokens: int) -> int:
    return n_tokens if n_tokens <= CHUNK else -(-n_tokens // CHUNK) * CHUNK


# ggml-cuda runs REPEAT_BACK (the backward of REPEAT, and of a broadcast ADD/MUL for the
# broadcast operand) only while its gradient has ne2·ne3 <= 32768; with up to 65536 tokens per
# micro-batch in dims 2-3 that fails.  Broadcasts that need a gradient are therefore done on
# views whose dims 2-3 hold nothing the batch grows with.

def mul_rows(ctx, a, b):
    """a [d, ...] times b [1, ...] broadcast along dim 0, on 2-D views (see above)."""
    n = lib.ggml_nelements(b)
    out = lib.ggml_mul(ctx, lib.ggml_reshape_2d(ctx, a, a.ne[0], n), lib.ggml_reshape_2d(ctx, b, 1, n))
    return lib.ggml_reshape_4d(ctx, out, a.ne[0], a.ne[1], a.ne[2], a.ne[3])


def tile_heads(ctx, x, n_heads: int):
    """[d, h, T, B] -> [d, n_heads, T, B] with head j = head j % h (GGUF's tiled order).  The
    copies go to dim 2 first and are moved in by a permute, so REPEAT's backward sums over a
    dim-2 of n_heads / h (see above)."""
    d, h, T, B = (int(x.ne[i]) for i in range(4))
    flat = lib.ggml_reshape_4d(ctx, x, d * h, T * B, 1, 1)
    rep = lib.ggml_repeat_4d(ctx, flat, d * h, T * B, n_heads // h, 1)     # [d·h, N, r]
    rep = lib.ggml_reshape_4d(ctx, rep, d * h, T * B, n_heads // h, 1)   # backward: contiguous
    moved = lib.ggml_cont(ctx, lib.ggml_permute(ctx, rep, 0, 2, 1, 3))   # [d·h, r, N]
    return lib.ggml_reshape_4d(ctx, moved, d, n_heads, T, B)


def l2_norm(ctx, x, eps: float = 1e-6):
    """x · rsqrt(Σx² + eps) over dim 0, as HF's Qwen3.5 does (ggml_l2_norm divides by
    max(‖x‖, eps) instead, and has no backward)."""
    ss = lib.ggml_sum_rows(ctx, lib.ggml_sqr(ctx, x))                 # [1, ...]
    # rsqrt as exp(-log(.)/2): DIV's backward cannot broadcast its divisor, MUL's can
    inv = lib.ggml_exp(ctx, lib.ggml_scale(ctx, lib.ggml_log(ctx, lib.ggml_scale_bias(
        ctx, ss, 1.0, eps)), -0.5))
    return mul_rows(ctx, x, inv)


def causal_conv(ctx, x, w, zeros, seg_keep):
    """Depthwise causal conv: out[c, t] = Σ_k w[c, k] · x[c, t - (K-1) + k].

    x:        [C, T, B] activations
    w:        [K, C] the GGUF conv weight (frozen)
    zeros:    [C, T + K - 1, B] a zero-filled input, the padded canvas
    seg_keep: [1, T, B, K] host mask: 1 where tap k of token t reads a token of the same
              sample (0 across a packed-sample boundary or before the row start)
    """
    K = int(w.ne[0])
    C, T, B = int(x.ne[0]), int(x.ne[1]), int(x.ne[2])
    xp = lib.ggml_acc(ctx, zeros, x, zeros.nb[1], zeros.nb[2], zeros.nb[3],
                      (K - 1) * zeros.nb[1])                            # [C, T+K-1, B]
    wt = lib.ggml_cont(ctx, lib.ggml_transpose(ctx, w))                 # [C, K]
    out = None
    for k in range(K):
        xk = lib.ggml_view_3d(ctx, xp, C, T, B, xp.nb[1], xp.nb[2], k * xp.nb[1])
        wk = lib.ggml_view_1d(ctx, wt, C, k * wt.nb[1])
        mk = lib.ggml_view_3d(ctx, seg_keep, 1, T, B, seg_keep.nb[1], seg_keep.nb[2],
                              k * seg_keep.nb[3])
        term = lib.ggml_mul(ctx, lib.ggml_mul(ctx, xk, wk), mk)
        out = term if out is None else lib.ggml_add(ctx, out, term)
    return out


@dataclass
class ChunkInputs:
    """Host-made constants of one chunked recurrence (shared by every DeltaNet layer)."""
    tri: object       # [C, C]       1 where k <= i (cumsum as a matmul)
    eye: object       # [C, C]       identity
    m_incl: object    # [C, C, NC, B] 1 where j <= i and same sample
    m_strict: object  # [C, C, NC, B] 1 where j <  i and same sample
    carry: object     # [1, C, NC, B] 1 where the token continues the sample of the previous chunk


def new_chunk_inputs(ctx, C: int, NC: int, B: int) -> ChunkInputs:
    f32 = lib.GGML_TYPE_F32
    t = ChunkInputs(
        tri=lib.ggml_new_tensor_2d(ctx, f32, C, C),
        eye=lib.ggml_new_tensor_2d(ctx, f32, C, C),
        m_incl=lib.ggml_new_tensor_4d(ctx, f32, C, C, NC, B),
        m_strict=lib.ggml_new_tensor_4d(ctx, f32, C, C, NC, B),
        carry=lib.ggml_new_tensor_4d(ctx, f32, 1, C, NC, B),
    )
    for x in vars(t).values():
        lib.ggml_set_input(x)
    return t


def chunk_input_values(seg: np.ndarray, C: int) -> dict[str, np.ndarray]:
    """Numpy values for ChunkInputs from per-token sample ids ``seg`` [B, T] (T = C·NC)."""
    B, T = seg.shape
    NC = T // C
    s = seg.reshape(B, NC, C)
    same = s[:, :, :, None] == s[:, :, None, :]                       # [B, NC, i, j]
    causal = np.tril(np.ones((C, C), bool))
    m_incl = same & causal
    m_strict = same & np.tril(np.ones((C, C), bool), -1)
    prev = np.concatenate([np.full((B, 1), np.iinfo(np.int64).min), s[:, :-1, -1]], axis=1)
    carry = (s == prev[:, :, None])                                    # [B, NC, C]
    carry[:, 0, :] = False                                             # zero initial state
    # numpy order is the reverse of ggml ne: [B, NC, i(C), j(C)] -> ne [j, i, NC, B]
    return {
        "tri": np.tril(np.ones((C, C), np.float32)),                   # ne [k, i]: k <= i
        "eye": np.eye(C, dtype=np.float32),
        "m_incl": m_incl.astype(np.float32),
        "m_strict": m_strict.astype(np.float32),
        "carry": carry.astype(np.float32)[:, :, :, None],
    }


def to_chunks(ctx, x, C: int):
    """[d, H, T, B] -> [d, C, NC, B*H] (contiguous)."""
    d, H, T, B = (int(x.ne[i]) for i in range(4))
    x = lib.ggml_reshape_4d(ctx, x, d, H, T, B)    # PERMUTE's gradient reaches x made contiguous
    y = lib.ggml_cont(ctx, lib.ggml_permute(ctx, x, 0, 3, 1, 2))       # [d, T, B, H]
    return lib.ggml_reshape_4d(ctx, y, d, C, T // C, B * H)


def from_chunks(ctx, y, H: int, B: int):
    """[d, C, NC, B*H] -> [d, H, T, B] (contiguous)."""
    d, C, NC = int(y.ne[0]), int(y.ne[1]), int(y.ne[2])
    y = lib.ggml_reshape_4d(ctx, y, d, C * NC, B, H)                   # [d, T, B, H]
    return lib.ggml_cont(ctx, lib.ggml_permute(ctx, y, 0, 2, 3, 1))


def transpose(ctx, x):
    """cont(transpose(x)) whose backward hands x a contiguous gradient: TRANSPOSE's backward
    transposes the gradient back, and most ops' backward (MUL's among them) reject a
    non-contiguous gradient; RESHAPE's backward makes it contiguous first."""
    x = lib.ggml_reshape_4d(ctx, x, x.ne[0], x.ne[1], x.ne[2], x.ne[3])
    return lib.ggml_cont(ctx, lib.ggml_transpose(ctx, x))


def _chunk_major(ctx, t):
    """[x, y, NC, BH] -> [x, y, BH, NC] (contiguous): chunk c is then one contiguous block,
    so the recurrence's per-chunk products read contiguous operands, which ggml-cpu hands to
    its tiled sgemm (a strided per-chunk view falls back to one dot product per element)."""
    if t.ne[2] == 1:                             # one chunk: the same memory, no copy
        return lib.ggml_reshape_4d(ctx, t, t.ne[0], t.ne[1], t.ne[3], 1)
    t = lib.ggml_reshape_4d(ctx, t, t.ne[0], t.ne[1], t.ne[2], t.ne[3])  # see ``transpose``
    return lib.ggml_cont(ctx, lib.ggml_permute(ctx, t, 0, 1, 3, 2))


def _view_chunk(ctx, t, c: int):
    """Chunk c of a chunk-major [x, y, BH, NC] tensor (``_chunk_major``) as a contiguous 3-D
    view [x, y, BH]."""
    return lib.ggml_view_3d(ctx, t, t.ne[0], t.ne[1], t.ne[2], t.nb[1], t.nb[2], c * t.nb[3])


def _neumann_inverse(ctx, L, eye, C: int):
    """(I + L)^-1 for strictly lower-triangular L (nilpotent, L^C = 0):
    (I - L)(I + L^2)(I + L^4)...(I + L^(2^m)) with 2^(m+1) >= C.  Every factor is a
    polynomial in L, so they commute; P and P^T are both kept to avoid transposes.
    ggml ne [j, i] holds the numpy matrix M[i, j]; mul_mat(a, b) = b @ a^T."""
    LT = transpose(ctx, L)
    inv = lib.ggml_add(ctx, lib.ggml_neg(ctx, L), eye)                  # I - L
    P, PT = L, LT
    k = 2
    while k < C:
        P, PT = lib.ggml_mul_mat(ctx, PT, P), lib.ggml_mul_mat(ctx, P, PT)   # P@P, (P@P)^T
        factor_t = lib.ggml_add(ctx, PT, eye)                          # (I + P)^T
        inv = lib.ggml_mul_mat(ctx, factor_t, inv)                     # inv @ (I + P)
        k *= 2
    return inv


def gated_delta_rule(ctx, q, k, v, g, beta, ci: ChunkInputs, C: int):
    """The gated delta rule over whole sequences, chunk-parallel inside chunks and recurrent
    across them, starting from a zero state.

    q, k: [S, H, T, B] (already L2-normalised, heads already matched to v's heads)
    v:    [S, H, T, B]
    g:    [1, H, T, B] log decay (<= 0);  beta: [1, H, T, B] in (0, 1)
    returns o: [S, H, T, B] with o_t = q_t·S_t / sqrt(S), S_t = e^{g_t} S_{t-1} + k_t δ_tᵀ,
    δ_t = β_t (v_t - S_{t-1}ᵀ k_t e^{g_t}) — what ggml_gated_delta_net computes.
    """
    S, H, T, B = (int(q.ne[i]) for i in range(4))
    NC = T // C
    # scale after the copy into chunks: SCALE's backward needs a contiguous gradient
    qc = lib.ggml_scale(ctx, to_chunks(ctx, q, C), 1.0 / float(np.sqrt(S)))
    kc, vc = to_chunks(ctx, k, C), to_chunks(ctx, v, C)
    bc = to_chunks(ctx, beta, C)                                        # [1, C, NC, BH]
    gc = lib.ggml_reshape_2d(ctx, to_chunks(ctx, g, C), C, NC * B * H)  # [C, NC·BH]
    gam = lib.ggml_mul_mat(ctx, ci.tri, gc)                             # cumsum in chunk
    gam_i = lib.ggml_reshape_4d(ctx, gam, 1, C, NC, B * H)              # varies along i
    # γ_i - γ_j [j, i, NC, BH]: γ repeated along dim 0 gives γ_i at [j, i]; its transpose
    # gives γ_j.  Both repeats are 2-D (C·NC·BH in dim 1), so their backward fits ggml-cuda
    rep = lib.ggml_reshape_4d(ctx, lib.ggml_repeat_4d(
        ctx, lib.ggml_reshape_2d(ctx, gam, 1, C * NC * B * H), C, C * NC * B * H, 1, 1),
        C, C, NC, B * H)                                                # [j, i]: γ_i
    diff = lib.ggml_sub(ctx, rep, transpose(ctx, rep))
    # D[i,j] = exp(γ_i - γ_j) for j <= i in the same sample, else 0.  Above the diagonal γ_i - γ_j
    # > 0 can overflow exp, so it is zeroed by the mask first (exp(0) = 1, then masked to 0):
    # a MUL by the host mask, whose backward is a MUL too, instead of DIAG_MASK_INF
    decay = lib.ggml_mul(ctx, lib.ggml_exp(ctx, lib.ggml_mul(ctx, diff, ci.m_incl)), ci.m_incl)
    e = lib.ggml_mul(ctx, lib.ggml_exp(ctx, gam_i), ci.carry)          # [1, C, NC, BH]

    kb = mul_rows(ctx, kc, bc)
    L = lib.ggml_mul(ctx, lib.ggml_mul(ctx, lib.ggml_mul_mat(ctx, kc, kb), decay), ci.m_strict)
    inv = _neumann_inverse(ctx, L, ci.eye, C)                           # [C, C, NC, BH]

    vbT = transpose(ctx, mul_rows(ctx, vc, bc))       # [C, S]
    uT = lib.ggml_mul_mat(ctx, inv, vbT)                                # (Tinv βv)^T [C, S]
    kbeT = transpose(ctx, mul_rows(ctx, kb, e))
    w = lib.ggml_mul_mat(ctx, kbeT, inv)                                # Tinv (β e k) [S, C]
    qe = mul_rows(ctx, qc, e)                                           # [S, C]
    A = lib.ggml_mul(ctx, lib.ggml_mul_mat(ctx, kc, qc), decay)         # q_i·k_j D[i,j]
    last = lib.ggml_view_4d(ctx, decay, C, 1, NC, B * H, decay.nb[1], decay.nb[2],
                            decay.nb[3], (C - 1) * decay.nb[1])
    last = lib.ggml_reshape_4d(ctx, lib.ggml_cont(ctx, last), 1, C, NC, B * H)
    kdT = transpose(ctx, mul_rows(ctx, kc, last))      # [C, S]
    # views of views break VIEW's backward (it zero-fills the viewed tensor with SCALE, which
    # needs it contiguous), so anything viewed per chunk is made contiguous first
    e_last = lib.ggml_cont(ctx, lib.ggml_view_4d(ctx, e, 1, 1, NC, B * H, e.nb[1], e.nb[2],
                                                 e.nb[3], (C - 1) * e.nb[1]))

    uT, w, A, qe, kdT, e_last = (_chunk_major(ctx, t) for t in (uT, w, A, qe, kdT, e_last))
    canvas = lib.ggml_scale(ctx, vc, 0.0)       # zeros of the output's shape [S, C, NC, BH]
    state_t = None                               # Sᵀ: ne [S_k, S_v, BH], zero before chunk 0
    for c in range(NC):
        dT = _view_chunk(ctx, uT, c)                                    # δᵀ = (U - W S)ᵀ
        if state_t is not None:
            dT = lib.ggml_sub(ctx, dT, lib.ggml_mul_mat(ctx, _view_chunk(ctx, w, c), state_t))
        o = lib.ggml_mul_mat(ctx, dT, _view_chunk(ctx, A, c))          # A δ      [S, C, BH]
        if state_t is not None:
            o = lib.ggml_add(ctx, o, lib.ggml_mul_mat(ctx, state_t, _view_chunk(ctx, qe, c)))
        if NC == 1:
            return from_chunks(ctx, lib.ggml_reshape_4d(ctx, o, S, C, 1, B * H), H, B)
        if c + 1 < NC:
            upd = lib.ggml_mul_mat(ctx, _view_chunk(ctx, kdT, c), dT)  # (Kdᵀ δ)ᵀ
            state_t = upd if state_t is None else lib.ggml_add(
                ctx, lib.ggml_mul(ctx, state_t, _view_chunk(ctx, e_last, c)), upd)
        canvas = _place_chunk(ctx, canvas, o, c)
    return from_chunks(ctx, canvas, H, B)


# The log decay added at the first token of a packed sample: e^g = 0 there, so the state the
# previous sample left is cleared (the fused op has no reset of its own), and nothing flows
# back across the boundary (the gradient of g at that token is dL/dS̃ . S̃ = 0, as for a
# sample starting from the zero state).  Finite: -1e30 + g stays finite, expf gives exactly 0.
RESET = -1e30


def reset_values(seg: np.ndarray) -> np.ndarray:
    """The additive log-decay reset [B, T] -> ne [1, 1, T, B]: RESET where a token starts a
    sample after another one in the same row, else 0."""
    r = np.zeros(seg.shape, np.float32)
    r[:, 1:][seg[:, 1:] != seg[:, :-1]] = RESET
    return r[:, :, None, None]


def fused_gated_delta_rule(ctx, q, k, v, g, beta, reset, state):
    """What ``gated_delta_rule`` computes, with ggml's GATED_DELTA_NET (one node; its backward
    one GATED_DELTA_NET_BACK node, patch 0020, ggml-cpu only).

    q, k, v: [S, H, T, B] (q, k with v's heads)    g, beta: [1, H, T, B]
    reset:   [1, 1, T, B] ``reset_values``          state:   [S, S, H, B] zeros
    returns o: [S, H, T, B], a view of the op's result (the final state follows it there).
    """
    S, H, T, B = (int(v.ne[i]) for i in range(4))
    out = lib.ggml_gated_delta_net(ctx, q, k, v, lib.ggml_add(ctx, g, reset), beta, state, 1)
    return lib.ggml_view_4d(ctx, out, S, H, T, B, S * 4, S * H * 4, S * H * T * 4, 0)


def _place_chunk(ctx, canvas, o, c: int):
    """Write chunk c's output [S, C, BH] into the [S, C, NC, BH] result.  ACC has a backward;
    CONCAT and the SET_ROWS writes llama.cpp uses do not.  In place (patch 0010 lets an
    in-place ACC take a gradient): the canvas is this function's own zero tensor, read by
    nothing but the next chunk's ACC, and a copying ACC per chunk rewrote the whole canvas,
    O(NC²) in the sequence length."""
    return lib.ggml_acc_inplace(ctx, canvas, o, canvas.nb[1], canvas.nb[3],
                                canvas.nb[3] * canvas.ne[3], c * canvas.nb[2])
