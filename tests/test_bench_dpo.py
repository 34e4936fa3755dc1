"""Smoke test of scripts/bench_dpo.py (one DPO step, pytrain against TRL's DPOTrainer + PEFT):
the whole script at the toy size ("toy" in scripts/bench_common.py's SPECS, made once for the
module by ``bench_common.ensure_model`` under the reference interpreter, as the benchmarks make
their models), one warm-up and one timed step per side, so that a rename in pytrain or in TRL
breaks a test instead of the next benchmark run.  Nothing here is timed.

Besides that every side ran, it checks what the first step must show on every side: both
sides start from B = 0 adapters, so the policy is the reference and the loss is log 2; pytrain's
and TRL's reference log-probabilities of the same sequences agree; TRL with and without
precomputed reference log-probabilities is the same computation.  The float32 bound (derived
once, used for each check): a sequence's log-probability s is a sum over its n completion
targets of per-token log-probabilities; allowing each term an error of 64 float32 roundings
(64 * 2**-24 relative, for the logits' products, the log-sum-exp over the vocabulary and the
sum's own rounding) and no cancellation between them, |ds| <= 64 eps |s|.  The DPO loss of a
pair is -log sigmoid(beta * D), D = (pc - rc) - (pr - rr), so at D = 0 |dL| <= beta / 2 |dD|
<= beta / 2 * 64 eps (|pc| + |rc| + |pr| + |rr|) to first order; a reward beta (p - r) is
within beta * 64 eps (|p| + |r|) of 0.  (The gradient norms are not compared across sides:
pytrain and PEFT initialise the LoRA A matrices from different random streams.)
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from scripts import bench_common as bc

pytestmark = pytest.mark.slow

BETA = 0.1
EPS = 64 * 2.0 ** -24          # 64 float32 roundings, relative (see the module docstring)
PAIRS, PROMPT, COMPLETION, SHORT = 2, 128, 128, 5
SIDES = ("pytrain", "trl", "trl_pre")


# the toy model and the reference interpreter, as the SFT benchmark's smoke test makes them
from test_scripts_bench import ref_python, toy  # noqa: E402,F401  (pytest fixtures)


def run_script(*argv: str, timeout: float = 900) -> str:
    r = subprocess.run([sys.executable, "-m", *argv], cwd=str(bc.REPO), capture_output=True,
                       text=True, timeout=timeout, env=bc.worker_env(1))
    assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-5000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def bench(toy, ref_python, tmp_path_factory) -> dict:
    """python -m scripts.bench_dpo --models toy, one warm-up and one clean step wanted per side;
    the last pair's rejected completion 5 tokens shorter, so that one row is padded."""
    out = tmp_path_factory.mktemp("dpo") / "train-dpo.md"
    run_script("scripts.bench_dpo", "--models", "toy", "--threads", "1", "--steps", "1",
               "--warmup", "1", "--pairs", str(PAIRS), "--prompt-len", str(PROMPT),
               "--completion-len", str(COMPLETION), "--short-rejected", str(SHORT),
               "--quiet-wait", "0", "--cache", str(toy["dir"].parent), "--ref-python",
               ref_python, "--out", str(out))
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    return dict(row=row, out=out)


def test_every_side_ran_the_same_batch(bench):
    """Three sides, the same 2P sequences (real tokens counted alike), tokens/s > 0 and each
    ratio the quotient of the two tokens/s."""
    r = bench["row"]
    tokens = PAIRS * 2 * PROMPT + PAIRS * 2 * COMPLETION - SHORT
    for k in SIDES:
        d = r[k]
        assert d is not None, f"the {k} side failed"
        assert d["tokens"] == tokens, (k, d["tokens"], tokens)
        assert d["batch_shape"] == [2 * PAIRS, PROMPT + COMPLETION], (k, d["batch_shape"])
        assert d["tokens_per_s"] > 0 and d["median_s"] > 0 and len(d["times"]) >= 1, d
        assert d["tokens_per_s"] == d["tokens"] / d["median_s"]
        assert d["peak_rss"] > 0 and d["ref_pass_s"] > 0
        assert len(d["losses"]) == 1 + len(d["times"])          # warm-up + timed steps
    for k in ("trl", "trl_pre"):
        assert r[f"ratio_{k}"] == r["pytrain"]["tokens_per_s"] / r[k]["tokens_per_s"]
    assert r["pytrain"]["lora_params"] == r["trl"]["lora_params"] == r["trl_pre"]["lora_params"]
    assert r["pytrain"]["lora_names"] == r["trl"]["lora_names"] == 8   # q/k/v/o of 2 attn layers
    assert r["trl"]["precompute"] is False and r["trl_pre"]["precompute"] is True


