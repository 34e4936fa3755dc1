"""An architecture is one registry entry: a model of an architecture registered at run time
(here Qwen3.5's entry under another name, with its keys under that name) is trained,
checkpointed and resumed, and its adapter written, by the generic trainer, run loop,
checkpoint and adapter writer, none of which names an architecture."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scripts.gguf_models import renamed_arch_copy

from pytrain import models
from pytrain.formats.adapter_gguf import read_lora_gguf
from pytrain.cli import main
from pytrain.models import qwen35
from pytrain.models.qwen35_config import Qwen35Config

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
NAME = "toyhybrid"


def toy_config(meta, tensor_names=None, n_vocab=None, source=""):
    """Qwen3.5's reader on the toy's keys (``toyhybrid.*`` read as ``qwen35.*``)."""
    renamed = {("qwen35" + k[len(NAME):] if k.startswith(NAME + ".") else k): v
               for k, v in meta.items()}
    return Qwen35Config.from_metadata(renamed, tensor_names, n_vocab=n_vocab, source=source)


def forget(name: str) -> None:
    """Undo ``models.register`` (the one registry, PEFT layouts included), for the next test."""
    models._REGISTERED.pop(name, None)


@pytest.fixture
def toy(tmp_path):
    models.register(dataclasses.replace(qwen35.ARCHITECTURE, name=NAME,
                                        config_from_metadata=toy_config))
    yield renamed_arch_copy(FIX / "gqa-f32.gguf", tmp_path / "toy.gguf", NAME)
    forget(NAME)


def test_unknown_architecture_is_refused_naming_the_known_ones(tmp_path):
    path = renamed_arch_copy(FIX / "gqa-f32.gguf", tmp_path / "x.gguf", "nosuch")
    import pytrain
    with pytest.raises(ValueError, match=r"x.gguf: unsupported architecture 'nosuch'; "
                                         r"supported: .*qwen35"):
        pytrain.load_model(path, device="cpu")


def test_a_registered_architecture_trains_checkpoints_resumes_and_writes_its_adapter(tmp_path,
                                                                                     toy):
    from test_train_run import records, write_data
    write_data(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\npath = "{toy}"\ndevice = "cpu"\nthreads = 2\n'
                   f'[data]\ntrain = "train.jsonl"\nvalidation = "valid.jsonl"\n'
                   f'[lora]\nrank = 4\nalpha = 8.0\n'
                   f'[train]\nmax_steps = 4\nbatch_size = 8\nlr = 5e-3\nsave_every = 2\n'
                   f'[output]\ndir = "out"\nformats = ["gguf"]\n')
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_steps=2"]) == 0
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 0
    out = tmp_path / "out"
    arch, alpha, tensors, _ = read_lora_gguf(out / "adapter.gguf")
    assert arch == NAME and alpha == 8.0 and "blk.1.attn_q.weight.lora_a" in tensors
    ck_arch = read_lora_gguf(out / "checkpoints" / "step-0000004" / "adapter.gguf")[0]
    assert ck_arch == NAME
    steps = [r["step"] for r in records(out) if "loss" in r and "split" not in r]
    assert steps == [1, 2, 3, 4]
    valid = [r["loss"] for r in records(out) if r.get("split") == "valid"]
    assert valid[-1] < valid[0]
    state = json.loads((out / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert state["step"] == 4 and all(np.isfinite(v).all() for v in tensors.values())


@pytest.fixture
def renamed_hf(tmp_path):
    """The toy architecture with its own HF names for attention (``attn.query`` ...) and its own
    HF class, as a family whose Hugging Face modules differ from Qwen3.5's would have."""
    layout = qwen35.ARCHITECTURE.hf_layout
    hf = {**layout.modules, "attn_q": "attn.query", "attn_k": "attn.key"}
    toy_layout = dataclasses.replace(layout, modules=hf, classes=("ToyForCausalLM",),
                                     parent_library="toy.modeling_toy")
    models.register(dataclasses.replace(qwen35.ARCHITECTURE, name=NAME,
                                        config_from_metadata=toy_config, hf_layout=toy_layout))
    yield
    forget(NAME)


def test_peft_adapters_use_the_architectures_own_hf_layout(tmp_path, renamed_hf):
    """The PEFT writer and reader take module names from the adapter's architecture entry, and
    a folder naming its HF class is matched to that entry: the registry is their one list."""
    from pytrain.formats.adapter_peft import read_peft_adapter, write_peft_adapter
    from pytrain.formats.peft_names import arch_of
    rng = np.random.default_rng(0)
    tensors = {"blk.3.attn_q.weight.lora_a": rng.normal(size=(4, 64)).astype(np.float32),
               "blk.3.attn_q.weight.lora_b": rng.normal(size=(128, 4)).astype(np.float32)}
    out = write_peft_adapter(tmp_path / "toy", tensors, 8.0, 4, arch=NAME)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["query"] and cfg["layers_to_transform"] == [3]
    assert cfg["auto_mapping"] == {"base_model_class": "ToyForCausalLM",
                                   "parent_library": "toy.modeling_toy"}
    assert arch_of(None, None, cfg) == NAME
    back, alpha, rank, _ = read_peft_adapter(out, arch=NAME)
    assert alpha == 8.0 and rank == 4
    np.testing.assert_array_equal(back["blk.3.attn_q.weight.lora_b"], tensors["blk.3.attn_q.weight.lora_b"])
    qwen = write_peft_adapter(tmp_path / "qwen", tensors, 8.0, 4, arch="qwen35")
    assert json.loads((qwen / "adapter_config.json").read_text())["target_modules"] == ["q_proj"]
