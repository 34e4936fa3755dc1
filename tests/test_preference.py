"""Preference training (DPO, ORPO): the pair data, the loss functions' derivatives, the
per-sequence masked CE against the SFT path it generalises, accumulation, and whole runs.
Parity with TRL itself is tests/test_preference_trl.py."""
import json
from pathlib import Path

import numpy as np
import pytest

import pytrain
from bounds import F32_SPREAD, f32_bound, ulps
from pytrain.cli import main
from pytrain.data.examples import DataError
from pytrain.data.preference import encode_pair, load_pairs, make_pair_batches, pair_batch
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import loss as L
from pytrain.step import preference_loss as pl
from pytrain.step.graphs import EvalGraph, GradGraph, bucket_length
from pytrain.step.optimizer import AdamWSettings
from pytrain.step.preference import PreferenceSettings, PreferenceTrainer
from step_rounding import measure

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
           ("pig", "oink"), ("owl", "hoot"), ("frog", "ribbit")]


def pair_records(n_turns: int = 1) -> list[dict]:
    """Conversational pairs: the right animal sound chosen, another animal's rejected; every
    third prompt has an earlier exchange (a multi-turn prompt)."""
    recs = []
    for i, (a, s) in enumerate(ANIMALS):
        wrong = ANIMALS[(i + 3) % len(ANIMALS)][1]
        prompt = [{"role": "user", "content": f"What does the {a} say?"}]
        if i % 3 == 0:
            prompt = [{"role": "user", "content": "Hi."},
                      {"role": "assistant", "content": "Hello! Ask me about animals."}] + prompt
        recs.append({"prompt": prompt,
                     "chosen": [{"role": "assistant", "content": f"The {a} says {s}."}],
                     "rejected": [{"role": "assistant",
                                   "content": f"The {a} says {wrong}" + "!" * (i % 3)}]})
    return recs


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def pairs(model, tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("pairs") / "p.jsonl", pair_records())
    return load_pairs(path, model.tokenizer)[0]


def adapted(model, seed: int = 3):
    """An adapter with non-zero A and B (the policy differs from the base model)."""
    names = select_targets(model.config)
    ad = lora.create(model.runtime, model.config, names, rank=4, alpha=8.0, seed=0)
    rng = np.random.default_rng(seed)
    ad.set({k: (rng.standard_normal(v.shape) * (0.2 if k.endswith("lora_b") else 0.1)
                ).astype(np.float32) for k, v in ad.get().items()})
    return ad


# --------------------------------------------------------------------------- the losses

