"""pytrain's Qwen3.5 forward against references nobody here wrote.

Fixtures (tests/fixtures/qwen35, made by scripts/make_qwen35_fixtures.py): small random HF
``Qwen3_5ForCausalLM`` models converted by the pinned llama.cpp converter, with HF float32
log-probabilities as goldens, plus float64 log-probabilities of an independent numpy forward
over each GGUF's own (dequantized) weights (scripts/make_qwen35_f64_golden.py).

Measured (max |Δ log-softmax| over 5 sequences of 1-100 tokens; bench_results/parity.md has
the current figures, made by scripts/report_parity.py; they move a little with CPU and build):
  F32 vs float64 truth: gqa 4.3e-5, untied 6.0e-5 (DeltaNet chunks of 32; chunks of 64 gave
  untied 1.2e-4, see delta_net.CHUNK)   -> bound 1e-4
  F32 vs HF float32:    gqa 7.8e-5, untied 4.9e-5 (HF itself is 6.1e-5 / 6.6e-5 off the float64
                        truth) -> bound 2.5e-4
  BF16 / Q8_0 files loaded as F32 (type_policy="f32") vs float64 of their own weights:
      within 1e-4 -> pytrain's arithmetic on those weights is exact to float32
  BF16 / Q8_0 files as loaded by default on CPU (BF16 -> F16, Q8_0 kept) vs that truth:
      0.066 / 1.6, because ggml's CPU matmul also rounds the activations to the weight's
      vec-dot type (F16, Q8_0), as llama.cpp does; vs HF float32 of the F32 model 0.57 / 2.4
      (the weights' own rounding, amplified by a random net).

Bounds (tests/bounds.py), none a number one machine printed:
  * float32 computations (every file loaded as F32) vs the float64 truth of their weights:
    ``F32_SPREAD`` (4) times the larger of HF float32's own distance from the truth on the same
    sequences (this network's float32 rounding on the machine that made the golden) and
    pytrain's own rounding measured now by perturbation (tests/perturbation.py), at least a
    few ulps (``bounds.reference_bounds``);
  * vs HF float32 of the F32 model: that, plus HF's distance from the file's truth, which the
    goldens hold exactly (|truth of the file - HF|: HF's rounding and the file's weight
    rounding): two float32 evaluations made on different machines differ by up to both of
    their errors;
  * weights kept (BF16 as F16, Q8_0): against llama.cpp, which rounds activations with the
    same kernels, within the kept type's own noise on the same tokens
    (``bounds.assert_same_rounding``; tests/test_llama_cpp_adapter.py, where llama.cpp is).
"""
import functools
from pathlib import Path

import numpy as np
import pytest

import pytrain

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name, policy="auto"):
        if (name, policy) not in cache:
            cache[name, policy] = pytrain.load_model(FIX / f"{name}.gguf", device="cpu",
                                                     threads=2, type_policy=policy)
        return cache[name, policy]
    yield get
    for m in cache.values():
        m.close()


def errors(model, golden, logprobs):
    """max |Δ log-softmax| of ``model`` against ``logprobs`` over every golden sequence."""
    return max(np.abs(log_softmax(model.logits(toks[:n])) - logprobs[i, :n]).max()
               for i, (toks, n) in enumerate(zip(golden["tokens"], golden["lengths"])))


@functools.cache
def own_rounding(golden: str) -> float:
    """pytrain's own float32 rounding of the golden's log-probabilities, measured now: the F32
    file against its copy with every weight one float32 step off (tests/perturbation.py)."""
    from perturbation import logprob_rounding
    g = np.load(FIX / f"{golden}.npz")
    return logprob_rounding(FIX / f"{golden}-f32.gguf", lambda m, _: np.concatenate(
        [log_softmax(m.logits(toks[:n])) for toks, n in zip(g["tokens"], g["lengths"])]))


def golden_gap(a, b, golden) -> float:
    return max(float(np.abs(a[i, :n] - b[i, :n]).max()) for i, n in enumerate(golden["lengths"]))


@pytest.mark.parametrize("name,golden", [("gqa-f32", "gqa"), ("untied-f32", "untied"),
                                         ("gqa-bf16", "gqa"), ("gqa-q8_0", "gqa")])
