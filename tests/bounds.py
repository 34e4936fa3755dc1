"""Where the tests' numeric bounds come from, in one place.

The same tests run on different x86-64 CPUs, ggml-cpu variants (AVX2 to AVX-512 and AMX),
with and without the BLAS backend, on 1 or 2 threads.  Each of those sums float32 values in
another order, so no bound may be a number one machine happened to print.  Four kinds of
bound are used, each derived here:

* **float32 rounding, calibrated on the same input.**  Two float32 evaluations of the same
  mathematical quantity (a padded batch and its rows alone, two accumulations of one step)
  differ only by rounding.  How large float32 rounding is for *this* computation on *this*
  CPU is measured in the test, on the same input, against float64 (or, where there is no
  float64 forward, against the same float32 computation with every weight perturbed by one
  unit of float32 rounding), and the comparison is allowed ``F32_SPREAD`` times that.
  An error is never smaller than a few units of rounding of the value itself
  (``ulps``), which covers a calibration that happened to round exactly.

* **A kept type's own noise, measured on the same input.**  With F16 or quantized weights
  kept, ggml rounds every matmul's activations to that type, so a float32 difference of
  one ulp upstream can flip an 8-bit rounding downstream, and the logits then move by up to
  the type's own rounding noise.  That noise is measured in the test: the same model loaded
  with ``type_policy = "f32"`` (the same weight values, no activation rounding) against the
  kept one.  Two implementations that round the same function with the same kernels
  (pytrain and llama.cpp) are then within a multiple of it (``assert_same_rounding``).

* **AdamW's own amplification.**  AdamW divides each gradient element by its running
  magnitude, so a gradient element within rounding of zero can change its update by up to
  ``2·c_t·lr`` at step t whatever its size (``adam_ratio_bound``), while every other element
  moves by a rounding-sized fraction of that.  Two runs that should be equal are compared
  with that hard per-element bound, and in rms against a calibration run of the same
  training rounded otherwise (``assert_adamw_close``).

* **Both runs' errors, for a value made on another machine.**  A committed golden's float32
  value carries the rounding of the machine that made it; it is compared with a value made
  now by both runs' measured errors, never by one run's (``f32_pair_bound``,
  ``reference_bounds``).
"""
from __future__ import annotations

import math

import numpy as np

U32 = 2.0 ** -24          # float32 unit roundoff: |fl(x) - x| <= U32·|x|

# Two float32 evaluations of one value, each off by e from the exact value (e measured on
# the same input), differ by at most 2e; a second computation of a different shape (other
# kernels: BLAS or ggml-cpu, other blocking) may round up to twice as badly as the
# calibrated one.  4 x is that, and it is still far below the faults the tests plant
# (a padded position leaking at weight 1e-3 moves a loss by ~1e-3 of a token's CE).
F32_SPREAD = 4.0


def ulps(x, n: float = 8.0) -> float:
    """n units of float32 rounding of the largest magnitude in x."""
    return n * U32 * float(np.max(np.abs(np.asarray(x, np.float64))))


def f32_bound(measured_error: float, value) -> float:
    """The allowed difference between two float32 evaluations of ``value`` whose rounding
    error on this input was measured as ``measured_error`` (see the module docstring)."""
    return F32_SPREAD * max(float(measured_error), ulps(value))


# --------------------------------------------------------------------------- made elsewhere

# A committed golden was made on another machine: its float32 values carry that machine's
# rounding, which may be several times this machine's (a TRL float32 golden made on an AMD
# EPYC was 1.23e-6 from its float64 run where the same script on an Intel AMX machine gave
# 2.2e-7).  Two float32 evaluations made on different machines differ by up to both of their
# errors, so a comparison with a committed float32 value is bounded by both, never by one
# run's alone.

def f32_pair_bound(err_a: float, err_b: float, value) -> float:
    """The allowed difference between two float32 evaluations of ``value`` made on different
    machines (or by different programs), whose distances from the exact value were measured
    as ``err_a`` and ``err_b``: ``f32_bound`` of each, added."""
    return f32_bound(err_a, value) + f32_bound(err_b, value)


def reference_bounds(own: float, ref_error: float, exact) -> tuple[float, float]:
    """(allowed distance from the exact value, allowed distance from the reference's float32
    value) of pytrain's float32 result, compared with a committed golden: a reference's
    float32 run and its float64 run ``exact`` (the exact answer for the model pytrain runs).

    ``ref_error``: max |reference float32 - exact|, which the golden holds exactly (the
    rounding of the machine that made it); ``own``: pytrain's own float32 rounding of the
    same value, measured now on this machine (``step_rounding.measure``,
    ``perturbation.logprob_rounding``).  Each is a measurement of this computation's float32
    rounding; pytrain may be ``f32_bound`` of the larger from the exact value, and from the
    reference's float32 value that plus the reference's own distance from it."""
    ours = f32_bound(max(float(own), float(ref_error)), exact)
    return ours, ours + float(ref_error)


