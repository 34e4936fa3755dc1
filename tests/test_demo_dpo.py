"""scripts/demo_dpo.py (``make demo-dpo``): its generated preference pairs, and the whole demo at
toy size (SmolLM2-135M-Instruct, a few pairs, two DPO steps, llama.cpp --lora) so the script
and its result file cannot rot.  bench_results/demo_dpo.* are the full run's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import demo_dpo

ROOT = Path(__file__).resolve().parent.parent


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pairs_prefer_the_format_and_keep_held_out_out_of_training(tmp_path):
    """Every pair: the chosen answer is exactly the behaviour, the rejected one is not but
    holds the same content; the held-out prompts (validation and generation) share no prompt
    with training or with each other; the same seed writes the same files."""
    data = demo_dpo.write_data(tmp_path, 120, 24, 20)
    files = {k: read_jsonl(tmp_path / f"{k}.jsonl") for k in ("train", "valid", "held_out")}
    assert [len(files[k]) for k in ("train", "valid", "held_out")] == [120, 24, 20]
    for k in ("train", "valid"):        # TRL's conversational records, nothing else
        assert all(set(r) == {"prompt", "chosen", "rejected"} for r in files[k])
    for r in data["train"] + data["valid"] + data["held_out"]:
        chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert demo_dpo.behaviour(chosen) and demo_dpo.correct(chosen, r["answer"])
        assert not demo_dpo.behaviour(rejected) and demo_dpo.mentions(rejected, r["answer"])
    prompt = lambda r: r["prompt"][0]["content"]
    train = {prompt(r) for r in files["train"]}
    valid = {prompt(r) for r in files["valid"]}
    held = {prompt(r) for r in files["held_out"]}
    assert len(train) == 120 and len(valid) == 24 and len(held) == 20
    assert not (train & valid) and not (train & held) and not (valid & held)
    assert {r["family"] for r in data["train"]} == {"arith", "unit", "age", "capital"}
    again = demo_dpo.write_data(tmp_path / "again", 120, 24, 20)
    assert again == data


def test_behaviour_regex():
    assert demo_dpo.behaviour("ANSWER: 42") and demo_dpo.behaviour(" ANSWER: Tanmir \n")
    for text in ("ANSWER", "ANSWER:", "ANSWER: 42\nThe sum is 42.", "Answer: 42", "42",
                 "The answer is ANSWER: 42", "ANSWER:42", "ANSWER: ANSWER: ANSWER:", ""):
        assert not demo_dpo.behaviour(text), text
    assert demo_dpo.correct("ANSWER: 42", "42") and not demo_dpo.correct("ANSWER: 41", "42")


@pytest.mark.slow
def test_demo_dpo_toy_size(tmp_path):
    """python -m scripts.demo_dpo at toy size: base answers, two DPO steps, adapted answers in
    pytrain and llama.cpp, and the result files with every number in its range."""
    from llama_cpp_check import built_binary, fetched_model
    fetched_model("smollm2", "93 MB")
    if built_binary("llama_generate") is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp`")
    run, res = tmp_path / "run", tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "scripts.demo_dpo", "--pairs", "12", "--valid", "4",
                        "--prompts", "3", "--steps", "2", "--out", str(run), "--results", str(res),
                        "--set", "train.batch_size=4", "--set", "train.eval_every=1"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (f"demo_dpo exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    j = json.loads((res / "demo_dpo.json").read_text())
    assert (j["train_pairs"], j["valid_pairs"], j["n_held_out"], j["steps"]) == (12, 4, 3, 2)
    assert j["objective"] == "dpo" and j["rank"] == 8 and j["targets"] == "q/k/v/o"
    before, after = j["valid_before"], j["valid_after"]
    assert before["step"] == 0 and after["step"] == 2
    # step 0: the policy is the reference, every reward is 0
    assert before["accuracy"] == 0.0 and before["margin"] == 0.0
    assert before["loss"] == pytest.approx(0.6931, abs=1e-3)
    for v in (before, after):
        assert 0.0 <= v["accuracy"] <= 1.0
    assert after["loss"] < before["loss"]      # two steps on pairs of one kind: it moves
    assert 0.0 <= j["base_prefers_chosen"] <= 1.0
    for k in ("base", "adapted", "llama_base", "llama_lora"):
        assert 0 <= j[f"correct_{k}"] <= j[f"behaviour_{k}"] <= 3
        assert j[f"correct_{k}"] <= j[f"mentions_{k}"] <= 3
    assert 0 <= j["same_tokens_llama_lora"] <= 3 and 0 <= j["same_tokens_llama_base"] <= 3
    assert 0 < j["seconds"]["reference"] < j["seconds"]["train"]
    assert len(j["examples"]) == 3 and j["seconds"]["total"] > 0
    md = (res / "demo_dpo.md").read_text()
    assert "| held-out reward accuracy (4 pairs) |" in md and "llama.cpp" in md
    assert (run / "adapter.gguf").exists()
    train = {x["prompt"][0]["content"] for x in read_jsonl(run / "data" / "train.jsonl")}
    assert not train & {x["prompt"] for x in j["examples"]}