def _numeric(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.parametrize("objective,loss_type", [("dpo", "sigmoid"), ("dpo", "ipo"),
                                                 ("dpo", "hinge"), ("dpo", "robust"),
                                                 ("orpo", None)])
def test_loss_derivatives_are_the_loss_functions_own(objective, loss_type):
    """d loss / d pi from the closed forms against central differences of the loss itself
    (float64; the step is 1e-6, so the truncation error is ~1e-12 x the third derivative)."""
    rng = np.random.default_rng(0)
    n = 6
    pc, pr = -rng.uniform(2, 30, n), -rng.uniform(2, 30, n)
    rc, rr = pc + rng.normal(0, 1, n), pr + rng.normal(0, 1, n)
    lc, lr = rng.integers(3, 12, n), rng.integers(3, 12, n)

    def terms(pc_, pr_):
        if objective == "orpo":
            return pl.orpo_terms(0.1, pc_, pr_, lc, lr)
        return pl.dpo_terms(loss_type, 0.1, 0.2, pc_, pr_, rc, rr, lc, lr)
    t = terms(pc, pr)
    if loss_type == "hinge":
        assert ((1 - 0.1 * ((pc - rc) - (pr - rr))) > 0.01).all()     # away from the kink
    for i in range(n):
        e = np.eye(n)[i]
        dc = _numeric(lambda h: terms(pc + h * e, pr).loss[i], 0.0)
        dr = _numeric(lambda h: terms(pc, pr + h * e).loss[i], 0.0)
        assert abs(dc - t.d_chosen[i]) <= 1e-7 * max(1.0, abs(dc)), (i, dc, t.d_chosen[i])
        assert abs(dr - t.d_rejected[i]) <= 1e-7 * max(1.0, abs(dr)), (i, dr, t.d_rejected[i])


def orpo_chosen_limit(beta, a_r, n_c):
    """d loss / d pi_c of ORPO as the chosen mean log-probability a_c goes to 0 (the chosen
    completion certain): the odds-ratio term's sigmoid(-L) goes to 0 as fast as
    d L / d a_c = 1 / (1 - exp(a_c)) grows, and their product has the limit
    1 / (exp(-a_r) - 1)."""
    return -beta / (n_c * np.expm1(-a_r))


@pytest.mark.parametrize("a_c", [0.0, -1e-30, -0.0])
def test_orpo_derivative_is_finite_where_the_chosen_completion_is_certain(a_c):
    """A chosen completion whose every token the policy gives probability 1 (a mean
    log-probability of exactly 0.0 in float64, which float32 log-softmax reaches): the loss
    is 0 and its derivative the finite limit, not 0 x inf; its rejected derivative is 0.
    One-sided differences of the loss itself check the limit (the loss is defined for
    a_c <= 0 only; truncation error O(h))."""
    beta, n_c, n_r = 0.1, 4, 5
    a_r = np.array([-0.5, -2.0, -1e-3])
    pc, pr = np.full(3, a_c * n_c), a_r * n_r
    t = pl.orpo_terms(beta, pc, pr, np.full(3, n_c), np.full(3, n_r))
    assert np.isfinite(t.d_chosen).all() and np.isfinite(t.d_rejected).all(), (t.d_chosen,
                                                                                t.d_rejected)
    want = orpo_chosen_limit(beta, a_r, n_c)
    np.testing.assert_allclose(t.d_chosen, want, rtol=4 * np.finfo(float).eps)
    # d_r = beta sigmoid(-L) / (1 - exp(a_r)) / n_r, with sigmoid(-L) = exp(-L) to first
    # order in a_c: exactly 0 at a_c = 0
    e = np.exp(a_r)
    np.testing.assert_allclose(t.d_rejected, beta * -a_c * e / (-np.expm1(a_r)) ** 2 / n_r,
                               rtol=1e-12, atol=0)
    # the loss beta log(1 + exp(-L)): 0 at a_c = 0, beta exp(-L) to first order
    np.testing.assert_allclose(t.loss, beta * -a_c * e / -np.expm1(a_r), rtol=1e-12, atol=0)
    # one-sided: truncation error h * |f''| / 2 relative to f' is about h / (2 (1 - exp(a_r)))
    h = 1e-10
    below = pl.orpo_terms(beta, pc - h * n_c, pr, np.full(3, n_c), np.full(3, n_r)).loss
    one_sided = (t.loss - below) / (h * n_c)
    np.testing.assert_allclose(one_sided, want, rtol=1e-6)


def test_orpo_derivative_form_agrees_with_the_old_where_that_was_finite():
    """Away from a_c = 0, the finite form and sigmoid(-L) * (-1 / expm1(a_c)) are the same
    function: equal to float64 rounding over ordinary and extreme points; the loss is the
    very same computation."""
    rng = np.random.default_rng(1)
    a_c = -np.concatenate([rng.uniform(1e-6, 8, 200), [1e-12, 1e-9, 30.0, 100.0]])
    a_r = -np.concatenate([rng.uniform(1e-6, 8, 200), [5.0, 1e-9, 1e-12, 0.5]])
    n_c, n_r = np.full(a_c.size, 3), np.full(a_c.size, 7)
    pc, pr = a_c * n_c, a_r * n_r
    t = pl.orpo_terms(0.2, pc, pr, n_c, n_r)
    a_c, a_r = pc / n_c, pr / n_r                   # as orpo_terms has them
    log_odds = (a_c - a_r) - (pl.log1mexp(a_c) - pl.log1mexp(a_r))
    old_c = -0.2 * pl.sigmoid(-log_odds) * (-1.0 / np.expm1(a_c)) / n_c
    # the old form's exp(log_sigmoid(-L)) carries log_sigmoid's absolute rounding as a
    # relative error: about (|L| + 1) ulps; the rest is a few ulps each
    bound = (np.abs(log_odds) + 8) * np.finfo(float).eps * np.abs(old_c)
    assert (np.abs(t.d_chosen - old_c) <= bound).all(), np.max(np.abs(t.d_chosen - old_c) / bound)
    np.testing.assert_array_equal(t.loss, -0.2 * pl.log_sigmoid(log_odds))


def test_dpo_sigmoid_at_the_reference_is_log2_and_no_reward():
    t = pl.dpo_terms("sigmoid", 0.1, 0.0, [-3.0], [-5.0], [-3.0], [-5.0], [4], [4])
    assert t.loss[0] == pytest.approx(np.log(2.0), rel=1e-15)
    assert t.reward_chosen[0] == t.reward_rejected[0] == 0.0


# --------------------------------------------------------------------------- data

def test_standard_records_get_eos_and_a_masked_prompt(model, tmp_path):
    tok = model.tokenizer
    eos = tok.id_to_token(tok.eos_id)
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"prompt": "The cow says", "chosen": " moo", "rejected": " woof" + eos}])
    (p,), stats = load_pairs(path, tok)
    assert p.chosen[-1] == p.rejected[-1] == tok.eos_id
    assert list(p.rejected).count(tok.eos_id) == 1          # not appended twice
    assert list(p.prompt) + list(p.chosen) == tok.encode("The cow says moo" + eos,
                                                         add_special=True)
    b = pair_batch([p], [0], model.pad_id).batch
    tg = L.shift_targets(b.tokens, b.train_mask, b.seg)
    # exactly the completion tokens are targets, each predicted from the token before it
    for row, comp in ((0, p.chosen), (1, p.rejected)):
        got = tg[row][tg[row] >= 0]
        np.testing.assert_array_equal(got, comp)
    assert stats.examples == 1 and stats.target_tokens == len(p.chosen) + len(p.rejected)