# --------------------------------------------------------------------------- kept types

def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_rows(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of log-probabilities."""
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)


def kept_noise(kept_log: np.ndarray, f32_log: np.ndarray) -> dict:
    """A kept type's own noise on some tokens: per position, KL(f32 || kept) and the largest
    |Δ log-softmax| over the vocabulary, ``kept_log`` (weights kept) against ``f32_log``
    (the same weight values as float32, no activation rounding)."""
    return {"kl": kl_rows(f32_log, kept_log),
            "max": np.maximum(np.abs(kept_log - f32_log).max(-1), ulps(f32_log))}


# A KL below this is float32 rounding of log-probabilities (8 ulps of a log-probability of
# size ~20, squared): two F32 computations are compared to it, not to zero.
KL_FLOOR = (8 * U32 * 20) ** 2


def assert_same_rounding(ours: np.ndarray, theirs: np.ndarray, f32: np.ndarray) -> None:
    """``ours`` and ``theirs`` (log-probabilities [T, V]) are two implementations of the same
    kept-type computation (pytrain and llama.cpp on one file): each rounds the float32
    function ``f32`` (pytrain, the same weights as float32).  Bounds from our own kept noise
    on these tokens (``kept_noise``), with KL quadratic in small log-probability changes
    (KL(p||q) ≈ ½ ΔᵀFΔ, so sqrt(KL) behaves like a distance):

    * theirs is no noisier than ours: mean KL(f32 || theirs) ≤ 4 x mean KL(f32 || ours)
      (the same rounding of the same function: 1x expected, 2x for the estimate, 2x for
      llama.cpp's other float32 grouping upstream);
    * mean KL(theirs || ours) ≤ 4 x mean KL(f32 || ours): two independent roundings of equal
      size are 2x one of them apart, on average; 2x for the estimate;
    * per position, KL(theirs || ours) ≤ 2 (sqrt KL(f32||ours) + sqrt KL(f32||theirs))²: the
      triangle inequality of that distance, 2x for the quadratic approximation;
    * the argmax may differ only where our top-two gap is at most 4x our own noise at that
      position: a flip needs the gap below 2·max|ours − theirs|, and that is at most our
      noise plus theirs there, theirs being about ours."""
    a, b = kept_noise(ours, f32), kept_noise(theirs, f32)
    c = kl_rows(theirs, ours)
    assert b["kl"].mean() <= 4 * max(a["kl"].mean(), KL_FLOOR), (b["kl"].mean(), a["kl"].mean())
    assert c.mean() <= 4 * max(a["kl"].mean(), KL_FLOOR), (c.mean(), a["kl"].mean())
    per = 2 * (np.sqrt(a["kl"].clip(0)) + np.sqrt(b["kl"].clip(0))) ** 2 + KL_FLOOR
    bad = np.nonzero(c > per)[0]
    assert not bad.size, [(int(t), c[t], per[t]) for t in bad]
    flips = np.nonzero(ours.argmax(-1) != theirs.argmax(-1))[0]
    gap = top2_gap(ours)
    bad = [int(t) for t in flips if gap[t] > 4 * a["max"][t]]
    assert not bad, [(t, gap[t], a["max"][t]) for t in bad]


def top2_gap(log_probs: np.ndarray) -> np.ndarray:
    s = np.sort(log_probs, -1)
    return s[..., -1] - s[..., -2]


# --------------------------------------------------------------------------- AdamW

def adam_ratio_bound(beta1: float, beta2: float, t: int) -> float:
    """max |m̂_t| / sqrt(v̂_t) over every gradient sequence, at step t (eps only lowers it).

    m̂_t = Σ_k a_k g_k and v̂_t = Σ_k b_k g_k² with a_k = (1-β1)β1^(t-k)/(1-β1^t) and
    b_k = (1-β2)β2^(t-k)/(1-β2^t); Cauchy-Schwarz on Σ (a_k/√b_k)(√b_k g_k) gives
    |m̂_t| ≤ sqrt(Σ a_k²/b_k)·sqrt(v̂_t).  1 at t = 1, 1.0013 at t = 2."""
    ks = np.arange(1, t + 1)
    a = (1 - beta1) * beta1 ** (t - ks) / (1 - beta1 ** t)
    b = (1 - beta2) * beta2 ** (t - ks) / (1 - beta2 ** t)
    return float(math.sqrt(np.sum(a * a / b)))


def adamw_element_bound(lrs: list[float], beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most one parameter element can differ between two AdamW runs from the same start
    whose gradients differ in any way: each step moves an element by at most c_t·lr_t in
    either run (weight decay only shrinks a difference)."""
    return sum(2 * lr * adam_ratio_bound(beta1, beta2, t) for t, lr in enumerate(lrs, 1))


def assert_adamw_close(got: dict, want: dict, lrs: list[float], calib: dict,
                       beta1: float = 0.9, beta2: float = 0.999) -> None:
    """Adapters after the AdamW steps ``lrs`` of two runs that compute the same gradients up
    to float32 rounding, against ``calib``: the same training rounded otherwise (the rows
    reversed or the micro-batches regrouped, the other matmul kernels), whose distance from
    ``want`` is what float32 rounding, as AdamW amplifies it, does on this input.

    * Every element within ``adamw_element_bound`` (plus the rounding of the value itself).
      That holds for any gradients at all: it only catches a wrong learning rate or step count.
    * rms(got - want) over every element at most F32_SPREAD x max(rms(calib - want),
      bound / sqrt(n)): the calibrated part.  AdamW turns a gradient within rounding of zero
      into an update anywhere in [-lr, lr], so a rounding shows as a few elements moved by up
      to the bound; bound / sqrt(n) is one such element among the n, the least an amplified
      rounding does (as ``ulps`` is the least a rounding does), so a calibration that happened
      to round alike does not make the bound zero.  F32_SPREAD x that floor allows 16 such
      elements; about 1e-5 of the elements have a gradient that close to zero (gradients
      round at ~1e-5 of their scale: test_masked_loss, test_recompute), so an adapter of a
      few thousand elements expects well under one.  A real fault (a micro-batch dropped, a
      step skipped or repeated) moves most elements' updates by about lr at each step.
      Measured (test_recompute, test_train_cli): rms 0 to 2.8e-8 against allowed 1.3e-3 to
      3.8e-3, the calibrations 1.7e-7 to 2.3e-7."""
    assert sorted(got) == sorted(want) == sorted(calib)
    bound = adamw_element_bound(lrs, beta1, beta2)
    sq = {"got": 0.0, "calib": 0.0}
    n = 0
    for k in want:
        a, b, c = (np.asarray(x[k], np.float64) for x in (got, want, calib))
        d = np.abs(a - b)
        assert (d <= bound + 4 * U32 * np.abs(b)).all(), (k, float(d.max()), bound)
        sq["got"] += float((d * d).sum())
        sq["calib"] += float(((c - b) ** 2).sum())
        n += d.size
    rms, rms_calib = math.sqrt(sq["got"] / n), math.sqrt(sq["calib"] / n)
    allowed = F32_SPREAD * max(rms_calib, bound / math.sqrt(n))
    assert rms <= allowed, (f"rms {rms:.3g} of the adapter difference over {n} elements, "
                            f"calibration {rms_calib:.3g}, allowed {allowed:.3g}")


# --------------------------------------------------------------------------- weight rounding

# Rounding weights to a type (a merge written back in the base's BF16, Q8_0 or F16; llama.cpp
# rounding the activations of a BF16 matmul to BF16, the same relative step on the other factor
# of each product) moves the logits by about what rounding the same model's weights to that
# type moves them: each element off by at most half the type's step, of the same relative
# size.  That noise is measured on the same tokens (``weight_noise``: the model with its weights
# in the type, loaded as float32, against its float32 original).  Two independent roundings of
# equal size are up to 2x one apart, and 2x for estimating a maximum from one draw: 4x.
KEPT_SPREAD = 4.0


def weight_noise(rounded_logits: np.ndarray, f32_logits: np.ndarray) -> dict:
    """A weight type's rounding noise on some tokens: max and rms |Δ logits| of the model with
    its weights in that type against its float32 original (both computed in float32)."""
    d = np.asarray(rounded_logits, np.float64) - np.asarray(f32_logits, np.float64)
    return {"max": float(np.abs(d).max()), "rms": float(np.sqrt(np.mean(d * d)))}


def rounding_bounds(noise: dict, effect_rms: float) -> tuple[float, float]:
    """(max |Δ logits|, rms ratio) allowed for one more rounding of the kind ``noise`` measured:
    KEPT_SPREAD x its max, and KEPT_SPREAD x its rms over the rms of the change (an adapter's
    effect) the ratio is taken against."""
    return KEPT_SPREAD * noise["max"], KEPT_SPREAD * noise["rms"] / effect_rms


# --------------------------------------------------------------------------- cross-entropy

U64 = 2.0 ** -53                      # float64 unit roundoff
F32_MIN = float(np.finfo(np.float32).tiny)   # the smallest normal float32, 2^-126
# ggml_v_expf (ggml-cpu's SIMD exp, ARM's optimized routine) is within 1.45358 + 0.5 ulp of
# exp with FMA; without FMA (the sse42/sandybridge variants) every float in [-87, 0] comes out
# within 1.973 ulp (checked against exp in double, all 2^30 of them); glibc's expf, the scalar
# tails, within 1 ulp.  One ulp is at most 2u of the value, so 2 ulps are 4u.
EXP_REL = 4 * U32
CE_EXP_MIN = -87.0                    # native patch 0019 flushes exp(t) to 0 below this


def cross_entropy_bounds(logits: np.ndarray, labels: np.ndarray, d: float = 1.0
                         ) -> tuple[float, np.ndarray]:
    """(the largest error of ggml-cpu's CROSS_ENTROPY_LOSS, the largest error of each element
    of its backward) for float32 ``logits`` and ``labels`` [N, V] and the loss's upstream
    gradient ``d``, from the operations native patch 0019 does, bounded against the exact
    values of the float32 inputs (a float64 computation is within float64 rounding of them).

    Per row, m = max x, z = x - m, S = Σ exp(z), p = exp(z)/S:

    * each exp(z_i) is off by EXP_REL (the exp) plus u·|z_i| (z_i = fl(x_i - m) is rounded, and
      exp turns an absolute error in its argument into that relative error); S sums them in
      double (n·U64), and drops the terms flushed below CE_EXP_MIN (each < e^-87 < 1.4·F32_MIN,
      against S >= 1) and denormal inputs (DAZ: each moves by < F32_MIN).  So S is within
      δS = EXP_REL + u·E_p|z| + n·U64 + 2n·F32_MIN relative, and log S within δS·(1 + δS)
      absolutely.
    * the row's loss Σl·(m + log S) - Σ l·x: the products l·x of floats are exact in double and
      every sum is in double, so the row is within Σ|l|·δS plus n·U64 of its terms' sizes;
      the rows' sum in double, the division by N and the rounding to float32 add N·U64 of the
      rows and u of the result.
    * the gradient (p_i·Σl - l_i)·d/N is computed as fl(fl(e_i·a) - l_i·b) with e_i the exp
      relative to the running max m_c of its chunk (EXP_REL + u·|x_i - m_c|, and
      |x_i - m_c| <= |z_i|), a = fl32(exp(m_c - m)·Σl/S·d/N) in double then rounded (δS + u +
      n·U64 for Σl), b = fl32(d/N) (u):
      with P_i = p_i·Σ|l|·|d|/N and L_i = |l_i|·|d|/N the error is at most
      P_i·(EXP_REL + u·|z_i| + δS + 3u) + L_i·3u (b, a product rounded without FMA, the
      result's rounding, which also covers P_i's share of it); plus F32_MIN·(1 + 2·(Σ|l| +
      |l_i|)·|d|/N) for flushed exps, denormal inputs read as 0 and denormal results
      flushed to 0 (MXCSR's DAZ|FTZ).

    Each first-order bound holds to a relative (1 + δ) with δ ~ 1e-5 here, so all are
    multiplied by 1.01."""
    x = np.asarray(logits, np.float64)
    lab = np.asarray(labels, np.float64)
    n_rows, n = x.shape
    z = x - x.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    p = e / s
    mean_abs_z = (p * np.abs(z)).sum(axis=1, keepdims=True)
    d_s = EXP_REL + U32 * mean_abs_z + n * U64 + 2 * n * F32_MIN
    abs_l = np.abs(lab).sum(axis=1, keepdims=True)
    m = x.max(axis=1, keepdims=True)
    log_s = np.log(s)
    rows = (lab.sum(axis=1, keepdims=True) * (m + log_s) - (lab * x).sum(axis=1, keepdims=True))
    row_err = (abs_l * d_s * (1 + d_s)
               + n * U64 * (abs_l * (np.abs(m) + np.abs(log_s)) + np.abs(lab * x).sum(axis=1, keepdims=True)))
    loss = float(rows.sum() / n_rows)
    loss_err = float(row_err.sum() / n_rows + n_rows * U64 * np.abs(rows).sum() / n_rows
                     + U32 * abs(loss))
    scale = abs(d) / n_rows
    big_p = p * abs_l * scale
    big_l = np.abs(lab) * scale
    grad_err = (big_p * (EXP_REL + U32 * np.abs(z) + d_s + 3 * U32) + 3 * U32 * big_l
                + F32_MIN * (1 + 2 * (abs_l + np.abs(lab)) * scale))
    return 1.01 * loss_err, 1.01 * grad_err
