"""Input that ended in a traceback or a misleading message (issues 37 and 30), each now a
clear line naming the file, option or key, and the small gaps next to them: `--version`,
`export --format peft`, the progress bar on terminals only, the validation split's stats.

Runs use the converter-made gqa fixture on the CPU (tests/test_train_cli.py's helpers), the
embedded demo model for `generate`, and take a second or two each."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pytrain.cli import main
from tests.test_train_cli import (MODEL, ROOT, data_stats, step_records, write_config,
                                  write_data)

DEMO_MODEL = ROOT / "pytrain" / "assets" / "default-model.gguf"


def err_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_version(capsys):
    from pytrain import __version__
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pytrain {__version__}"


# ------------------------------------------------------------------------------- train
def test_train_warns_when_max_seq_len_exceeds_the_context(tmp_path, capsys):
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, max_steps=1, data={"max_seq_len": 5000})
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("warning: data.max_seq_len = 5000 is longer than the model's context length "
            "(4096)") in out
    cfg = write_config(tmp_path, "ok.toml", max_steps=1, output={"dir": "ok"})
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert "context length" not in capsys.readouterr().out


def test_a_validation_split_is_in_data_stats(tmp_path):
    """data.split: data_stats.json's "valid" counts the held-out examples (it said null)."""
    write_data(tmp_path)                          # 32 examples
    cfg = write_config(tmp_path, max_steps=1, data={"validation": "none", "split": 0.25})
    assert main(["train", str(cfg), "--no-progress"]) == 0
    stats = data_stats(tmp_path / "out")
    assert stats["valid"]["examples"] == 8 and stats["train"]["held_out"] == 8
    assert stats["valid"]["split_of"] == stats["train"]["path"]
    assert stats["valid"]["target_tokens"] > 0


@pytest.mark.parametrize("tty", [False, True])
def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path, capsys, monkeypatch, tty):
    """stderr to a file or a pipe (a log) gets no progress bar redrawn at every step; the
    periodic lines (train.log_every) are there either way."""
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, max_steps=3, log_every=1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert main(["train", str(cfg)]) == 0
    captured = capsys.readouterr()
    assert ("step/s" in captured.err) is tty and ("\r" in captured.err) is tty
    assert [line.split(":")[0] for line in captured.out.splitlines()
            if line.startswith("step ") and "loss" in line and "validation" not in line] == \
        ["step 1/3", "step 2/3", "step 3/3"]


EVIL = "{% set ns = namespace(_x=1) %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_template_the_sandbox_refuses_names_the_model_file(tmp_path, capsys):
    """A GGUF whose chat template the sandbox refuses: one line naming the file, in training
    (even with on_error = "skip": the template is at fault, not a record) and in generate."""
    from scripts.gguf_models import with_keys
    evil = with_keys(MODEL, tmp_path / "evil.gguf", {"tokenizer.chat_template": EVIL})
    write_data(tmp_path, copies=1)
    for on_error in ("stop", "skip"):
        cfg = write_config(tmp_path, max_steps=1, data={"on_error": on_error})
        cfg.write_text(cfg.read_text().replace(str(MODEL), str(evil)))
        assert main(["train", str(cfg), "--no-progress"]) == 1
        (line,) = err_lines(capsys)
        assert line.startswith("error: ") and str(evil) in line and "sandbox" in line, line
    assert main(["generate", str(evil), "--device", "cpu", "--threads", "1",
                 "--prompt", "hi"]) == 1
    (line,) = err_lines(capsys)
    assert str(evil) in line and "sandbox" in line, line


def test_a_builtin_chat_template_by_name_from_any_folder(tmp_path, capsys, monkeypatch):
    """--chat-template gemma works from any working folder (the README's
    pytrain/assets/chat_templates/gemma.jinja worked only from a checkout's root), and renders
    what that file renders."""
    from pytrain.data.template_files import TEMPLATE_DIR
    monkeypatch.chdir(tmp_path)
    common = ["generate", str(DEMO_MODEL), "--device", "cpu", "--threads", "1", "--prompt",
              "What does the cow say?", "--max-new-tokens", "8", "--chat-template"]
    capsys.readouterr()
    assert main(common + ["gemma"]) == 0
    by_name = capsys.readouterr().out
    assert main(common + [str(TEMPLATE_DIR / "gemma.jinja")]) == 0
    assert capsys.readouterr().out == by_name
    assert main(common + ["gemma-x"]) == 1
    (line,) = err_lines(capsys)
    assert line.startswith("error: --chat-template: cannot read gemma-x") and \
        "built-in templates: gemma" in line