def test_reference_log_probs_agree(bench):
    """pytrain's compute_reference and TRL's reference (in-step and precomputed) give every
    sequence the same log-probability, within 64 float32 roundings of each term."""
    r = bench["row"]
    p, t, tp = r["pytrain"], r["trl"], r["trl_pre"]
    for key in ("ref_chosen", "ref_rejected"):
        assert len(p[key]) == len(t[key]) == len(tp[key]) == PAIRS
        for a, b, c in zip(p[key], t[key], tp[key]):
            assert a < 0 and math.isfinite(a), p[key]
            assert abs(a - b) <= EPS * abs(b), (key, a, b, abs(a - b), EPS * abs(b))
            assert abs(b - c) <= EPS * abs(b), (key, b, c)       # one computation in TRL


def test_first_step_is_log_two_on_every_side(bench):
    """From B = 0 the policy is the reference: loss log 2, rewards and margins 0 (within the
    float32 bound of the module docstring); TRL's two variants take the very same step."""
    r = bench["row"]
    refs = r["pytrain"]
    mag = sum(abs(x) for x in refs["ref_chosen"] + refs["ref_rejected"])
    loss_tol = BETA / 2 * EPS * 2 * mag / PAIRS          # the mean over pairs of each pair's bound
    for k in SIDES:
        d = r[k]
        assert abs(d["first_loss"] - math.log(2)) <= loss_tol, (k, d["first_loss"], loss_tol)
        m = d["first_metrics"]
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(m[key]) <= BETA * EPS * 2 * mag / PAIRS, (k, key, m[key])
        assert all(math.isfinite(x) and 0 < x < 1 for x in d["losses"]), d["losses"]
        assert d["first_grad_norm"] > 0
    t, tp = r["trl"], r["trl_pre"]
    assert t["first_grad_norm"] == pytest.approx(tp["first_grad_norm"], rel=1e-5)
    n = min(len(t["losses"]), len(tp["losses"]))   # a busy machine times more steps (clean_loop)
    assert t["losses"][:n] == pytest.approx(tp["losses"][:n], rel=1e-5, abs=1e-6)


def test_report_table_and_rerender(bench, tmp_path):
    """The markdown's throughput row holds the ratios of the json, and --report-from renders
    the json to the same text."""
    r, out = bench["row"], bench["out"]
    text = out.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| toy | 1 | 2 ("))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[8] == f"**{r['ratio_trl']:.2f}**" and cells[9] == f"**{r['ratio_trl_pre']:.2f}**"
    assert cells[10] == "-"          # train.md has no toy row: no SFT ratio to compare with
    assert "| toy | 1 | pytrain | " in text and "| toy | 1 | TRL pre | " in text
    again = tmp_path / "again.md"
    run_script("scripts.bench_dpo", "--report-from", str(out.with_suffix(".json")),
               "--out", str(again))
    assert again.read_text() == text


def test_sft_ratio_is_read_from_the_committed_table():
    """The comparison cell: train.md's mid row at 2 threads, column "ratio pytrain/HF"."""
    from scripts.bench_dpo import sft_ratio
    got = sft_ratio("mid", 2)
    assert got is not None and float(got) > 0, got
    j = json.loads((bc.REPO / "bench_results" / "train.json").read_text())
    (mid,) = [x for x in j["rows"] if x["name"] == "mid" and x["threads"] == 2]
    assert float(got) == round(mid["pytrain"]["tokens_per_s"] / mid["hf"]["tokens_per_s"], 2)
    assert sft_ratio("toy", 1) is None
