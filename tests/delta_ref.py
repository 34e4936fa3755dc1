"""float64 numpy references for the DeltaNet pieces (token-by-token, as HF's recurrent path)."""
import numpy as np


def gated_delta_rule(q, k, v, g, beta, seg=None):
    """q, k, v: [B, T, H, S]; g, beta: [B, T, H]; seg: [B, T] sample ids (state resets
    where the id changes).  Returns o [B, T, H, S] with q scaled by 1/sqrt(S)."""
    B, T, H, S = q.shape
    out = np.zeros((B, T, H, S))
    for b in range(B):
        for h in range(H):
            st = np.zeros((S, S))                      # st[i_k, j_v]
            for t in range(T):
                if seg is not None and t > 0 and seg[b, t] != seg[b, t - 1]:
                    st = np.zeros((S, S))
                st = st * np.exp(g[b, t, h])
                delta = (v[b, t, h] - st.T @ k[b, t, h]) * beta[b, t, h]
                st = st + np.outer(k[b, t, h], delta)
                out[b, t, h] = st.T @ q[b, t, h] / np.sqrt(S)
    return out


def causal_conv(x, w, seg=None):
    """x: [B, T, C]; w: [C, K].  out[b, t, c] = Σ_k w[c, k] x[b, t-(K-1)+k, c] within a sample."""
    B, T, C = x.shape
    K = w.shape[1]
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(T):
        for k in range(K):
            src = t - (K - 1) + k
            if src < 0:
                continue
            keep = np.ones(B) if seg is None else (seg[:, src] == seg[:, t]).astype(float)
            out[:, t] += w[:, k] * x[:, src] * keep[:, None]
    return out
