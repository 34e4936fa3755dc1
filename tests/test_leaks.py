"""Native memory comes back: a trainer's close frees everything it made (optimizer state
included), a graph build that raises half-way frees what it had made, evaluation keeps a
bounded number of graphs, and `pytrain eval` builds no optimizer and no adapter.

Counted through ``ggml.live_objects()`` (contexts, runtime-owned backend buffers, kept-graph
allocators).  The garbage collector runs before each count: what it can free is not a leak;
a backend buffer is owned by its runtime and only an explicit free gives it back."""
import gc
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pytrain
from pytrain import ggml
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import trainer as trainer_mod
from pytrain.step.optimizer import AdamWSettings
from pytrain.step.trainer import Trainer

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
MODEL = FIX / "gqa-f32.gguf"


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(MODEL, device="cpu", threads=1)
    yield m
    m.close()


@pytest.fixture
def adapter(model):
    return lora.create(model.runtime, model.config, select_targets(model.config), 4, 8, seed=0)


def live() -> dict:
    gc.collect()
    return ggml.live_objects()


def batch(T: int, n: int | None = None, B: int = 1, seed: int = 0):
    """B rows of T tokens, the first ``n`` of each a sample with targets after 2 prompt tokens."""
    n = T if n is None else n
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 480, (B, T))
    seg = np.full((B, T), -1)
    seg[:, :n] = 0
    mask = np.zeros((B, T), bool)
    mask[:, 2:n] = True
    return SimpleNamespace(tokens=tokens, seg=seg, train_mask=mask)


@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_trainer_close_frees_everything_it_made(model, adapter, recompute):
    """Optimizer state (accumulators, moments), its two kept graphs, step and eval graphs."""
    start = live()
    tr = Trainer(model, adapter, AdamWSettings(lr=1e-3), recompute=recompute)
    assert tr.step([batch(16)], 1e-3) is not None
    tr.evaluate([batch(16)])
    assert live() != start
    tr.close()
    assert live() == start


@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_a_step_graph_whose_backward_build_raises_frees_what_it_made(model, adapter, monkeypatch,
                                                                    recompute):
    tr = Trainer(model, adapter, AdamWSettings(lr=1e-3), recompute=recompute)
    start = live()

    def fail(*args, **kwargs):
        raise RuntimeError("injected: building the backward failed")

    monkeypatch.setattr(ggml, "build_backward", fail)
    with pytest.raises(RuntimeError, match="injected"):
        tr.step([batch(16)], 1e-3)
    assert live() == start
    assert tr.graphs == {}
    monkeypatch.undo()
    assert tr.step([batch(16)], 1e-3) is not None     # the trainer is still usable
    tr.close()


def test_the_recompute_probe_is_freed_when_measuring_it_raises(model, adapter, monkeypatch):
    """``recompute = "auto"`` builds a one-graph step to measure it; a failure while measuring
    (here injected) must not keep that graph's buffers."""
    tr = Trainer(model, adapter, AdamWSettings(lr=1e-3), recompute="auto")
    start = live()

    def fail(*args, **kwargs):
        raise MemoryError("injected: measuring the graph failed")

    monkeypatch.setattr(trainer_mod, "compute_bytes", fail)
    with pytest.raises(MemoryError, match="injected"):
        tr.step([batch(16)], 1e-3)
    assert live() == start
    tr.close()


def test_evaluation_keeps_a_bounded_number_of_graphs(model, adapter):
    """Batches of ever new shapes: the graphs kept stop growing, and results do not depend on
    whether a graph was kept or rebuilt."""
    tr = Trainer(model, adapter, AdamWSettings(lr=1e-3))
    start = live()["contexts"]
    kept, first = [], []
    shapes = [batch(16, B=k, seed=k) for k in range(1, 11)]     # 10 graph shapes
    for b in shapes:
        first.append(tr.evaluate([b]))
        kept.append(live()["contexts"] - start)
    assert kept[-1] == kept[-2], f"contexts kept after each new batch shape: {kept}"
    assert [tr.evaluate([b]) for b in shapes] == first          # rebuilt graphs, same figures
    tr.close()


def test_evaluator_evicts_the_least_recently_used_graph(model):
    from pytrain.step.evaluate import Evaluator
    start = live()
    ev = Evaluator(model, None, max_graphs=2)
    a, b, c = batch(16), batch(32), batch(48)
    ev.evaluate([a])
    ev.evaluate([b])
    ga = next(iter(ev.graphs.values()))
    ev.evaluate([a])                    # a is now the most recently used
    gb = list(ev.graphs.values())[0]
    ev.evaluate([c])                    # evicts b, not a
    assert len(ev.graphs) == 2 and ga in ev.graphs.values() and gb not in ev.graphs.values()
    assert gb.ctx.ptr is None           # the evicted graph was freed
    ev.close()
    assert live() == start


