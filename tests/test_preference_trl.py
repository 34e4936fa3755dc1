"""DPO and ORPO against TRL itself (no torch here: the goldens are npz files).

tests/fixtures/{qwen35,llama}/pref_golden.npz (scripts/make_pref_golden.py): TRL 1.16's
DPOTrainer (loss_type sigmoid, ipo, robust with label smoothing 0.1; beta 0.1) and ORPO's
odds-ratio loss, with PEFT LoRA r 4 / alpha 8 and non-zero A and B on the tiny reference models,
on three pairs (a multi-turn prompt, padding, completions of unequal lengths, on qwen35
tokenized by TRL from conversational records), twice: as TRL runs it (float32) and in true
float64 (the exact answer for the model pytrain runs).  Here the same pairs and adapter go
through pytrain's own path (``pair_batch``, the reference pass, ``PreferenceTrainer.accumulate``)
and are compared: TRL's collated batch, the reference and policy log-probabilities, the loss,
TRL's reward metrics and every LoRA gradient.

Bounds (tests/bounds.py, ``reference_bounds``): the golden holds TRL float32's own rounding on
this very input (its distance to the float64 run), made on the machine that made the golden;
pytrain's own float32 rounding on the same input is measured now (the pairs reversed, the
other matmul kernels).  pytrain may be ``F32_SPREAD`` times the larger of the two from the
exact answer, and from TRL float32 that plus TRL's own distance: two float32 evaluations made
on different machines differ by up to both of their errors.
"""
from pathlib import Path

import numpy as np
import pytest

import pytrain
from bounds import reference_bounds
from pytrain.data.preference import Pair, load_pairs, pair_batch
from pytrain.models import lora
from pytrain.step.optimizer import AdamWSettings
from pytrain.step.preference import PreferenceSettings, PreferenceTrainer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = {"qwen35": FIXTURES / "qwen35", "llama": FIXTURES / "llama"}
LOSSES = {"dpo_sigmoid": ("dpo", "sigmoid", 0.0), "dpo_ipo": ("dpo", "ipo", 0.0),
          "dpo_robust": ("dpo", "robust", 0.1), "orpo": ("orpo", "sigmoid", 0.0)}


def _golden(family: str) -> dict:
    path = FAMILIES[family] / "pref_golden.npz"
    if not path.exists():
        pytest.fail(f"{path} missing: python -m scripts.make_pref_golden (reference stack)")
    return dict(np.load(path))


def golden_pairs(g: dict) -> list[Pair]:
    def split(key):
        lens = g[f"{key}_len"]
        return np.split(g[f"{key}_ids"].astype(np.int32), np.cumsum(lens)[:-1])
    return [Pair(p, c, r, f"golden pair {i}") for i, (p, c, r) in
            enumerate(zip(split("prompt"), split("chosen"), split("rejected")))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    fam = request.param
    g = _golden(fam)
    model = pytrain.load_model(FAMILIES[fam] / "gqa-f32.gguf", device="cpu", threads=2)
    yield fam, g, model
    model.close()


def adapter_of(model, g: dict):
    names = sorted(k.removesuffix(".lora_a") for k in g if k.endswith(".lora_a"))
    rank = g[names[0] + ".lora_a"].shape[0]
    ad = lora.create(model.runtime, model.config, names, rank=rank, alpha=2.0 * rank, seed=0)
    ad.set({n + s: g[n + s] for n in names for s in (".lora_a", ".lora_b")})
    return ad, names


def run_losses(model, g: dict, pairs: list, order: list[int]) -> dict:
    """Per loss: pytrain's loss, summed metrics, gradients and log-probabilities, the pairs in
    ``order`` in one micro-batch."""
    ad, names = adapter_of(model, g)
    out = {"names": names}
    for name, (objective, loss_type, smoothing) in LOSSES.items():
        tr = PreferenceTrainer(model, ad, AdamWSettings(lr=1e-3),
                               PreferenceSettings(objective, 0.1, loss_type, smoothing))
        try:
            tr.compute_reference("train", pairs, len(pairs))
            pb = pair_batch(pairs, order, model.pad_id)
            loss, v = tr.accumulate([pb])
            out[name] = {"loss": loss, "sums": v, "grads": tr.opt_state.grads(),
                         "ref": np.concatenate(tr.reference["train"]),
                         "policy": tr.sequence_logps(pb, tr.targets_of(pb))}
        finally:
            tr.close()
    return out


@pytest.fixture(scope="module")
def results(family):
    """pytrain's results on the golden pairs; and, to measure pytrain's own float32 rounding
    on this input (tests/bounds.py, as tests/step_rounding.py does for SFT), the same with
    the pairs in reverse order on the other F32 matmul kernels (``own``)."""
    from test_preference import other_kernels
    fam, g, model = family
    pairs = golden_pairs(g)
    out = run_losses(model, g, pairs, list(range(len(pairs))))
    other = other_kernels(model)
    try:
        out["own"] = run_losses(other, g, pairs, list(range(len(pairs)))[::-1])
    finally:
        other.close()
    return fam, g, out


def bound(g: dict, key32: str, key64: str, ref: str, own: float) -> float:
    """pytrain's allowed distance from TRL's value (``ref`` "f64": the exact one; "f32": TRL's
    float32 one), from TRL float32's rounding of this value on this input (the golden's) and
    pytrain's own, ``own``, measured now (``bounds.reference_bounds``)."""
    exact = np.asarray(g[key64], np.float64)
    trl = np.abs(np.asarray(g[key32], np.float64) - exact).max()
    return reference_bounds(own, trl, exact)[0 if ref == "f64" else 1]


def own_rounding(out: dict, loss: str, name: str) -> float:
    """max |Δ| of pytrain's value ``name`` ("ref", "policy", "loss" or a reward) between its
    run and the run with the pairs reversed on the other kernels (``results``)."""
    a, b = out[loss], out["own"][loss]
    if name == "loss":
        return abs(a["loss"] - b["loss"])
    if name in ("ref", "policy"):
        x, y = a[name], b[name]
        if name == "policy":                      # [chosen; rejected] of the reversed pairs
            n = len(y) // 2
            y = np.concatenate([y[:n][::-1], y[n:][::-1]])
        return float(np.abs(np.asarray(x, np.float64) - y).max())
    return abs(a["sums"][name] - b["sums"][name]) / a["sums"]["pairs"]


def test_trl_collates_the_pairs_as_pytrain_batches_them(family):
    fam, g, model = family
    pairs = golden_pairs(g)
    b = pair_batch(pairs, list(range(len(pairs))), int(g["pad_id"])).batch
    T = g["input_ids"].shape[1]
    assert b.tokens.shape == g["input_ids"].shape
    np.testing.assert_array_equal(b.tokens, g["input_ids"])
    np.testing.assert_array_equal(b.seg >= 0, g["attention_mask"] > 0)
    np.testing.assert_array_equal(b.train_mask, g["completion_mask"] > 0)
    assert T == max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)


