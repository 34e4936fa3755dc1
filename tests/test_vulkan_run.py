"""`pytrain train` with ``device = "vulkan"`` (lavapipe in CI), end to end, for every
architecture: the animal chats of test_train_run for 30 steps, evaluated every 10.

* The loss curve (30 training losses, 4 validation losses) is the CPU's, and so is the
  adapter, within what a float32 rounding does to this run on the CPU (the calibration run:
  the same run with every F32 weight moved one float32 step, ``perturbation.perturbed_model``).
  Lavapipe computes in float32 (patch 0016).  Losses: ``KEPT_SPREAD`` x the calibration's
  largest distance from the CPU over the run (a rounding's effect grows and shrinks from
  step to step), at least 8 ulps; the adapter: ``bounds.assert_adamw_close`` against the
  calibration.  A GPU whose matmuls round their operands to F16 is not compared this way: no
  CPU run calibrates that rounding over 30 steps (lavapipe with its F16 shaders drifted from
  the CPU 12 times as far as the same run with the frozen weights stored as F16, because
  AdamW amplifies the F16 rounding of the LoRA gradients too), so there the test skips,
  saying so; its one-step gradients are still checked (test_vulkan_train).
* Resume: a run started from the device run's step-20 checkpoint (``--resume CHECKPOINT``
  into another folder) ends with the adapter of the straight 30-step run, bit for bit (the
  adapter and AdamW moments come back from the checkpoint exactly, and the device computes
  the same graphs on the same values in the same order: its kernels split work into fixed
  workgroups, without atomics).
* llama.cpp loads the adapter trained on the device with ``--lora`` and computes pytrain's
  logits with it (``llama_cpp_check.assert_llama_cpp_runs_adapter``).

The runs of one architecture are made once and shared by its tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bounds import KEPT_SPREAD, assert_adamw_close, ulps
from test_train_run import adapter_of, records, write_config, write_data
from vulkan_support import rounds_matmuls_to_f16, vulkan_device

from pytrain.cli import main

FIX = Path(__file__).resolve().parent / "fixtures"
MODELS = {"qwen35": "qwen35/gqa-f32.gguf", "llama": "llama/gqa-f32.gguf",
          "qwen2": "qwen2/qwen2-f32.gguf", "qwen3": "qwen3/qwen3-f32.gguf",
          "gemma3": "gemma3/gemma3-f32.gguf"}
STEPS, LR, BATCH = 30, 5e-3, 2      # batch 2: lavapipe runs each token on the CPU, slowly
RESUME_AT = 20
_runs: dict[str, dict] = {}


@pytest.fixture(scope="module")
def device():
    return vulkan_device()


def model_file(arch: str, folder: Path) -> Path:
    """The fixture; for Qwen3.5 the copy whose MRoPE sections llama.cpp's rope accepts (the
    same function for text: ``llama_cpp_check.llama_cpp_compatible``)."""
    from llama_cpp_check import llama_cpp_compatible
    path = FIX / MODELS[arch]
    return llama_cpp_compatible(path, folder) if arch == "qwen35" else path


def train(folder: Path, model: Path, device: str, out: str, *extra: str) -> Path:
    cfg = write_config(folder, model=model, device=device, max_steps=STEPS, lr=LR,
                       batch_size=BATCH, eval_every=10, save_every=10, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={folder / out}",
                 *extra]) == 0
    return folder / out


def curve(out: Path) -> list[float]:
    """The training losses of steps 1..30, then the validation losses at 0, 10, 20, 30."""
    recs = records(out)
    steps = [r["loss"] for r in recs if "loss" in r and "split" not in r]
    valid = [r["loss"] for r in recs if r.get("split") == "valid"]
    assert len(steps) == STEPS and len(valid) == STEPS // 10 + 1
    return steps + valid


def runs(arch: str, tmp_path_factory) -> dict:
    """The CPU run, its calibration (module docstring), the device's straight run and the
    device's run resumed from the straight run's step-20 checkpoint: each one's folder."""
    if arch in _runs:
        return _runs[arch]
    from perturbation import perturbed_model
    folder = tmp_path_factory.mktemp(f"vulkan-{arch}")
    write_data(folder)
    model = model_file(arch, folder)
    calib = perturbed_model(model, folder)
    r = {"model": model, "cpu": train(folder, model, "cpu", "cpu"),
         "calib": train(folder, calib, "cpu", "calib"),
         "vulkan": train(folder, model, "vulkan", "vulkan")}
    r["resumed"] = train(folder, model, "vulkan", "resumed", "--resume",
                         str(r["vulkan"] / "checkpoints" / f"step-{RESUME_AT:07d}"))
    _runs[arch] = r
    return r


@pytest.mark.parametrize("arch", list(MODELS))
def test_thirty_steps_on_the_device_train_as_on_the_cpu(device, arch, tmp_path_factory,
                                                        measured):
    if rounds_matmuls_to_f16(device):
        pytest.skip(f"{device} rounds matmul operands to F16, which no CPU run calibrates over "
                    f"30 steps (module docstring)")
    r = runs(arch, tmp_path_factory)
    vk, cpu, cal = (curve(r[k]) for k in ("vulkan", "cpu", "calib"))
    assert cpu[-1] < cpu[STEPS] - 0.5                                    # it trained
    calib = max(abs(k - c) for k, c in zip(cal, cpu))
    worst = max(abs(v - c) / max(calib, ulps(c)) for v, c in zip(vk, cpu))
    measured(f"{arch}: 30 steps on Vulkan, worst loss distance from the CPU's in units of the "
             f"float32 calibration's ({calib:.2g}) or 8 ulps", worst, KEPT_SPREAD)
    for i, (v, c) in enumerate(zip(vk, cpu)):
        assert abs(v - c) <= KEPT_SPREAD * max(calib, ulps(c)), (i, v, c, calib)
    assert_adamw_close(adapter_of(r["vulkan"]), adapter_of(r["cpu"]), [LR] * STEPS,
                       adapter_of(r["calib"]))


@pytest.mark.parametrize("arch", list(MODELS))
def test_resume_on_the_device_is_exact(device, arch, tmp_path_factory):
    from test_train_run import assert_resumed_equals_straight
    r = runs(arch, tmp_path_factory)
    steps = [x["step"] for x in records(r["resumed"]) if "loss" in x and "split" not in x]
    assert steps == list(range(RESUME_AT + 1, STEPS + 1))
    assert_resumed_equals_straight(adapter_of(r["vulkan"]), adapter_of(r["resumed"]))


@pytest.mark.parametrize("arch", list(MODELS))
def test_llama_cpp_runs_the_adapter_trained_on_the_device(device, arch, llama_logits_exe,
                                                          tmp_path_factory, tmp_path,
                                                          measured):
    from llama_cpp_check import assert_llama_cpp_runs_adapter

    from pytrain.cli import _load_adapter
    r = runs(arch, tmp_path_factory)
    toks = np.random.default_rng(7).integers(0, 480, 40)
    assert_llama_cpp_runs_adapter(
        llama_logits_exe, r["model"], lambda m: _load_adapter(m, r["vulkan"] / "adapter.gguf"),
        toks, tmp_path, measured, f"{arch} trained on Vulkan")