def test_conversational_records_render_prompt_with_the_generation_prompt(model, tmp_path):
    from pytrain.data.chat_template import render
    tok = model.tokenizer
    rec = pair_records()[0]
    (p,), _ = load_pairs(write_jsonl(tmp_path / "c.jsonl", [rec]), tok)
    kw = tok.special_tokens_map()
    prompt_text = render(tok.chat_template, rec["prompt"], True, **kw)
    full = tok.encode(render(tok.chat_template, rec["prompt"] + rec["chosen"], False, **kw))
    assert list(p.prompt) + list(p.chosen) == full
    assert tok.decode(list(p.prompt)) == prompt_text[:len(tok.decode(list(p.prompt)))]
    assert "The cow says moo." in tok.decode(list(p.chosen))
    assert "Hello! Ask me about animals." in tok.decode(list(p.prompt))     # multi-turn
    implicit = {"chosen": rec["prompt"] + rec["chosen"],
                "rejected": rec["prompt"] + rec["rejected"]}
    (q,), _ = load_pairs(write_jsonl(tmp_path / "i.jsonl", [implicit]), tok)
    for a, b in ((p.prompt, q.prompt), (p.chosen, q.chosen), (p.rejected, q.rejected)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("record,says", [
    ({"prompt": "a", "chosen": "b"}, "missing 'rejected'"),
    ({"chosen": "b", "rejected": "c"}, "missing \"prompt\""),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "\"chosen\" equals \"rejected\""),
    ({"prompt": "a", "chosen": ["x"], "rejected": "c"}, "all be strings"),
    ("{not json", "malformed JSON"),
])
def test_bad_records_name_file_and_line(model, tmp_path, record, says):
    good = {"prompt": "The cow says", "chosen": " moo", "rejected": " woof"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError) as e:
        load_pairs(path, model.tokenizer)
    assert f"{path}:2:" in str(e.value) and says in str(e.value), str(e.value)
    pairs, stats = load_pairs(path, model.tokenizer, on_error="skip")
    assert len(pairs) == 1 and sum(stats.skipped.values()) == 1


def test_a_prompt_that_leaves_no_completion_is_skipped_and_counted(model, tmp_path):
    long = {"prompt": "moo " * 40, "chosen": " yes", "rejected": " no"}
    short = {"prompt": "The cow says", "chosen": " moo", "rejected": " woof"}
    path = write_jsonl(tmp_path / "t.jsonl", [short, long])
    pairs, stats = load_pairs(path, model.tokenizer, max_seq_len=16)
    assert len(pairs) == 1 and stats.skipped == {"no_targets": 1}
    assert f"{path}:2: the prompt leaves no completion token" in stats.skip_messages[
        "no_targets"][0]
    pairs, stats = load_pairs(path, model.tokenizer, max_seq_len=16, truncation="drop")
    assert stats.skipped == {"too_long": 1}


@pytest.mark.parametrize("truncation", ["right", "left"])
def test_a_pair_that_truncation_makes_equal_is_skipped_and_counted(model, tmp_path, truncation):
    """Completions that differ only past max_seq_len (right) or only before the last
    max_seq_len tokens (left) become the same tokens once cut: a pair with nothing to prefer,
    held at loss log 2 for ever, diluting every step it is in.  Skipped and counted, as a pair
    with no completion token left is, in the stats and the run log's summary line."""
    tok = model.tokenizer
    same = " the cow says moo and the dog says woof and the cat says meow" * 2
    if truncation == "right":
        rec = {"prompt": "Animals: " * 8, "chosen": same + " yes", "rejected": same + " no"}
    else:
        rec = {"prompt": "Animals:", "chosen": "Yes," + same, "rejected": "No," + same}
    short = {"prompt": "The cow says", "chosen": " moo", "rejected": " woof"}
    path = write_jsonl(tmp_path / "t.jsonl", [short, rec])
    p, c, r = encode_pair(tok, rec)
    assert c != r
    cut = len(p) + 6 if truncation == "right" else len(c) - 3     # both end in EOS and `same`
    assert len(p) + max(len(c), len(r)) > cut
    pairs, stats = load_pairs(path, tok, max_seq_len=cut, truncation=truncation)
    assert len(pairs) == 1 and stats.skipped == {"equal_after_truncation": 1}, stats.skipped
    assert stats.records == stats.examples + sum(stats.skipped.values())
    msg = stats.skip_messages["equal_after_truncation"][0]
    assert msg.startswith(f"{path}:2: chosen and rejected are the same") and f"{cut}" in msg
    assert "skipped equal_after_truncation 1" in stats.summary()
    assert stats.to_dict()["skipped"] == {"equal_after_truncation": 1}
    pairs, stats = load_pairs(path, tok, max_seq_len=4096, truncation=truncation)
    assert len(pairs) == 2 and not stats.skipped          # whole, they differ