def test_conversational_records_tokenize_as_trl_does(family):
    """pytrain's own reading of the records TRL tokenized (qwen35: its GGUF tokenizer and
    chat template) gives TRL's prompt / chosen / rejected ids."""
    fam, g, model = family
    records = FAMILIES[fam] / "pref_records.jsonl"
    if fam != "qwen35":
        pytest.skip("the llama fixture has no tokenizer: its golden pairs are token ids")
    pairs, _ = load_pairs(records, model.tokenizer)
    for mine, trl in zip(pairs, golden_pairs(g)):
        for a, b in ((mine.prompt, trl.prompt), (mine.chosen, trl.chosen),
                     (mine.rejected, trl.rejected)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_log_probabilities_match_trl(results, ref, measured):
    fam, g, out = results
    s64 = "64" if ref == "f64" else ""
    for name, key in (("ref", "ref_logps"), ("policy", "policy_logps")):
        got = out["dpo_sigmoid"][name]
        want = np.asarray(g[key + s64], np.float64)
        b = bound(g, key, key + "64", ref, own_rounding(out, "dpo_sigmoid", name))
        err = float(np.abs(got - want).max())
        measured(f"{fam} {name} log-probabilities vs TRL {ref}", err, b)
        assert err <= b, (name, got, want, b)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_loss_and_rewards_match_trl(results, loss, ref, measured):
    fam, g, out = results
    r = out[loss]
    s64 = "64" if ref == "f64" else ""
    b = bound(g, f"{loss}.loss", f"{loss}.loss64", ref, own_rounding(out, loss, "loss"))
    measured(f"{fam} {loss} loss vs TRL {ref}", abs(r["loss"] - float(g[f"{loss}.loss{s64}"])), b)
    assert abs(r["loss"] - float(g[f"{loss}.loss{s64}"])) <= b
    n = r["sums"]["pairs"]
    sums = {"rewards_chosen": "reward_chosen", "rewards_rejected": "reward_rejected",
            "rewards_margins": "margin", "rewards_accuracies": "correct"}
    for key, total in sums.items():
        v = r["sums"][total] / n
        want = float(g[f"{loss}.{key}{s64}"])
        if key == "rewards_accuracies":             # a count of pairs, TRL's in float32
            assert round(want * n) == r["sums"]["correct"], (key, v, want)
            continue
        # a reward is beta x (a log-probability difference) averaged: its rounding is beta x
        # that of the log-probabilities it is made of (for ORPO, divided by the length:
        # smaller), unless the reward's own is larger
        logps = [bound(g, f"{k}_logps", f"{k}_logps64", ref,
                       own_rounding(out, "dpo_sigmoid", k)) for k in ("policy", "ref")]
        bk = max(bound(g, f"{loss}.{key}", f"{loss}.{key}64", ref,
                       own_rounding(out, loss, total)), 0.1 * sum(logps))
        assert abs(v - want) <= bk, (key, v, want, bk)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_lora_gradients_match_trl(results, loss, ref, measured):
    fam, g, out = results
    r = out[loss]
    suffix = ".grad" if ref == "f32" else ".grad64"
    worst = (0.0, "")
    for n in out["names"]:
        for s in (".lora_a", ".lora_b"):
            key = f"{loss}.{n}{s}"
            exact = np.asarray(g[key + ".grad64"], np.float64)
            want = np.asarray(g[key + suffix], np.float64)
            got = r["grads"][n + s].astype(np.float64)
            assert got.shape == want.shape, (key, got.shape, want.shape)
            scale = np.abs(exact).max()
            assert scale > 0, key
            trl = np.abs(np.asarray(g[key + ".grad"], np.float64) - exact).max()
            own = np.abs(out["own"][loss]["grads"][n + s] - got).max()
            err = np.abs(got - want).max() / scale
            # the larger of TRL float32's and pytrain float32's own rounding on this input
            # (pytrain's chunked DeltaNet rounds otherwise than torch's loop, most visibly in
            # the layer-1 gradients, which cross DeltaNet layer 2 on 124-token rows), and
            # against TRL float32 TRL's own distance too
            b = reference_bounds(own, trl, exact)[0 if ref == "f64" else 1] / scale
            worst = max(worst, (err / b, key))
            assert err <= b, (key, err, b)
    measured(f"{fam} {loss} LoRA gradients vs TRL {ref}: worst error / bound ({worst[1]})",
             worst[0], 1.0)
