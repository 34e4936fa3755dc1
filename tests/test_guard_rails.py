"""Nothing is lost: a SIGKILL during a checkpoint save leaves the previous one loadable; an
unwritable output folder is reported before any work; an adapter made for another base is
refused by generate and eval."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from pytrain import checkpoint as ckpt
from pytrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"

SAVER = textwrap.dedent("""
    import sys, numpy as np
    from pathlib import Path
    from pytrain import checkpoint as ckpt

    class Adapter:   # what ckpt.save needs of a LoraAdapter: alpha and get()
        alpha = 8.0
        def __init__(self, step):
            rng = np.random.default_rng(step)
            self.t = {"blk.1.attn_q.weight.lora_a": rng.normal(size=(4, 64)).astype(np.float32),
                      "blk.1.attn_q.weight.lora_b": rng.normal(size=(128, 4)).astype(np.float32)}
        def get(self):
            return self.t

    folder, model = Path(sys.argv[1]), sys.argv[2]
    fp = ckpt.base_fingerprint(model)
    big = {"m.x": np.random.default_rng(0).normal(size=(3_000_000,)).astype(np.float32)}
    step = 0
    while True:
        step += 1
        ckpt.save(folder, step, Adapter(step), big, ckpt.TrainState(step, 0, step, step, fp), keep=2)
        print(step, flush=True)
""")


def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt, delay in enumerate((0.05, 0.13, 0.21)):
        folder = tmp_path / f"ck{attempt}"
        p = subprocess.Popen([sys.executable, str(script), str(folder), str(FIX / "gqa-f32.gguf")],
                             stdout=subprocess.PIPE, env=env, text=True)
        assert p.stdout.readline().strip() == "1"      # one complete checkpoint exists
        time.sleep(delay)                                # now somewhere inside a later save
        p.send_signal(signal.SIGKILL)
        p.wait()
        last = ckpt.latest(folder)
        assert last is not None
        state, tensors, moments = ckpt.load(last, str(FIX / "gqa-f32.gguf"))
        assert last.name == f"step-{state.step:07d}"
        want = np.random.default_rng(state.step).normal(size=(4, 64)).astype(np.float32)
        np.testing.assert_array_equal(tensors["blk.1.attn_q.weight.lora_a"], want)
        assert moments["m.x"].shape == (3_000_000,)


def write_run(tmp_path: Path, out: str) -> Path:
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\npath = "{FIX / "gqa-f32.gguf"}"\n[data]\ntrain = "train.jsonl"\n'
                   f'[train]\nmax_steps = 1\n[output]\ndir = "{out}"\n')
    return cfg


def test_unwritable_output_dir_is_reported_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = write_run(tmp_path, str(blocker / "run"))
    t0 = time.perf_counter()
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output.dir" in err[0] and "not writable" in err[0]
    assert time.perf_counter() - t0 < 5     # refused before loading the model or data


def test_adapter_for_another_base_is_refused(tmp_path, capsys):
    import pytrain
    from pytrain import lora
    from pytrain.adapter_gguf import write_lora_gguf
    from pytrain.lora_targets import select_targets
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu")
    ad = lora.create(m.runtime, m.config, select_targets(m.config), 4, 8)   # layers 1 and 3
    path = write_lora_gguf(tmp_path / "gqa-adapter.gguf", "qwen35", 8.0, ad.get())
    m.close()
    # untied-f32 has DeltaNet layers 0-2: blk.1.attn_q.weight does not exist there
    assert main(["generate", str(FIX / "untied-f32.gguf"), "--adapter", str(path),
                 "--prompt", "hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "blk.1.attn_" in err and "does not exist" in err and str(path) in err
    cfg = write_run(tmp_path, str(tmp_path / "out"))
    cfg.write_text(cfg.read_text().replace("gqa-f32.gguf", "untied-f32.gguf"))
    assert main(["eval", str(cfg), "--adapter", str(path)]) == 1
    assert "does not exist in the base model" in capsys.readouterr().err


def test_lora_dropout_is_refused_naming_the_key(tmp_path, capsys):
    """Dropout on the adapter input is not implemented (no random op in ggml): a config that
    asks for it must stop with the key named, not train silently without it."""
    cfg = write_run(tmp_path, str(tmp_path / "run"))
    assert main(["train", str(cfg), "--no-progress", "--set", "lora.dropout=0.1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.dropout" in err[0]
    assert not (tmp_path / "run" / "adapter.gguf").exists()