def test_pairs_are_never_split_across_micro_batches(pairs, model):
    batches = make_pair_batches(pairs, 3, seed=5, pad_id=model.pad_id)
    seen = []
    for pb in batches:
        n = pb.n_pairs
        assert pb.tokens.shape[0] == 2 * n
        for j, i in enumerate(pb.pairs):
            p = pairs[i]
            row_c, row_r = pb.tokens[j], pb.tokens[n + j]
            np.testing.assert_array_equal(row_c[:len(p.prompt) + len(p.chosen)],
                                          np.concatenate([p.prompt, p.chosen]))
            np.testing.assert_array_equal(row_r[:len(p.prompt) + len(p.rejected)],
                                          np.concatenate([p.prompt, p.rejected]))
        seen += list(pb.pairs)
    assert sorted(seen) == list(range(len(pairs)))


# --------------------------------------------------------------------------- the graph

def test_sequence_log_probs_are_the_sft_paths_token_sums(model, pairs):
    """SequenceCE's per-row sums against the SFT evaluation graph run on each row alone
    (another head-row layout and batch shape: equal to float32 rounding of the sum)."""
    ad = adapted(model)
    pb = make_pair_batches(pairs, 4, shuffle=False, pad_id=model.pad_id)[1]
    b = pb.batch
    tg = L.shift_targets(b.tokens, b.train_mask, b.seg)
    B, T = b.tokens.shape
    T = bucket_length(model, T)
    R = L.rows_bucket(int((tg >= 0).sum(1).max()), T)
    g = EvalGraph(model, ad, B, T, None, rows_per_seq=R)
    try:
        got = g.sequence_logps(b.tokens, b.seg, tg)
    finally:
        g.close()
    for row in range(B):
        n = int((tg[row] >= 0).sum())
        e = EvalGraph(model, ad, 1, T, L.rows_bucket(n, T))
        try:
            ce_sum, _ = e.run(b.tokens[row:row + 1], b.seg[row:row + 1], tg[row:row + 1])
        finally:
            e.close()
        # each of n log-probabilities rounded (a few ulps of its size), then summed
        assert abs(got[row] + ce_sum) <= F32_SPREAD * n * ulps(ce_sum / n, 8) + ulps(ce_sum), (
            row, got[row], -ce_sum)



def test_sequence_weights_of_minus_one_over_n_give_the_sft_gradient(model, pairs):
    """With every sequence's weight dL/dpi = -1/N (N the batch's targets), the per-sequence
    loss is SFT's token mean over the same rows: equal loss gradient, to the float32 rounding
    of that step measured on the same batch (step_rounding.measure)."""
    ad = adapted(model)
    pb = make_pair_batches(pairs, 4, shuffle=False, pad_id=model.pad_id)[0]
    b = pb.batch
    tg = L.shift_targets(b.tokens, b.train_mask, b.seg)
    B, T = b.tokens.shape
    T = bucket_length(model, T)
    N = int((tg >= 0).sum())
    R = L.rows_bucket(int((tg >= 0).sum(1).max()), T)
    g = GradGraph(model, ad, B, T, rows_per_seq=R)
    try:
        g.opt_state.zero_grads()
        lp = g.accumulate_sequences(b.tokens, b.seg, tg, np.full(B, R / N))
        grads = g.opt_state.grads()
    finally:
        g.close()
    rounding = measure(model, ad, B, T, b.tokens, b.seg, tg)
    want = rounding["ref"]
    assert abs(-lp.sum() / N - want["loss"]) <= f32_bound(rounding["loss"], want["loss"])
    for k, v in want["grads"].items():
        err = float(np.abs(grads[k] - v).max())
        bound = F32_SPREAD * max(rounding["grads"][k], ulps(v))
        assert err <= bound, (k, err, bound)



def trainer_for(model, objective="dpo", loss_type="sigmoid"):
    ad = adapted(model)
    tr = PreferenceTrainer(model, ad, AdamWSettings(lr=1e-3),
                           PreferenceSettings(objective, 0.1, loss_type, 0.1))
    return tr, ad


