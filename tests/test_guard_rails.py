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
import pytest

from pytrain.run import checkpoint as ckpt
from pytrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"

SAVER = textwrap.dedent("""
    import os, shutil, sys, time
    import numpy as np
    from pathlib import Path
    from pytrain.run import checkpoint as ckpt

    class Adapter:   # what ckpt.save needs of a LoraAdapter: alpha and get()
        alpha = 8.0
        def __init__(self, version):
            rng = np.random.default_rng(version)
            self.t = {"blk.1.attn_q.weight.lora_a": rng.normal(size=(4, 64)).astype(np.float32),
                      "blk.1.attn_q.weight.lora_b": rng.normal(size=(128, 4)).astype(np.float32)}
        def get(self):
            return self.t

    folder, model, freeze_at = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    armed = False

    def phase(name):
        # the saver's steps, reported as they happen; at the chosen one it freezes there
        # until the test's SIGKILL lands
        if armed:
            print(f"phase {name}", flush=True)
            if name == freeze_at:
                print(f"frozen at {name}", flush=True)
                time.sleep(600)

    real_replace, real_savez = os.replace, np.savez
    def replace(src, dst):
        real_replace(src, dst)
        if Path(dst).name.startswith(".replaced-"):
            phase("old-moved-aside")
        elif Path(src).name.startswith(".tmp-"):
            phase("new-in-place")
    def savez(f, **arrays):
        phase("half-written")
        real_savez(f, **arrays)
    os.replace, np.savez = replace, savez

    fp = ckpt.base_fingerprint(model)
    big = {"m.x": np.random.default_rng(0).normal(size=(300_000,)).astype(np.float32)}
    for k, v in Adapter(0).t.items():      # a moment per adapter tensor, as load checks
        big["m." + k] = big["v." + k] = np.zeros_like(v)
    def save(step, version):
        ckpt.save(folder, step, Adapter(version), big,
                  ckpt.TrainState(step, 0, step, version, fp), keep=3, arch="qwen35")
    save(1, 1)
    save(2, 2)
    armed = True
    save(2, 102)         # step 2 again (a run resumed from step 1): replaces the first one
    print("done", flush=True)
""")


@pytest.mark.parametrize("freeze_at, survivor", [
    ("half-written", 2), ("old-moved-aside", 2), ("new-in-place", 102)])
def test_sigkill_inside_a_checkpoint_save_loses_nothing(tmp_path, freeze_at, survivor):
    """A saver replaces checkpoint step-2 with a new step-2 and is SIGKILLed at a chosen point
    inside that save: while the new files are half written, after the old checkpoint was
    moved aside, after the new one is in place.  Its own report ("frozen at ...") proves the
    kill landed there.  Afterwards ``latest`` finds a complete step-2, the old one or the new
    one (``adam_t`` says which), with its own tensors, and no temporary folder is left."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    folder = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, str(script), str(folder), str(FIX / "gqa-f32.gguf"),
                          freeze_at], stdout=subprocess.PIPE, env=env, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line.strip())
        if line.startswith("frozen at"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert seen[-1] == f"frozen at {freeze_at}", seen
    assert "done" not in seen
    last = ckpt.latest(folder)
    assert last is not None and last.name == "step-0000002"
    state, tensors, moments = ckpt.load(last, str(FIX / "gqa-f32.gguf"))
    assert state.step == 2 and state.adam_t == survivor
    want = np.random.default_rng(survivor).normal(size=(4, 64)).astype(np.float32)
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight.lora_a"], want)
    assert moments["m.x"].shape == (300_000,)
    assert sorted(x.name for x in folder.iterdir()) == ["step-0000001", "step-0000002"]


def write_run(tmp_path: Path, out: str) -> Path:
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\npath = "{FIX / "gqa-f32.gguf"}"\n[data]\ntrain = "train.jsonl"\n'
                   f'[train]\nmax_steps = 1\n[output]\ndir = "{out}"\n')
    return cfg


def test_unwritable_output_dir_is_reported_before_training(tmp_path, capsys, monkeypatch):
    """Refused before the model or the data is read: loading either would raise here."""
    from pytrain.run import loop as run

    def never(*a, **k):
        raise AssertionError("the model or data was loaded before the output folder was checked")
    monkeypatch.setattr(run, "load_model", never)
    monkeypatch.setattr(run, "load_data", never)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = write_run(tmp_path, str(blocker / "run"))
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output.dir" in err[0] and "not writable" in err[0]


def test_token_ids_outside_the_vocabulary_are_refused_not_aborted(tmp_path):
    """ggml's GET_ROWS aborts the process (SIGABRT) on an id >= n_vocab: refused before any
    graph runs, in a subprocess so that a regression kills only it."""
    code = textwrap.dedent(f"""
        import numpy as np, pytrain
        from pytrain.models.model import TokenIdError
        m = pytrain.load_model({str(FIX / "gqa-f32.gguf")!r}, device="cpu", threads=1)
        V = m.config.n_vocab
        for call in (lambda: m.logits(np.array([1, 2, V])),
                     lambda: m.logits(np.array([[1, -1]])),
                     lambda: m.generate([3, V + 7], 2)):
            try:
                call()
            except TokenIdError as e:
                print("refused:", e)
        print("alive")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "alive" and len(lines) == 4, r.stdout
    assert "token id 512 at index (0, 2) is outside the model's vocabulary (ids 0..511)" in lines[0]
    assert "token id -1" in lines[1] and "prompt: token id 519" in lines[2]


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path):
    from scripts.gguf_models import with_keys
    from pytrain.models.model_file import ModelFileError
    import pytrain
    import gguf
    r = gguf.GGUFReader(str(FIX / "gqa-f32.gguf"))
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())
    bad = with_keys(FIX / "gqa-f32.gguf", tmp_path / "bad.gguf", {
        "tokenizer.ggml.tokens": tokens + [f"extra{i}" for i in range(5)],
        "tokenizer.ggml.token_type": [1] * (len(tokens) + 5)})
    with pytest.raises(ModelFileError, match=r"bad.gguf: the tokenizer has \d+ tokens but "
                                             r"token_embd.weight has \d+ rows"):
        pytrain.load_model(bad, device="cpu")


def test_adapter_for_another_base_is_refused(tmp_path, capsys):
    import pytrain
    from pytrain.models import lora
    from pytrain.formats.adapter_gguf import write_lora_gguf
    from pytrain.models.lora_targets import select_targets
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


def test_lora_dropout_with_a_preference_objective_is_refused_naming_the_key(tmp_path, capsys):
    """Preference steps compute the policy twice (a forward for the pair derivatives, then the
    weighted forward and backward), which dropout would make two different networks; TRL
    disables dropout there.  The config must stop with the key named, not train otherwise."""
    cfg = write_run(tmp_path, str(tmp_path / "run"))
    assert main(["train", str(cfg), "--no-progress", "--set", "lora.dropout=0.1",
                 "--set", "train.objective=dpo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.dropout" in err[0] and "disable_dropout" in err[0]
    assert not (tmp_path / "run" / "adapter.gguf").exists()