def test_pytrain_eval_of_the_base_model_builds_no_optimizer_and_no_adapter(model, tmp_path,
                                                                          monkeypatch, capsys):
    """Without --adapter the base model itself is evaluated: no LoRA adapter, no AdamW state;
    its metrics are those of a trainer with an all-zero adapter (B = 0 adds exact zeros)."""
    from pytrain.cli import main
    rec = {"messages": [{"role": "user", "content": "What does the cow say?"},
                        {"role": "assistant", "content": "The cow says moo."}]}
    (tmp_path / "v.jsonl").write_text(json.dumps(rec) + "\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                   f'[data]\ntrain = "v.jsonl"\n')
    # the reference first: a trainer with a zero adapter, as `pytrain eval` did before
    from pytrain.config import load_config
    from pytrain.data import load_data, make_batches
    c = load_config(cfg)
    examples = load_data(c.data, model.tokenizer).train
    batches = make_batches(examples, c.train.batch_size, c.data.packing, 0, shuffle=False,
                           max_seq_len=c.data.max_seq_len, pad_id=model.pad_id)
    zero = lora.create(model.runtime, model.config, select_targets(model.config), 1, 1.0)
    tr = Trainer(model, zero, AdamWSettings())
    want = tr.evaluate(batches)
    tr.close()
    from pytrain.step.evaluate import Evaluator
    base = Evaluator(model, None)
    assert base.evaluate(batches) == want
    base.close()

    def refuse(*args, **kwargs):
        raise AssertionError("pytrain eval without --adapter built an optimizer or an adapter")

    import pytrain.step.optimizer as optimizer_mod
    monkeypatch.setattr(optimizer_mod.OptimizerState, "__init__", refuse)
    monkeypatch.setattr(lora, "create", refuse)
    capsys.readouterr()
    assert main(["eval", str(cfg)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{want['n_valid']} target tokens" in line, line
    assert f"loss {want['loss']:.4f}" in line and f"accuracy {want['accuracy']:.3f}" in line, line


def files_open_under(folder: Path) -> list[str]:
    """The files of ``folder`` this process holds open (Linux: /proc/self/fd)."""
    inside = str(folder.resolve()) + os.sep
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:                 # the listing's own descriptor, closed by now
            continue
        if target.startswith(inside):
            out.append(target)
    return out


def test_a_run_failing_while_its_loop_is_set_up_closes_all_it_opened(tmp_path, monkeypatch):
    """The sample prompts are computed after the loop has opened metrics.jsonl, the
    TensorBoard writer and the folder's lock: an error there (injected) left metrics.jsonl
    open.  Everything a run opens is now on one ExitStack: after the error no file of the run
    folder is open (checked while the traceback still holds the frames that held them, so
    that the garbage collector cannot have closed them), the signal handlers are back, and the
    model and the trainer were closed."""
    import signal
    from pytrain.config import load_config
    from pytrain.run import loop as run, samples
    from test_train_run import write_config, write_data
    write_data(tmp_path)
    cfg_path = write_config(tmp_path, max_steps=2, eval_every=0, sample_every=1,
                            formats=["gguf"])
    cfg_path.write_text(cfg_path.read_text() + "tensorboard = true\n")
    cfg = load_config(cfg_path, [])

    def fail(*args, **kwargs):
        raise RuntimeError("injected: the sample prompts failed")

    monkeypatch.setattr(samples, "prompts_for", fail)
    handler, start = signal.getsignal(signal.SIGINT), live()
    with pytest.raises(RuntimeError, match="injected") as failed:
        run.train(cfg, progress=False, log=lambda *a, **k: None)
    out = tmp_path / "out"
    assert (out / "metrics.jsonl").exists() and list(out.glob("events.out.tfevents.*"))
    assert files_open_under(out) == []
    assert signal.getsignal(signal.SIGINT) is handler
    # the model's and the trainer's buffers were freed by their close, not by the garbage
    # collector: the frames still hold them (the adapter's context, which only the collector
    # frees in any run, is the one difference)
    held = live()
    assert {k: held[k] for k in ("buffers", "kept graph allocators")} == \
        {k: start[k] for k in ("buffers", "kept graph allocators")}, (held, start)
    del failed
    assert live() == start