def other_kernels(model):
    """The same model with the BLAS backend toggled (the other F32 matmul kernels), as
    step_rounding.measure loads it."""
    import os
    blas = os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0")
    old = os.environ.get("PYTRAIN_BLAS")
    os.environ["PYTRAIN_BLAS"] = "0" if blas else "1"
    try:
        return pytrain.load_model(model.path, device="cpu", threads=model.runtime.threads)
    finally:
        if old is None:
            del os.environ["PYTRAIN_BLAS"]
        else:
            os.environ["PYTRAIN_BLAS"] = old


def preference_step(model, values, pairs, batches, objective):
    """(loss, sums, gradients) of one preference step over ``batches`` (lists of pair
    indices), the adapter set to ``values``."""
    ad = adapted(model)
    ad.set(values)
    tr = PreferenceTrainer(model, ad, AdamWSettings(lr=1e-3),
                           PreferenceSettings(objective, 0.1, "sigmoid", 0.0))
    try:
        tr.compute_reference("train", pairs, 4)
        loss, v = tr.accumulate([pair_batch(pairs, i, model.pad_id) for i in batches])
        return loss, v, tr.opt_state.grads()
    finally:
        tr.close()



@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_accumulated_micro_batches_equal_one_batch(model, pairs, objective):
    """A step over two micro-batches of 2 pairs and over one batch of the same 4 pairs: the
    same loss, rewards and gradient, to the float32 rounding of that very step measured on
    the same pairs (bounds.py): the one-batch step again with the pairs in reverse order and
    the other matmul kernels."""
    values = adapted(model).get()
    loss1, v1, g1 = preference_step(model, values, pairs, [[0, 1, 2, 3]], objective)
    loss2, v2, g2 = preference_step(model, values, pairs, [[0, 1], [2, 3]], objective)
    other = other_kernels(model)
    try:
        loss_r, v_r, g_r = preference_step(other, values, pairs, [[3, 2, 1, 0]], objective)
    finally:
        other.close()
    assert v1["pairs"] == v2["pairs"] == 4 and v1["correct"] == v2["correct"]
    for key in ("reward_chosen", "reward_rejected"):
        assert abs(v1[key] - v2[key]) <= f32_bound(abs(v1[key] - v_r[key]), v1[key]), key
    assert abs(loss1 - loss2) <= f32_bound(abs(loss1 - loss_r), loss1), (loss1, loss2, loss_r)
    for k, v in g1.items():
        err = float(np.abs(g2[k] - v).max())
        bound = F32_SPREAD * max(float(np.abs(g_r[k] - v).max()), ulps(v))
        assert err <= bound, (k, err, bound)


# --------------------------------------------------------------------------- whole runs

def write_pref_run(folder: Path, name: str = "run", model: Path = FIX / "gqa-f32.gguf",
                   **train) -> Path:
    write_jsonl(folder / "train.jsonl", pair_records() * 4)
    write_jsonl(folder / "valid.jsonl", pair_records())
    t = {"objective": "dpo", "max_steps": 6, "batch_size": 2, "lr": 5e-3, "eval_every": 3,
         "save_every": 0, **train}
    cfg = folder / f"{name}.toml"
    cfg.write_text(f'[model]\npath = "{model}"\ndevice = "cpu"\nthreads = 1\n'
                   f'[data]\ntrain = "train.jsonl"\nvalidation = "valid.jsonl"\n'
                   f'[lora]\nrank = 4\nalpha = 8.0\n[train]\n'
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
                   + f'[output]\ndir = "{folder / name}"\nformats = ["gguf", "peft"]\n')
    return cfg


def metrics_of(out: Path) -> tuple[list[dict], list[dict]]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return ([r for r in recs if "loss" in r and r.get("split") != "valid"],
            [r for r in recs if r.get("split") == "valid"])


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_preference_run_learns_the_preference_and_exports(tmp_path, capsys, objective):
    cfg = write_pref_run(tmp_path, objective=objective, max_steps=12, batch_size=4,
                         eval_every=6)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "run"
    steps, valid = metrics_of(out)
    assert len(steps) == 12 and [v["step"] for v in valid] == [0, 6, 12]
    keys = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert all(keys <= set(r) for r in steps + valid)
    assert valid[-1]["rewards/margins"] > valid[0]["rewards/margins"]
    assert valid[-1]["rewards/accuracies"] > valid[0]["rewards/accuracies"]
    assert valid[-1]["loss"] < valid[0]["loss"]
    if objective == "dpo":       # the policy starts as the reference: no reward, loss log 2
        assert valid[0]["rewards/margins"] == 0.0 and valid[0]["rewards/accuracies"] == 0.0
        assert valid[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-12)
    else:
        assert all("nll_loss" in r for r in steps + valid)
    text = capsys.readouterr().out
    assert "reward accuracy" in text
    # DPO's reference pass and its cache; ORPO has no reference (test_orpo_runs_no_reference_pass)
    assert ("reference log-probabilities of 40 pairs" in text) == (objective == "dpo")
    assert (out / "reference_logps.npz").exists() == (objective == "dpo")
    assert (out / "loss.png").stat().st_size > 0
    from pytrain.formats.adapter_gguf import read_lora_gguf
    from pytrain.formats.adapter_peft import read_peft_adapter
    gguf = read_lora_gguf(out / "adapter.gguf")[2]
    peft = read_peft_adapter(out / "peft", arch="qwen35")[0]
    assert set(gguf) and set(peft)