def test_a_corrupt_optimizer_file_is_a_checkpoint_error(tmp_path, capsys):
    """optimizer.npz cut short, or without a moment the adapter needs: --resume stops with
    one line naming the file (it was BadZipFile / KeyError)."""
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, max_steps=2, save_every=1)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    npz = tmp_path / "out" / "checkpoints" / "step-0000002" / "optimizer.npz"
    good = npz.read_bytes()
    resume = ["train", str(cfg), "--no-progress", "--resume", "--set", "train.max_steps=3"]
    npz.write_bytes(good[:len(good) // 2])
    capsys.readouterr()
    assert main(resume) == 1
    (line,) = err_lines(capsys)
    assert str(npz) in line and "not a usable checkpoint" in line, line
    with np.load(tmp_path / "out" / "checkpoints" / "step-0000001" / "optimizer.npz") as z:
        moments = {k: z[k] for k in z.files}
    moments.pop(sorted(moments)[0])
    with open(npz, "wb") as f:
        np.savez(f, **moments)
    assert main(resume) == 1
    (line,) = err_lines(capsys)
    assert str(npz) in line and "missing" in line, line
    npz.write_bytes(good)
    assert main(resume) == 0
    assert len(step_records(tmp_path / "out")) == 3


def test_a_failed_allocation_is_a_one_line_error():
    """A buffer the machine cannot give (1 PiB here) is a PytrainError the command line prints
    as one line naming the size and pointing at `pytrain plan`, not a bare MemoryError."""
    from pytrain import ggml
    from pytrain.errors import PytrainError
    rt = ggml.Runtime("cpu", threads=1)
    ctx = ggml.Context(n_tensors=1)
    try:
        ggml.lib.ggml_new_tensor_1d(ctx.ptr, ggml.lib.GGML_TYPE_F32, 2**48)
        with pytest.raises(PytrainError, match=r"out of memory: could not allocate "
                                               r"1048576.00 GiB on cpu \(`pytrain plan"):
            rt.alloc(ctx)
    finally:
        ctx.close()
        rt.close()


def test_pytrain_threads_that_is_not_a_number_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("PYTRAIN_THREADS", "abc")
    assert main(["generate", str(DEMO_MODEL), "--device", "cpu", "--prompt", "hi"]) == 1
    (line,) = err_lines(capsys)
    assert line.startswith("error: PYTRAIN_THREADS='abc'"), line


# ------------------------------------------------------------------------------- export
def test_export_output_errors_name_the_option(tmp_path, capsys):
    """-o an existing folder, or a path under a file: one line naming -o/--output and what is
    wrong (it was [Errno 21] Is a directory / [Errno 17] File exists on a temporary name)."""
    from pytrain.formats.adapter_gguf import write_lora_gguf
    from tests.test_merge import FIX, make_adapter, config_of
    base = FIX / "gqa-f32.gguf"
    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", 8.0, make_adapter(config_of(base)))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    cmd = ["export", str(base), "--adapter", str(ad), "--merge", "-o"]
    assert main(cmd + [str(tmp_path / "adir")]) == 1
    (line,) = err_lines(capsys)
    assert line == (f"error: -o/--output {tmp_path / 'adir'}: is a folder; give the merged "
                    f"model's file name (for example {tmp_path / 'adir' / 'merged.gguf'})")
    assert main(cmd + [str(tmp_path / "afile" / "m.gguf")]) == 1
    (line,) = err_lines(capsys)
    assert line == f"error: -o/--output {tmp_path / 'afile' / 'm.gguf'}: {tmp_path / 'afile'} " \
                   f"is a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad.gguf", "adir", "afile"]
    assert list((tmp_path / "adir").iterdir()) == []


def test_export_a_gguf_adapter_as_a_peft_folder(tmp_path, capsys):
    """export --format peft: the folder training writes with output.formats = ["peft"]
    (same bytes), read back to the GGUF's tensors exactly."""
    from pytrain.formats.adapter_gguf import read_lora_gguf, write_lora_gguf
    from pytrain.formats.adapter_peft import (CONFIG_NAME, WEIGHTS_NAME, read_peft_adapter,
                                              write_peft_adapter)
    from tests.test_merge import FIX, RANK, make_adapter, config_of
    base = FIX / "gqa-f32.gguf"
    cfg = config_of(base)
    tensors = make_adapter(cfg, "attn_q,attn_qkv,ffn_up")
    ad = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", 8.0, tensors)
    assert main(["export", str(base), "--adapter", str(ad), "--format", "peft",
                 "-o", str(tmp_path / "peft")]) == 0
    assert str(tmp_path / "peft") in capsys.readouterr().out
    back, alpha, rank, _config = read_peft_adapter(tmp_path / "peft", cfg, arch="qwen35")
    _arch, _alpha, gguf_tensors, _meta = read_lora_gguf(ad)
    assert (alpha, rank) == (8.0, RANK) and sorted(back) == sorted(gguf_tensors)
    for k in back:
        np.testing.assert_array_equal(back[k], gguf_tensors[k], err_msg=k)
    ref = write_peft_adapter(tmp_path / "ref", gguf_tensors, 8.0, RANK,
                             base_model_name_or_path=base.name, model_config=cfg, arch="qwen35")
    for f in (CONFIG_NAME, WEIGHTS_NAME):
        assert (tmp_path / "peft" / f).read_bytes() == (ref / f).read_bytes(), f
    # a folder of other files (a run folder, say) is never replaced by the PEFT folder
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(["export", str(base), "--adapter", str(ad), "--format", "peft",
                 "-o", str(tmp_path / "run")]) == 1
    assert "holds other files (metrics.jsonl)" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]
    assert main(["export", str(base), "--adapter", str(ad), "--format", "peft",
                 "-o", str(tmp_path / "peft")]) == 0          # an earlier PEFT folder: replaced
    capsys.readouterr()
    # neither --merge nor --format: both are named
    assert main(["export", str(base), "--adapter", str(ad), "-o", str(tmp_path / "x")]) == 2
    assert "--format peft" in capsys.readouterr().err


