"""Fast versions of scripts/masking_experiments.py (the same functions, tiny settings),
asserting the direction and size of each effect: seed 003 on the embedded default model (32
steps), the rest on the converter-made gqa fixture (random weights, vocab 512).  The tests
run seed 0; margins were chosen after running seeds 0-4 (data, adapter init and batch order
all follow the seed), and each docstring says what those seeds gave (re-measured on the build
with DeltaNet chunks of 32).  About 30 s on this
project's 2-core machine (one ggml thread), longer when other jobs share the cores."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35" / "gqa-f32.gguf"
pytestmark = pytest.mark.slow   # tens of seconds: real (tiny) training runs
SEED = 0
DEFAULT = ROOT / "pytrain" / "assets" / "default-model.gguf"
BASE = [f"model.path={FIX}", "model.threads=1"]


@pytest.fixture(scope="module")
def X():
    from scripts import masking_experiments
    return masking_experiments


def test_seed003_full_sequence_loss_teaches_the_model_to_write_questions(X, tmp_path):
    """Embedded model (it knows the chat format, so 32 steps suffice), a+b for a, b <= 20.
    Seeds 0-4: question share full 0.59-0.91, masked 0-0.03, base 0-0.06 (16 samples per
    prompt); answer-token loss after 32 steps masked 1.14-1.30, full 1.04-1.32 (no consistent
    order at this size, so not asserted), base 2.46-3.05."""
    res = X.run_seed003(tmp_path, [f"model.path={DEFAULT}", "train.max_steps=32",
                                   "train.save_every=32", "train.eval_every=0",
                                   "train.batch_size=8", "train.lr=1e-2", "train.warmup=0"],
                        n_train=96, n_test=16, op="+", lo=0, hi=20, n_free=16, max_new=12,
                        seed=SEED, plot=False)
    masked, full = res["runs"]["assistant_only"], res["runs"]["all"]
    # the fingerprint: prompted with no question, the unmasked model writes one
    assert full["questions"]["all"] >= 0.4
    assert masked["questions"]["all"] <= 0.1 and res["base"]["questions"]["all"] <= 0.15
    # both learned something about the answers
    for r in (masked, full):
        assert r["curve"][-1][2] < res["base"]["answer_loss"] - 0.8


def test_seed000_training_on_padding_misleads_and_hurts(X, tmp_path):
    """Fixture model, 16 chats of 1-3 exchanges, batch 8, 3 epochs of 2 steps, lr 1e-2.
    Seeds 0-4 (DeltaNet chunks of 32): validation padding 0.26-0.63; masked validation loss
    after 3 epochs fix 4.24-5.36, bug 6.05-7.41 (gap 0.94-2.24); the buggy metric of the bug
    run 2.4-4.9, i.e. 2.2-4.5 below that run's masked loss."""
    res = X.run_seed000(tmp_path, BASE + ["train.batch_size=8", "train.lr=1e-2"],
                        n_train=16, n_valid=8, p_long=0.25, max_turns=3, seed=SEED, plot=False)
    bug, fix = res["runs"]["bug"]["epochs"], res["runs"]["fix"]["epochs"]
    assert res["valid_padding"] >= 0.2
    # the correct (masked) validation loss: the fix learns the answers, the bug learns less
    assert fix[-1]["valid_loss"] < fix[0]["valid_loss"]
    assert fix[-1]["valid_loss"] < bug[-1]["valid_loss"] - 0.5
    # what the bug reports is not the masked loss: far lower, dominated by easy pad targets
    assert bug[-1]["valid_bug_metric"] < bug[-1]["valid_loss"] - 1.0


def test_padding_width_moves_only_the_buggy_loss(X, tmp_path):
    """Seeds 0-4, content widths 50-57 run at 64 (DeltaNet chunks of 32), then 128 and 256
    (padding 11-22% -> 78-81%): the masked loss and its gradient did not move at all (0.0);
    the buggy loss spread 5.5-6.2 and its gradient moved 1.7-6.8 (relative)."""
    res = X.run_padwidth(tmp_path, BASE, n_examples=3, widths=None, max_turns=1, seed=SEED,
                         plot=False)
    rows = res["rows"][:3]
    assert rows[0]["padding"] < 0.25 and rows[-1]["padding"] > 0.5
    for r in rows[1:]:
        assert abs(r["fix_loss"] - rows[0]["fix_loss"]) < 1e-4
        assert r["fix_n_valid"] == rows[0]["fix_n_valid"]
        assert r["fix_grad_change"] < 1e-4
    spread = max(r["bug_loss"] for r in rows) - min(r["bug_loss"] for r in rows)
    assert spread > 2.0
    assert rows[-1]["bug_grad_change"] > 0.5


def test_mean_of_means_departs_from_the_token_mean_as_valid_counts_diverge(X, tmp_path):
    """Seeds 0-4: pytrain's accumulation vs one batch <= 5.1e-7 (gradient, relative) and
    <= 6.7e-6 (loss); mean of means vs token mean: 0 at equal counts, 0.05-0.09 at a count
    ratio of ~1.5, 1.3-2.3 at ratios 52-78."""
    res = X.run_accum(tmp_path, BASE, n_pairs=3, n_data=48, max_turns=3, seed=SEED, plot=False)
    rows = res["rows"]
    for r in rows:   # pytrain's accumulation equals one batch of everything
        assert r["accum_vs_one_batch"] < 1e-4
        assert abs(r["token_mean_loss"] - r["one_batch_loss"]) < 1e-4
    equal, mild, skewed = rows
    assert equal["ratio"] == 1.0 and equal["mom_vs_token_mean"] < 1e-5
    assert 1.2 < mild["ratio"] < 2 and 0.02 < mild["mom_vs_token_mean"] < 0.3
    assert skewed["ratio"] > 10 and skewed["mom_vs_token_mean"] > 1.0


def test_packing_without_sample_ids_leaks_and_trains_boundaries(X, tmp_path):
    """Seeds 0-4: with sample ids the packed rows match the samples alone to <= 1e-6 (loss)
    and 3e-6 (gradient, relative); with one shared id the gradient is 0.37-0.57 off and one
    extra target per boundary is trained."""
    res = X.run_packing(tmp_path, BASE, max_turns=2, seed=SEED, masks=("all",), plot=False)
    r = res["rows"]["all"]
    iso, leak, both = r["cases"]
    assert r["n_samples"] > r["shape"][0]            # rows really hold several samples
    assert iso["n_valid"] == r["alone_n_valid"] and abs(iso["loss_vs_alone"]) < 1e-4
    assert iso["grad_vs_alone"] < 1e-4
    assert leak["n_valid"] == r["alone_n_valid"] and leak["grad_vs_alone"] > 0.2
    boundaries = r["n_samples"] - r["shape"][0]
    assert both["n_valid"] == r["alone_n_valid"] + boundaries