def test_orpo_runs_no_reference_pass(tmp_path, capsys):
    """ORPO's loss has no reference model: a run computes no base-model log-probabilities,
    writes no cache of them and says nothing of them (the pass cost 103 s of a 144 s run on
    100 pairs of SmolLM2)."""
    cfg = write_pref_run(tmp_path, objective="orpo", max_steps=2, eval_every=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "reference log-probabilities" not in text, text
    assert not (tmp_path / "run" / "reference_logps.npz").exists()
    steps, valid = metrics_of(tmp_path / "run")
    assert len(steps) == 2 and [v["step"] for v in valid] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) and "nll_loss" in r for r in steps + valid)


def test_orpo_results_do_not_depend_on_a_reference_pass(model, pairs):
    """What ORPO computes never reads the reference: a step with the reference pass run
    before it and one without give the same loss, sums and gradient, bit for bit."""
    values = adapted(model).get()
    out = []
    for with_reference in (True, False):
        ad = adapted(model)
        ad.set(values)
        tr = PreferenceTrainer(model, ad, AdamWSettings(lr=1e-3),
                               PreferenceSettings("orpo", 0.1, "sigmoid", 0.0))
        try:
            assert not tr.uses_reference
            if with_reference:
                tr.compute_reference("train", pairs, 4)
            loss, v = tr.accumulate([pair_batch(pairs, [0, 1, 2], model.pad_id),
                                     pair_batch(pairs, [5, 6], model.pad_id)])
            out.append((loss, v, tr.opt_state.grads()))
        finally:
            tr.close()
    (l1, v1, g1), (l2, v2, g2) = out
    assert l1 == l2 and v1 == v2
    for k, g in g1.items():
        np.testing.assert_array_equal(g2[k], g, err_msg=k)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_pytrain_eval_of_a_preference_config_is_the_runs_validation(tmp_path, capsys, objective):
    """`pytrain eval` of a DPO or ORPO config evaluates its validation pairs with the config's
    objective: the run's own validation numbers for the same adapter, exactly (the same
    batches, the same reference pass, the same graphs); without --adapter, the base model's
    (step 0: DPO's log 2 and margin 0).  The Python API's eval is the same path."""
    cfg = write_pref_run(tmp_path, objective=objective, max_steps=3, eval_every=3)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    _, valid = metrics_of(tmp_path / "run")
    adapter = tmp_path / "run" / "adapter.gguf"
    capsys.readouterr()
    for rec, more in ((valid[-1], ["--adapter", str(adapter)]), (valid[0], [])):
        assert main(["eval", str(cfg), *more]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"validation set ({rec['pairs']} pairs, {objective}): "), line
        assert (f"loss {rec['loss']:.4f}  reward accuracy {rec['rewards/accuracies']:.3f}  "
                f"margin {rec['rewards/margins']:.4f}") in line, line
    c = pytrain.resolve_config(cfg)
    t = c.train
    with pytrain.load(c.model.path, adapter, device="cpu", threads=1) as m:
        ev = m.eval(c.data, batch_size=t.batch_size, objective=t.objective, beta=t.beta,
                    loss_type=t.loss_type, label_smoothing=t.label_smoothing)
        records = [json.loads(x) for x in (tmp_path / "valid.jsonl").read_text().splitlines()]
        on_records = m.eval(records, batch_size=t.batch_size, objective=t.objective)
    got = ev.to_dict()
    assert ev.split == "validation" and got == {k: valid[-1][k] for k in got}, (got, valid[-1])
    assert "nll_loss" in got if objective == "orpo" else "nll_loss" not in got
    assert on_records.to_dict() == got          # the file's records, given as records