def test_float32_logits_match_references(models, name, golden, measured):
    from bounds import reference_bounds
    g = np.load(FIX / f"{golden}.npz")
    truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
    hf_rounding = golden_gap(g["logprobs"], np.load(FIX / f"{golden}-f32.f64.npz")["logprobs"], g)
    weight_rounding = golden_gap(truth, g["logprobs"], g)     # the file's, from the goldens
    bound = reference_bounds(own_rounding(golden), hf_rounding, truth[truth > -np.inf])[0]
    m = models(name, "f32")
    err_truth, err_hf = errors(m, g, truth), errors(m, g, g["logprobs"])
    print(f"{name}: vs float64 {err_truth:.2e} (bound {bound:.2e}); vs HF {err_hf:.2e} "
          f"(weights' rounding {weight_rounding:.2e})")
    measured(f"{name} loaded as F32 vs float64 of its weights, max |Δ log-softmax|", err_truth,
             bound)
    measured(f"{name} loaded as F32 vs HF float32, max |Δ log-softmax|", err_hf,
             weight_rounding + bound)
    assert err_truth <= bound
    assert err_hf <= weight_rounding + bound


def test_model_layout_is_read_from_the_file(models):
    m = models("gqa-f32")
    assert m.config.layer_kinds == ["linear", "attention", "linear", "attention"]
    assert m.config.ssm_v_heads == 4 and m.config.ssm_k_heads == 2
    assert m.config.tied_embeddings and not models("untied-f32").config.tied_embeddings


def assert_same_up_to_rounding(got, want):
    """Two float32 evaluations of the same log-probabilities (another padding or packing, so
    other chunkings and kernels) within the float32 rounding pytrain measures for this model
    now (``own_rounding``, tests/bounds.py): on an x64 ggml-cpu with BLAS a padded batch and
    its rows alone differed by 6.0e-5, past the fixed 5e-5 this test once had, while a leak
    across a boundary moves them by more than 1e-2."""
    from bounds import f32_bound
    got, want = log_softmax(got), log_softmax(want)
    bound = f32_bound(own_rounding("gqa"), want)
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


def test_right_padding_does_not_change_real_positions(models):
    """The whole golden batch padded to 100 (and internally to 128 for the DeltaNet chunks of 32)
    gives each sequence's logits as when run alone."""
    m = models("gqa-f32")
    g = np.load(FIX / "gqa.npz")
    batch = m.logits(g["tokens"])
    for i, n in enumerate(g["lengths"]):
        assert_same_up_to_rounding(batch[i, :n], m.logits(g["tokens"][i, :n]))


def test_packed_samples_are_isolated(models):
    """Two samples packed in one row (sample ids 0 then 1) give the logits of each run alone:
    attention, conv taps and the recurrent state do not cross the boundary.  The boundary
    falls mid-chunk (row of 100 -> 4 chunks of 32)."""
    m = models("gqa-f32")
    g = np.load(FIX / "gqa.npz")
    a, b = g["tokens"][4, :70], g["tokens"][2, :30]
    row = np.concatenate([a, b])
    seg = np.array([0] * len(a) + [1] * len(b))
    packed = m.logits(row, seg=seg)
    assert_same_up_to_rounding(packed[:70], m.logits(a))
    assert_same_up_to_rounding(packed[70:], m.logits(b))
    # and without the ids the second sample does see the first: the test can fail
    assert np.abs(m.logits(row)[70:] - m.logits(b)).max() > 1e-2


def test_generate_is_greedy_and_stops(models):
    m = models("gqa-f32")
    prompt = list(np.load(FIX / "gqa.npz")["tokens"][1, :7])
    out = m.generate(prompt, max_new_tokens=5)
    assert 0 < len(out) <= 5
    # greedy: each token is the argmax of the logits of the prefix
    toks = list(prompt)
    for t in out:
        assert int(m.logits(np.array(toks))[-1].argmax()) == t
        toks.append(t)


def test_last_only_logits_are_the_last_row_of_the_full_logits(models):
    """What generation asks for: the head on one position (T-1, inside the padded length)."""
    m = models("untied-f32")
    g = np.load(FIX / "untied.npz")
    for T in (1, 37, 64):
        rows = g["tokens"][3:5, :T]
        full = m.logits(rows)
        last = m.logits(rows, last_only=True)
        assert last.shape == (2, m.config.n_vocab)
        # one head row runs on ggml-cpu, all rows through BLAS (dims >= 32): the same float32
        # dot products summed in another order; measured 1.6e-5 on logits up to ~10
        np.testing.assert_allclose(last, full[:, -1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(m.logits(rows[0], last_only=True), full[0, -1],
                                   atol=1e-4, rtol=0)
