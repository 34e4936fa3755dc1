"""The bounds of tests/bounds.py for values made on two machines, on the case that failed CI on
an Intel AMX machine: TRL's ``dpo_sigmoid.rewards_chosen`` of the qwen35 preference golden
(tests/fixtures/qwen35/pref_golden.npz), committed from an AMD EPYC 1.23e-6 from its float64
run, regenerated on the Xeon 2.2e-7 from the same float64 value."""
import numpy as np

from bounds import f32_bound, f32_pair_bound, reference_bounds

EXACT = -0.19109773                 # the float64 value (both machines agree to float64 rounding)
COMMITTED = EXACT + 1.23e-6         # the committed float32 value: its machine's rounding
AMX = COMMITTED - 1.0132789611816406e-06   # the regenerated one on the Xeon (CI's |Δ|)


def test_one_runs_error_is_no_bound_for_two_machines():
    """The bound the reproduction test used, ``f32_bound`` of the new run's error alone,
    refuses two honest float32 evaluations; both runs' errors accept them."""
    d = abs(AMX - COMMITTED)
    assert d > f32_bound(abs(AMX - EXACT), EXACT)
    assert d <= f32_pair_bound(abs(AMX - EXACT), abs(COMMITTED - EXACT), EXACT)


def test_a_different_value_is_still_refused():
    """A float32 value that is not a rounding of the same function (off by 1e-4, what a
    reward of one more token or another beta gives) is refused by the same bound."""
    wrong = EXACT + 1e-4
    assert abs(wrong - COMMITTED) > f32_pair_bound(abs(AMX - EXACT), abs(COMMITTED - EXACT),
                                                   EXACT)


def test_reference_bounds_take_the_larger_rounding():
    """pytrain against a golden made elsewhere: from the exact value F32_SPREAD x the larger
    of its own and the reference's rounding; from the reference's float32 value that plus the
    reference's own distance (so never narrower than the reference's own rounding allows)."""
    to_exact, to_ref = reference_bounds(own=2.2e-7, ref_error=1.23e-6, exact=np.array([EXACT]))
    assert to_exact == f32_bound(1.23e-6, EXACT)
    assert to_ref == to_exact + 1.23e-6
    assert reference_bounds(own=5e-6, ref_error=1e-7, exact=EXACT)[0] == f32_bound(5e-6, EXACT)


def test_cross_entropy_bounds_refuse_what_is_not_a_rounding():
    """``cross_entropy_bounds`` refuses (a) upstream's gradient softmax - label on a label row
    summing to 2.5 (right only for rows summing to 1; on one-hot rows it is the same), (b) a
    one-hot row's gradient off by 1e-5 of its size, (c) a loss off by 1e-5 of its size: float32
    rounding is ~1e-7 of them."""
    from bounds import cross_entropy_bounds

    rng = np.random.default_rng(0)
    n_rows, n_vocab, d = 4, 1000, 0.5
    x = (rng.normal(size=(n_rows, n_vocab)) * 4).astype(np.float32)
    y = np.zeros((n_rows, n_vocab), np.float32)
    y[np.arange(n_rows), rng.integers(0, n_vocab, n_rows)] = 1.0
    y[2] = rng.random(n_vocab).astype(np.float32)
    y[2] *= np.float32(2.5 / y[2].sum())
    z = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    lab = y.astype(np.float64)
    loss = float((-(lab * np.log(p)).sum(axis=1)).mean())
    grad = (p * lab.sum(axis=1, keepdims=True) - lab) * d / n_rows
    loss_bound, grad_bound = cross_entropy_bounds(x, y, d)
    assert loss_bound > 0 and (grad_bound > 0).all()
    upstream = (p - lab) * d / n_rows
    assert (np.abs(upstream - grad) > grad_bound)[2].any()
    assert (np.abs(upstream - grad) <= grad_bound)[[0, 1, 3]].all()   # one-hot rows: the same
    one_hot = [0, 1, 3]                       # no cancellation in p·Σl - l there
    assert (np.abs(grad * 1e-5) > grad_bound)[one_hot].all()
    assert abs(loss * 1e-5) > loss_bound