def interrupt_at(monkeypatch, n: int):
    """SIGINT to this process during the n-th preference step."""
    import os
    import signal
    real, calls = PreferenceTrainer.step, []

    def step(self, micro, lr):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, micro, lr)
    monkeypatch.setattr(PreferenceTrainer, "step", step)
    return real


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, monkeypatch, capsys, objective):
    """Bound: zero (as tests/test_train_run.py's resume test says why): the resumed run reads
    the reference log-probabilities (DPO's) back from the run folder and repeats the same
    float32 operations, across an epoch boundary (4 steps an epoch)."""
    from pytrain.formats.adapter_gguf import read_lora_gguf
    cfg = write_pref_run(tmp_path, objective=objective, max_steps=6, batch_size=8,
                         eval_every=0, schedule="cosine", warmup=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    straight = read_lora_gguf(tmp_path / "run" / "adapter.gguf")[2]
    other = f"output.dir={tmp_path / 'again'}"
    real = interrupt_at(monkeypatch, 3)
    assert main(["train", str(cfg), "--no-progress", "--set", other]) == 130
    assert "interrupted by SIGINT after step 3" in capsys.readouterr().err
    monkeypatch.setattr(PreferenceTrainer, "step", real)
    assert main(["train", str(cfg), "--no-progress", "--set", other, "--resume"]) == 0
    said = capsys.readouterr().out
    assert ("reference log-probabilities: read from" in said) == (objective == "dpo"), said
    assert objective == "dpo" or "reference log-probabilities" not in said
    resumed = read_lora_gguf(tmp_path / "again" / "adapter.gguf")[2]
    assert sorted(resumed) == sorted(straight)
    for k, v in straight.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)
    steps, _ = metrics_of(tmp_path / "again")
    assert [r["step"] for r in steps] == list(range(1, 7))


# --------------------------------------------------------------------------- the reference cache

