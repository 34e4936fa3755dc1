"""Samples while training (samples.jsonl) and TensorBoard event files, read back with
TensorBoard's own reader (the tensorboard extra, which `make test` installs: without it these
tests fail, they do not skip)."""
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from pytrain.cli import main
from test_train_run import FIX, adapter_of, records, write_config, write_data


def samples(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]


def test_samples_are_the_models_greedy_generations_and_do_not_change_training(tmp_path,
                                                                              capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=12, eval_every=0, sample_every=5,
                       sample_max_tokens=8, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    got = samples(out)
    # before the first step, every sample_every steps, after the last: 3 prompts each
    assert [(g["step"], g["index"]) for g in got] == \
        [(s, i) for s in (0, 5, 10, 12) for i in range(3)]
    printed = capsys.readouterr().out
    assert "step 0: sample 1/3:" in printed and "step 12: sample 1/3:" in printed
    # the prompts are the first validation examples' (up to their first target): the chat
    # template's user turn and the assistant header (with Qwen3.5's empty thinking block)
    assert got[0]["prompt"] == ("<|im_start|>user\nWhat does the cow say?<|im_end|>\n"
                                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the last samples are the final adapter's greedy generations
    from pytrain.cli import _load_adapter
    from pytrain.models.model import load_model
    model = load_model(FIX / "gqa-f32.gguf", "cpu", 2)
    try:
        ad = _load_adapter(model, out / "adapter.gguf")
        from pytrain.data import load_data
        from pytrain.config import load_config
        ex = load_data(load_config(cfg).data, model.tokenizer).valid[0]
        prompt = ex.tokens[:int(np.argmax(ex.train_mask))].tolist()
        ids = model.generate(prompt, 8, lora=ad.hook)
        assert got[-3]["completion"] == model.tokenizer.decode(ids, skip_special=True)
        assert got[-3]["tokens"] == len(ids)
    finally:
        model.close()
    # generating between steps leaves training as it was: the same adapter, bit for bit
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={tmp_path / 'b'}",
                 "--set", "train.sample_every=0"]) == 0
    straight, sampled = adapter_of(tmp_path / "b"), adapter_of(out)
    for k in straight:
        np.testing.assert_array_equal(sampled[k], straight[k], err_msg=k)
    assert not (tmp_path / "b" / "samples.jsonl").exists()


def test_configured_prompts_go_through_the_chat_template(tmp_path):
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=2, eval_every=0, sample_every=2, sample_max_tokens=4,
                       sample_prompts=["Hello there?"], formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    got = samples(tmp_path / "out")
    assert [g["step"] for g in got] == [0, 2]
    assert got[0]["prompt"].startswith("<|im_start|>user\nHello there?<|im_end|>\n"
                                       "<|im_start|>assistant")


def test_tensorboard_holds_the_metrics_and_samples(tmp_path, monkeypatch, capsys):
    """Scalars and samples as TensorBoard reads them; an interrupted and resumed run leaves
    each step once (the resumed run purges what the first wrote past its checkpoint)."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator, TENSORS, SCALARS)
    from tensorboard.util import tensor_util
    from pytrain.step.trainer import Trainer
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=8, eval_every=4, sample_every=4, sample_max_tokens=6,
                       save_every=4, formats=["gguf"])
    cfg.write_text(cfg.read_text() + "tensorboard = true\n")
    real_step, calls = Trainer.step, []

    def step_then_sigint(self, micro, lr):
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", step_then_sigint)
    assert main(["train", str(cfg), "--no-progress"]) == 130
    monkeypatch.setattr(Trainer, "step", real_step)
    out = tmp_path / "out"
    # resumed from step 4: the event files hold steps 5 and 6 of the first attempt, which
    # the resumed run trains again
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 str(out / "checkpoints" / "step-0000004")]) == 0
    ea = EventAccumulator(str(out), size_guidance={TENSORS: 0, SCALARS: 0})
    ea.Reload()
    recs = records(out)
    steps = [r for r in recs if "loss" in r and "split" not in r]
    valid = [r for r in recs if r.get("split") == "valid"]
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in steps] == list(range(1, 9))
    np.testing.assert_array_equal([e.value for e in loss],
                                  np.float32([r["loss"] for r in steps]))
    assert [e.step for e in ea.Scalars("train/lr")] == list(range(1, 9))
    assert {"train/grad_norm", "train/tokens_per_s", "valid/loss", "valid/accuracy",
            "valid/perplexity"} <= set(ea.Tags()["scalars"])
    assert [(e.step, e.value) for e in ea.Scalars("valid/loss")] == \
        [(r["step"], np.float32(r["loss"])) for r in valid]
    text = ea.Tensors("samples/0")
    assert [e.step for e in text] == [0, 4, 8]
    last = tensor_util.make_ndarray(text[-1].tensor_proto).item().decode()
    final = [g for g in samples(out) if g["step"] == 8 and g["index"] == 0][0]
    assert final["completion"].replace("\n", "\n    ") in last and "**completion**" in last


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch, capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=1)
    cfg.write_text(cfg.read_text() + "tensorboard = true\n")
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)     # as if not installed
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "run.toml" in err and "output.tensorboard" in err and "pytrain[tensorboard]" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", ["conversational", "standard"])
def test_configured_prompts_of_a_preference_run_follow_its_records(tmp_path, kind):
    """DPO on conversational pairs trains on chat-template renderings: a configured sample
    prompt is asked the same way (a user turn and the assistant header), as for SFT chat
    records; on standard (plain-text) pairs it is raw text, as they are."""
    from test_preference import pair_records, write_jsonl, write_pref_run
    cfg = write_pref_run(tmp_path, max_steps=1, eval_every=0, sample_every=1,
                         sample_max_tokens=4, sample_prompts=["Hello there?"])
    if kind == "standard":
        plain = [{"prompt": f"Q: {r['prompt'][-1]['content']}\nA:",
                  "chosen": " " + r["chosen"][0]["content"],
                  "rejected": " " + r["rejected"][0]["content"]} for r in pair_records()]
        write_jsonl(tmp_path / "train.jsonl", plain * 4)
        write_jsonl(tmp_path / "valid.jsonl", plain)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    got = samples(tmp_path / "run")
    assert [g["step"] for g in got] == [0, 1]
    if kind == "conversational":
        assert got[0]["prompt"].startswith("<|im_start|>user\nHello there?<|im_end|>\n"
                                           "<|im_start|>assistant"), got[0]["prompt"]
    else:
        assert got[0]["prompt"] == "Hello there?", got[0]["prompt"]
