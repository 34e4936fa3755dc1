"""The preference losses as functions of per-sequence log-probabilities, with their derivatives.

Why this shape: every loss TRL's DPOTrainer and ORPOTrainer define is a function of a few
numbers per pair, the summed log-probabilities of the completion tokens of chosen and rejected
under the policy (pi_c, pi_r) and the reference (ref_c, ref_r), and the completion lengths.  So
its gradient is  sum over sequences of  dL/dpi_s * grad(pi_s),  and grad(pi_s) is the gradient
of the sequence's summed token log-probabilities, which the masked cross-entropy graph already
computes exactly (only completion targets, padding and prompt at zero).  The step computes
pi on the device, these functions on the host in float64, then one backward of the
per-sequence sums weighted by dL/dpi.

Names, formulas and defaults are TRL 1.16's (trl/trainer/dpo_trainer.py ``_compute_loss``,
trl/experimental/orpo ``odds_ratio_loss``), with one deliberate difference: ORPO's NLL term
counts the chosen completion tokens only (the ORPO paper's L_SFT), where TRL's code also counts
the prompt's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OBJECTIVES = ("sft", "dpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(log_sigmoid(x))


def log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - exp(x)) for x < 0, branching as TRL's ``log1mexp`` does."""
    return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


@dataclass
class PairTerms:
    """Per pair (float64 [n]): its loss term (before the mean over the step's pairs), the
    derivatives of that term by pi_c and pi_r, and TRL's rewards."""

    loss: np.ndarray
    d_chosen: np.ndarray
    d_rejected: np.ndarray
    reward_chosen: np.ndarray
    reward_rejected: np.ndarray


def dpo_terms(loss_type: str, beta: float, label_smoothing: float, pi_c, pi_r, ref_c, ref_r,
              len_c, len_r) -> PairTerms:
    """DPO with TRL's ``loss_type``; ``len_*``: completion tokens (IPO's length normalisation)."""
    pi_c, pi_r, ref_c, ref_r = (np.asarray(a, np.float64) for a in (pi_c, pi_r, ref_c, ref_r))
    log_c, log_r = pi_c - ref_c, pi_r - ref_r              # TRL's chosen/rejected_logratios
    if loss_type == "ipo":
        nc = np.maximum(np.asarray(len_c, np.float64), 1.0)
        nr = np.maximum(np.asarray(len_r, np.float64), 1.0)
        gap = log_c / nc - log_r / nr - 1.0 / (2.0 * beta)
        loss, dz = gap ** 2, 2.0 * gap
        d_c, d_r = dz / nc, -dz / nr
    else:
        z = beta * (log_c - log_r)
        if loss_type == "sigmoid":
            loss, dz = -log_sigmoid(z), -sigmoid(-z)
        elif loss_type == "hinge":
            loss, dz = np.maximum(1.0 - z, 0.0), np.where(1.0 - z > 0, -1.0, 0.0)
        elif loss_type == "robust":
            e = label_smoothing
            loss = ((1 - e) * -log_sigmoid(z) - e * -log_sigmoid(-z)) / (1 - 2 * e)
            dz = ((1 - e) * -sigmoid(-z) - e * sigmoid(z)) / (1 - 2 * e)
        else:
            raise ValueError(f"unknown DPO loss_type {loss_type!r} (valid: {', '.join(DPO_LOSSES)})")
        d_c, d_r = beta * dz, -beta * dz
    return PairTerms(loss, d_c, d_r, beta * log_c, beta * log_r)


def orpo_terms(beta: float, pi_c, pi_r, n_c, n_r) -> PairTerms:
    """ORPO's odds-ratio term, ``-beta * log sigmoid(log odds)`` on the length-normalised
    log-probabilities (``n_*``: completion targets); the NLL term is ``orpo_nll_weight``'s."""
    n_c, n_r = np.asarray(n_c, np.float64), np.asarray(n_r, np.float64)
    a_c, a_r = np.asarray(pi_c, np.float64) / n_c, np.asarray(pi_r, np.float64) / n_r
    with np.errstate(divide="ignore"):         # a certain completion: log(1 - 1) = -inf
        log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
    loss = -beta * log_sigmoid(log_odds)
    dl = -beta * sigmoid(-log_odds)                # d loss / d log_odds
    # d log_odds / d a_c = 1 + exp(a) / (1 - exp(a)) = -1 / expm1(a_c), which is infinite
    # where the chosen completion is certain (a_c = 0, float32's log-softmax reaches it) while
    # sigmoid(-log_odds) is 0 there: their product, written with exp(log_odds) =
    # exp(a_c - a_r) (1 - exp(a_r)) / (1 - exp(a_c)), is
    # 1 / ((1 - exp(a_c)) + exp(a_c - a_r) (1 - exp(a_r))), a sum of two non-negative terms:
    # finite at a_c = 0 (the limit 1 / expm1(-a_r)) and without cancellation elsewhere
    d_c = -beta / (n_c * (-np.expm1(a_c) + np.exp(a_c - a_r) * -np.expm1(a_r)))
    d_r = dl * (1.0 / np.expm1(a_r)) / n_r        # d log_odds / d a_r = 1 / expm1(a_r)
    return PairTerms(loss, d_c, d_r, beta * a_c, beta * a_r)