def reweighted_copy(src: Path, dst: Path) -> None:
    """``src`` with every weight scaled by a random factor near 1: the same header and size
    (the same tensor index and types), other values."""
    from pytrain.formats.gguf_tensors import open_reader
    start = open_reader(src).data_offset
    raw = bytearray(src.read_bytes())
    w = np.frombuffer(raw, np.float32, offset=start, count=(len(raw) - start) // 4).copy()
    w *= np.random.default_rng(0).uniform(0.7, 1.3, w.size).astype(np.float32)
    raw[start:start + 4 * w.size] = w.tobytes()
    dst.write_bytes(bytes(raw))


def cached_elsewhere(tmp_path: Path, model: Path, first: Path, then, capsys) -> tuple:
    """A DPO run on ``first`` copied to ``model``; then ``then(model)`` changes that file, and a
    new run at the same path finds the first run's reference_logps.npz in its folder (as one
    left by a run that stopped before its first checkpoint): (its step-0 validation, its
    log)."""
    import shutil
    shutil.copyfile(first, model)
    cfg = write_pref_run(tmp_path, model=model, max_steps=1, eval_every=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    again = tmp_path / "again"
    again.mkdir()
    shutil.copyfile(tmp_path / "run" / "reference_logps.npz", again / "reference_logps.npz")
    then(model)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={again}"]) == 0
    return metrics_of(again)[1][0], capsys.readouterr().out


def test_a_reference_cache_left_by_another_run_is_not_this_runs(tmp_path, capsys):
    """The reference is the base model: a cache another model left at the same path would
    give the new run a reward margin at step 0, where the policy is the reference (DPO's loss
    log 2, margin 0, as a fresh folder gives).  A fresh run moves it aside with whatever else
    an earlier run left, and computes its own."""
    import shutil
    model = tmp_path / "model.gguf"
    step0, log = cached_elsewhere(tmp_path, model, FIX / "untied-f32.gguf",
                                  lambda m: shutil.copyfile(FIX / "gqa-f32.gguf", m), capsys)
    assert step0["step"] == 0
    assert step0["rewards/margins"] == 0.0 and step0["rewards/accuracies"] == 0.0
    assert step0["loss"] == pytest.approx(np.log(2.0), abs=1e-12)
    assert "(reference_logps.npz) to " in log, log
    assert "reference log-probabilities of 40 pairs" in log


def test_a_reference_cache_made_for_another_model_file_is_recomputed(tmp_path, capsys):
    """The run's own cache, read on --resume, when the model file was rewritten in place with
    other weights (the same header and size, so the checkpoint's base check lets the resume
    through): the cache is keyed on the file's content identity, not its path, so the
    reference is recomputed from the file as it is now, and the log says why."""
    import shutil
    model = tmp_path / "model.gguf"
    shutil.copyfile(FIX / "gqa-f32.gguf", model)
    cfg = write_pref_run(tmp_path, model=model, max_steps=1, eval_every=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    cache = tmp_path / "run" / "reference_logps.npz"
    with np.load(cache) as z:
        before = z["train_chosen"].copy()
    reweighted_copy(FIX / "gqa-f32.gguf", model)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=2"]) == 0
    log = capsys.readouterr().out
    assert "recomputed: made for another model file" in log, log
    assert "reference log-probabilities of 40 pairs" in log
    with np.load(cache) as z:
        assert not np.array_equal(z["train_chosen"], before)


def spoil(path: Path, how: str) -> None:
    """A reference_logps.npz this version cannot use: cut short, another program's npz, this
    project's earlier format (keyed by a digest alone), or not an archive at all."""
    import io
    good = path.read_bytes()
    buf = io.BytesIO()
    if how == "truncated":
        path.write_bytes(good[:len(good) // 2])
        return
    if how == "foreign npz":
        np.savez(buf, weights=np.ones(3))
    elif how == "earlier format":
        with np.load(path) as z:
            np.savez(buf, digest=np.array("0" * 64),
                     **{k: z[k] for k in z.files if k != "made_for"})
    else:
        buf.write(b"not an archive\n")
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("how", ["truncated", "foreign npz", "earlier format", "not an archive"])
def test_an_unusable_reference_cache_is_recomputed_and_said(model, pairs, tmp_path, how):
    """The cache is the run's own file, but a disk filled up, a copy cut short or another
    program can leave anything under its name: it is recomputed (the same values as the
    first computation, which used the same graphs on the same pairs), never a traceback."""
    from pytrain.data.records import DataSplits
    from pytrain.step.preference import REFERENCE_FILE
    splits = DataSplits(pairs[:5], pairs[5:], None, None)

    def reference(log):
        tr = PreferenceTrainer(model, adapted(model), AdamWSettings(lr=1e-3),
                               PreferenceSettings("dpo"))
        try:
            tr.load_or_compute_reference(tmp_path, splits, 4, log)
            return tr.reference
        finally:
            tr.close()
    first = reference(print)
    spoil(tmp_path / REFERENCE_FILE, how)
    said: list[str] = []
    again = reference(said.append)
    assert any(f"{tmp_path / REFERENCE_FILE} recomputed: " in m for m in said), said
    assert any("reference log-probabilities of 8 pairs" in m for m in said), said
    for k in ("train", "valid"):
        for a, b in zip(first[k], again[k]):
            np.testing.assert_array_equal(a, b)
    said.clear()
    reference(said.append)                 # the recomputed cache is read back
    assert said == [f"reference log-probabilities: read from {tmp_path / REFERENCE_FILE}"]


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_two_ranks_equal_one_process_accumulating_two(tmp_path, objective):
    """`mpiexec -n 2` with grad_accum 1 against one process with grad_accum 2: every step's
    loss, rewards and gradient norm, the validations and the adapter, bit for bit (the same
    micro-batches; each step's sums add the same two parts)."""
    import test_distributed as td
    from pytrain.formats.adapter_gguf import read_lora_gguf
    if not td.MPIEXEC.exists():
        pytest.fail(f"{td.MPIEXEC} missing: `make build` installs the mpi extra")
    one = write_pref_run(tmp_path, "one", objective=objective, grad_accum=2, eval_every=3)
    two = write_pref_run(tmp_path, "two", objective=objective, grad_accum=1, eval_every=3)
    td.run(tmp_path, 1, one)
    td.run(tmp_path, 2, two)
    s1, v1 = metrics_of(tmp_path / "one")
    s2, v2 = metrics_of(tmp_path / "two")
    keys = ("loss", "grad_norm", "n_valid", "rewards/margins", "rewards/accuracies")
    assert len(s1) == len(s2) == 6
    for a, b in zip(s1 + v1, s2 + v2):
        assert [a.get(k) for k in keys] == [b.get(k) for k in keys], (a, b)
    a1 = read_lora_gguf(tmp_path / "one" / "adapter.gguf")[2]
    a2 = read_lora_gguf(tmp_path / "two" / "adapter.gguf")[2]
    for k, v in a1.items():
        np.testing.assert_array_equal(a2[k], v, err_msg=k)


@pytest.mark.parametrize("key,value,says", [
    ("data.packing", "true", "batches whole pairs"),
    ("train.recompute", "layers", "no per-sequence loss"),
    ("train.label_smoothing", "0.5", "must be in [0, 0.5)"),
    ("train.loss_type", "kto", "one of"),
])
def test_preference_settings_that_cannot_work_are_config_errors(tmp_path, capsys, key, value,
                                                               says):
    cfg = write_pref_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress", "--set", f"{key}={value}"]) == 1
    err = capsys.readouterr().err
    assert key in err and says in err, err


def test_plan_counts_both_sequences_and_the_reference_pass(tmp_path, capsys):
    """`pytrain plan` of a DPO run: the step's graph is measured for 2 x batch_size sequences
    (a bigger buffer than SFT's batch_size at the same length), and the plan says so."""
    cfg = write_pref_run(tmp_path, batch_size=2)
    set_len = ["--set", "data.max_seq_len=64", "--json"]
    assert main(["plan", str(cfg), *set_len]) == 0
    dpo = json.loads(capsys.readouterr().out)
    assert main(["plan", str(cfg), *set_len, "--set", "train.objective=sft"]) == 0
    sft = json.loads(capsys.readouterr().out)
    assert dpo["batch"][0] == 2 * sft["batch"][0] == 4
    assert dpo["one_graph"] > sft["one_graph"]
    assert any("chosen and rejected" in n and "reference" in n for n in dpo["notes"])
    assert not dpo["layers"] and "objective" in dpo["reason"]
