"""The Python API (pytrain.api, docs/python.md): the guide's example runs as written, a run's
RunResult names the files it wrote, ``pytrain.train`` writes the CLI's adapter bit for bit,
LoadedModel's generate/logprobs/eval agree with the CLI and the model, overrides are checked
and named, and ``import pytrain`` loads no native code."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pytrain
from pytrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "config" / "demo.toml"
MODEL = ROOT / "pytrain" / "assets" / "default-model.gguf"
VALID = ROOT / "pytrain" / "assets" / "demo_valid.jsonl"
# the demo at toy size: one step, validated after it; min_delta 10 makes that validation "no
# improvement" although its loss is lower (a new best), so the run stops early at step 1
TOY = {"train.max_steps": 3, "train.eval_every": 1, "train.early_stopping_patience": 1,
       "train.early_stopping_min_delta": 10.0, "model.device": "cpu",
       "output.formats": ["gguf", "peft"]}


def cli_sets(overrides: dict) -> list[str]:
    """The same overrides as the command line's --set arguments."""
    out = []
    for k, v in overrides.items():
        out += ["--set", f"{k}={json.dumps(v)}"]
    return out


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "run"
    return pytrain.train(DEMO, overrides={**TOY, "output.dir": out}, progress=False, log=None)


def test_import_pytrain_loads_no_native_code():
    """``import pytrain`` (the facade and the API module) loads
    neither ggml's cffi extension nor the ggml wrapper nor numpy."""
    code = ("import pytrain, sys; print('pytrain._native._ggml' in sys.modules or "
            "any(m == 'pytrain.ggml' or m.startswith('pytrain.ggml.') or m == 'numpy' "
            "for m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


def test_train_is_the_api_function():
    """``pytrain.train`` is the API's function itself, re-exported: no package shares the
    name (the trainer's modules are ``pytrain.step``, ``pytrain.run`` and ``pytrain.plan``)."""
    import inspect

    import pytrain.api
    from pytrain.run import loop
    assert pytrain.train is pytrain.api.train
    assert pytrain.run.loop is loop
    assert "overrides" in inspect.signature(pytrain.train).parameters


@pytest.mark.slow
def test_the_guide_runs(tmp_path, monkeypatch):
    """Every ```python block of docs/python.md, in order, in one namespace, from the
    repository root; the run folder moved to tmp_path."""
    text = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks and "pytrain.train(" in blocks[0]
    code = "\n".join(blocks)
    assert code.count('"runs/python-demo"') == 1
    out = tmp_path / "python-demo"
    code = code.replace('"runs/python-demo"', repr(str(out)))
    monkeypatch.chdir(ROOT)
    ns: dict = {}
    exec(compile(code, str(ROOT / "docs" / "python.md"), "exec"), ns)
    assert (out / "adapter.gguf").exists() and ns["result"].steps == 3
    assert (out / "peft-export" / "adapter_config.json").exists()
    assert np.isfinite(ns["lp"]).all() and (ns["lp"] <= 0).all()
    assert ns["ev"].n_valid > 0


@pytest.mark.slow
def test_run_result_names_what_the_run_wrote(toy_run):
    r = toy_run
    out = r.out_dir
    recs = [json.loads(line) for line in r.metrics.read_text().splitlines()]
    steps = [x for x in recs if "loss" in x and x.get("split") != "valid"]
    valid = [x for x in recs if x.get("split") == "valid"]
    assert r.metrics == out / "metrics.jsonl" and r.plot == out / "loss.png" and r.plot.exists()
    assert r.adapter == out / "adapter.gguf" and r.adapter.exists()
    assert r.peft == out / "peft" and (r.peft / "adapter_model.safetensors").exists()
    # stopped early after the first step's validation, which is the best
    assert r.steps == steps[-1]["step"] == 1
    assert r.early_stop and r.early_stop.startswith("early stopping:")
    assert any(x.get("early_stop") == r.early_stop for x in recs)
    assert (r.best_step, r.best_loss) == (valid[-1]["best_step"], valid[-1]["best_loss"]) == \
        (1, valid[-1]["loss"])
    assert r.best_adapter == out / "adapter.best.gguf" and r.best_adapter.exists()
    assert r.best_peft == out / "peft-best" and r.best_peft.is_dir()
    assert r.final_eval["loss"] == valid[-1]["loss"]
    assert r.final_eval["n_valid"] == valid[-1]["n_valid"] > 0
    assert r.samples is None
    assert load_config(out / "config.toml") == r.config
    from pytrain.formats.adapter_gguf import read_lora_gguf
    last, best = read_lora_gguf(r.adapter)[2], read_lora_gguf(r.best_adapter)[2]
    assert last.keys() == best.keys() and all(np.array_equal(last[k], best[k]) for k in last)


@pytest.mark.slow
def test_train_writes_the_clis_adapter_bit_for_bit(toy_run, tmp_path, capsys):
    """The same config and overrides through ``pytrain train`` and through pytrain.train
    (the toy run): the same adapter file, byte for byte, and the same lines at the end."""
    from pytrain.cli import main
    out = tmp_path / "cli"
    capsys.readouterr()
    assert main(["train", str(DEMO), "--no-progress", *cli_sets(TOY),
                 "--set", f"output.dir={json.dumps(str(out))}"]) == 0
    said = capsys.readouterr().out
    assert (out / "adapter.gguf").read_bytes() == toy_run.adapter.read_bytes()
    assert (out / "adapter.best.gguf").read_bytes() == toy_run.best_adapter.read_bytes()
    assert f"best:     {out / 'adapter.best.gguf'} (step {toy_run.best_step}," in said
    assert f"stopped:  {toy_run.early_stop}" in said


@pytest.mark.slow
def test_loaded_model_agrees_with_the_cli_and_the_model(toy_run, capsys):
    """generate equals ``pytrain generate`` (chat and raw), eval on the config's [data]
    equals ``pytrain eval`` and eval on the records of the file equals eval on the file,
    logprobs equal the log-softmax of the model's logits."""
    from pytrain.cli import main
    adapter = str(toy_run.adapter)
    args = ["generate", str(MODEL), "--adapter", adapter, "--device", "cpu",
            "--max-new-tokens", "12"]
    capsys.readouterr()
    assert main([*args, "--prompt", "What does the cow say?"]) == 0
    assert main([*args, "--raw", "--prompt", "The cow says"]) == 0
    cli_chat, cli_raw = capsys.readouterr().out.splitlines()
    assert main(["eval", str(DEMO), "--adapter", adapter, "--set", 'model.device="cpu"']) == 0
    cli_eval = capsys.readouterr().out.strip()
    with pytrain.load(MODEL, adapter=adapter, device="cpu") as m:
        assert m.generate([{"role": "user", "content": "What does the cow say?"}],
                          max_tokens=12) == cli_chat
        assert m.generate("The cow says", max_tokens=12) == cli_raw
        ev = m.eval(toy_run.config.data, batch_size=toy_run.config.train.batch_size)
        assert cli_eval == (f"validation set ({ev.examples} examples, {ev.n_valid} target "
                            f"tokens): loss {ev.loss:.4f}  accuracy {ev.accuracy:.3f}  "
                            f"perplexity {ev.perplexity:.2f}")
        assert ev.split == "validation"
        assert ev.loss == pytest.approx(toy_run.final_eval["loss"], rel=1e-6)
        records = [json.loads(line) for line in VALID.read_text().splitlines()]
        on_file = m.eval(VALID, max_seq_len=256)
        assert m.eval(records, max_seq_len=256) == on_file
        assert on_file.to_dict() == pytest.approx(ev.to_dict(), rel=1e-6)
        ids = m.tokenize("The cow says moo.")
        lp = m.logprobs("The cow says moo.")
        logits = m.model.logits(np.array(ids), lora=m.adapter.hook).astype(np.float64)
        ref = [logits[i, ids[i + 1]] - np.log(np.exp(logits[i] - logits[i].max()).sum())
               - logits[i].max() for i in range(len(ids) - 1)]
        assert lp.shape == (len(ids) - 1,)
        np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(m.logprobs(ids), lp)
    assert m.model is None                      # closed by the with block


def test_overrides_are_checked_and_named():
    cfg = pytrain.resolve_config(DEMO, {"train.max_steps": 5, "output.dir": Path("x")})
    assert cfg.train.max_steps == 5 and cfg.output.dir == str((Path.cwd() / "x").resolve())
    assert cfg.origins["train.max_steps"] == "overrides['train.max_steps']"
    with pytest.raises(ConfigError, match=r"^overrides\['train.lr'\]: train.lr: expected a "
                                          r"number, got str '1e-4'"):
        pytrain.resolve_config(DEMO, {"train.lr": "1e-4"})
    with pytest.raises(ConfigError, match=r"overrides\['train.learning_rate'\]: "
                                          r"train.learning_rate: unknown key; did you mean `lr`"):
        pytrain.resolve_config(DEMO, {"train.learning_rate": 1e-4})
    with pytest.raises(ConfigError, match=r"expected a \"section.key\" name"):
        pytrain.resolve_config(DEMO, {"max_steps": 5})
    # the command line's strings go the same way, parsed as TOML
    assert pytrain.resolve_config(DEMO, ["train.max_steps=5", 'output.dir="x"']) == cfg


def test_a_config_object_and_a_dict_take_overrides():
    base = load_config(DEMO)
    assert pytrain.resolve_config(base) is base
    cfg = pytrain.resolve_config(base, {"train.lr": 1e-3})
    assert cfg.train.lr == 1e-3 and base.train.lr == 5e-3
    assert cfg.model == base.model and cfg.data == base.data and cfg.source == base.source
    assert cfg.origins["train.lr"] == "overrides['train.lr']"
    assert cfg.origins["train.max_steps"] == base.origins["train.max_steps"]
    with pytest.raises(ConfigError, match=r"^overrides\['lora.rank'\]: lora.rank: must be > 0"):
        pytrain.resolve_config(base, {"lora.rank": 0})
    tables = {"model": {"path": str(MODEL)}, "data": {"train": str(VALID)}}
    d = pytrain.resolve_config(tables, {"lora.rank": 4})
    assert d.model.path == str(MODEL) and d.lora.rank == 4 and d.source is None
    with pytest.raises(ConfigError, match=r"^<dict>: lora.rnak: unknown key; did you mean `rank`"):
        pytrain.resolve_config({**tables, "lora": {"rnak": 4}})


def test_export_refuses_an_output_it_cannot_write_before_reading_anything(tmp_path):
    (tmp_path / "other.txt").write_text("keep me")
    with pytest.raises(pytrain.ExportOutputError, match="holds other files") as e:
        pytrain.export(MODEL, tmp_path / "no-adapter.gguf", format="peft", out=tmp_path)
    assert e.value.problem.startswith("holds other files (other.txt)")
    with pytest.raises(pytrain.ExportOutputError, match="is a folder"):
        pytrain.export(MODEL, tmp_path / "no-adapter.gguf", format="gguf-merged", out=tmp_path)
    with pytest.raises(ValueError, match="format must be one of 'peft', 'gguf-merged'"):
        pytrain.export(MODEL, tmp_path / "a.gguf", format="merged", out=tmp_path / "m.gguf")
    assert (tmp_path / "other.txt").read_text() == "keep me"


@pytest.mark.slow
def test_export_merged_matches_the_cli(toy_run, tmp_path, capsys):
    """gguf-merged writes the file ``pytrain export --merge`` writes, and its summary is what
    the command prints."""
    from pytrain.cli import main
    res = pytrain.export(MODEL, toy_run.adapter, format="gguf-merged", out=tmp_path / "a.gguf")
    capsys.readouterr()
    assert main(["export", str(MODEL), "--adapter", str(toy_run.adapter), "--merge", "-o",
                 str(tmp_path / "b.gguf")]) == 0
    said = capsys.readouterr().out
    assert res.path == tmp_path / "a.gguf" and res.format == "gguf-merged"
    assert res.summary.replace("a.gguf", "b.gguf") + "\n" == said
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