# ------------------------------------------------------------------------------- aborts
def test_a_model_whose_graph_outgrows_the_old_budget_plans_instead_of_aborting(tmp_path):
    """ssm.conv_kernel = 1000: the convolution adds nodes per tap, which the per-layer node
    budget did not count, and ggml aborted the process (GGML_ASSERT, SIGABRT) building the
    backward.  The budget counts it now: `pytrain plan` builds and measures every graph."""
    from scripts.gguf_models import write_qwen35
    model = write_qwen35(tmp_path / "k.gguf", conv_kernel=1000, n_embd=64, n_ff=64,
                         head_dim=32, ssm_state=32, ssm_v_dim=32).path
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, max_steps=1, data={"max_seq_len": 64})
    cfg.write_text(cfg.read_text().replace(str(MODEL), str(model)).replace(
        "[lora]\n", '[lora]\ntargets = ["attn_q", "attn_qkv"]\nskip_ssm = false\n'))
    r = subprocess.run([sys.executable, "-m", "pytrain", "plan", str(cfg), "--json"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    plan = json.loads(r.stdout)
    assert plan["one_graph"] > 0 and plan["layerwise"]["largest"] > 0


def _graph_counts(path, T: int) -> dict[str, tuple[int, int]]:
    """(nodes or tensors used, capacity) of every graph a training step builds for the model
    at ``path`` (metadata only) at length T, with an adapter on every target of every layer."""
    from pytrain import ggml
    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.step import loss as loss_mod
    from pytrain.step.graphs import GradGraph
    from pytrain.step.graph_memory import file_shape_model
    from pytrain.step.recompute import RecomputeGraph
    lib = ggml.lib
    model, _, _ = file_shape_model(path)
    try:
        present = {n.split(".")[2] for n in model.config.tensor_shapes() if n.startswith("blk.")}
        names = select_targets(model.config, [t for t in model.arch.targets if t in present],
                               skip_ssm=False)
        ad = lora.create(model.runtime, model.config, names, 2, 4.0)
        budget = model.graph_budget(T)
        layer = model.arch.layer_budget(model.config, T)
        g = GradGraph(model, ad, 2, T, rows=loss_mod.rows_bucket(2 * T, 2 * T),
                      measure_only=True)
        out = {"one graph nodes": (lib.ggml_graph_n_nodes(g.graph), 2 * budget),
               "one graph tensors": (sum(1 for _ in g.ctx.tensors()), 2 * budget)}
        g.close()
        r = RecomputeGraph(model, ad, 2, T, measure_only=True)
        out["layer forward nodes"] = (max(lib.ggml_graph_n_nodes(f.graph) for f in r.fwd), layer)
        out["layer backward nodes"] = (max(lib.ggml_graph_n_nodes(b.graph)
                                           for b in r.bwd.values()), 2 * layer)
        out["layer backward tensors"] = (max(sum(1 for _ in b.ctx.tensors())
                                             for b in r.bwd.values()), 2 * layer)
        r.close()
        return out
    finally:
        model.close()


def test_graph_budgets_grow_at_least_as_fast_as_the_graphs(tmp_path):
    """A layer's node count is affine in each loop its code runs: the convolution's taps
    (ssm.conv_kernel) and the DeltaNet chunks (T / 64).  So the budget holds for every kernel
    and length when it holds at one point and grows at least as fast in each: measured at
    kernels 4 and 8 and at one and two chunks, with an adapter on every target."""
    from scripts.gguf_models import write_qwen35
    small = dict(n_embd=64, n_ff=64, head_dim=32, ssm_state=32, ssm_v_dim=32)
    k4 = write_qwen35(tmp_path / "k4.gguf", conv_kernel=4, **small).path
    k8 = write_qwen35(tmp_path / "k8.gguf", conv_kernel=8, **small).path
    base, taps, chunks = _graph_counts(k4, 64), _graph_counts(k8, 64), _graph_counts(k4, 128)
    for what, (used, cap) in base.items():
        assert used < cap, what
        for name, other, steps in (("4 taps", taps, 4), ("a chunk", chunks, 1)):
            grows, cap_grows = other[what][0] - used, other[what][1] - cap
            assert 0 <= grows <= cap_grows, (what, name, grows, cap_grows)
            print(f"{what}: {used} of {cap}; {name} more: +{grows} (budget +{cap_grows})")
