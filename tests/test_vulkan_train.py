"""Training on the Vulkan device (lavapipe in CI) against the same training on the CPU: one
step of each architecture against PEFT's float64 loss and gradients, and six AdamW steps of
two batch shapes with evaluations between (graphs re-split and re-allocated on the device).

Bounds.  The CPU and the device are two float32 evaluations of one function, except that
ggml-vulkan multiplies matrices with F16 operands where the device has F16 arithmetic (a GPU;
lavapipe computes in float32 since patch 0016, so there the device stays far inside these
bounds): F32 weights and the activations are rounded to F16 inside its matmul shaders.  That
rounding is measured on the same input, on the CPU: the F32 weights stored as F16, which
ggml-cpu's F16 matmul also multiplies with F16 activations (``f16_noise``).  The device is
allowed ``bounds.KEPT_SPREAD`` (4) times the larger of that noise and the CPU's own float32
error, against the same float64 reference (the PEFT goldens' loss and gradients; as the CUDA
test does for TF32).  The measured values are printed (``-s``) and recorded (``measured``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bounds import KEPT_SPREAD, U32, ulps
from vulkan_support import vulkan_device

import pytrain
from pytrain.models import lora
from pytrain.step import loss as L
from pytrain.step.graphs import GradGraph

FIX = Path(__file__).resolve().parent / "fixtures"
# one F32 fixture per architecture, with its PEFT golden (float64 loss and gradients)
CASES = {"qwen35": ("qwen35/gqa-f32.gguf", "qwen35/peft_grads.npz"),
         "llama": ("llama/gqa-f32.gguf", "llama/peft_gqa.npz"),
         "qwen2": ("qwen2/qwen2-f32.gguf", "qwen2/peft_qwen2.npz"),
         "qwen3": ("qwen3/qwen3-f32.gguf", "qwen3/peft_qwen3.npz"),
         "gemma3": ("gemma3/gemma3-f32.gguf", "gemma3/peft_gemma3.npz")}
LR, STEPS = 1e-2, 6         # the few-step test's AdamW steps


@pytest.fixture(scope="module")
def device():
    return vulkan_device()


def f16_copy(path: Path, tmp: Path) -> Path:
    from scripts.gguf_models import retyped_copy
    return retyped_copy(path, tmp / f"{path.stem}-f16.gguf", "f32", "f16")


def golden_step(path: Path, gold: dict, device: str) -> dict:
    """pytrain's loss and LoRA gradients on the golden's padded, prompt-masked batch with the
    golden's A and B (rank 4, alpha 8), on ``device``."""
    m = pytrain.load_model(path, device=device, threads=2)
    try:
        names = sorted(k[:-len(".lora_a.grad64")] for k in gold if k.endswith(".lora_a.grad64"))
        ad = lora.create(m.runtime, m.config, names, rank=4, alpha=8, seed=0)
        ad.set({k: gold[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
        tokens, labels = gold["input_ids"], gold["labels"]
        seg = np.where(gold["attention_mask"] > 0, 0, -1)
        tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
        g = GradGraph(m, ad, tokens.shape[0], tokens.shape[1])
        try:
            return g.run(tokens, seg, tgt)
        finally:
            g.close()
    finally:
        m.close()


def errors(out: dict, gold: dict) -> tuple[float, float]:
    """(|loss - float64|, worst gradient error relative to its tensor's largest entry)."""
    worst = max(float(np.abs(out["grads"][k] - gold[k + ".grad64"]).max()
                      / np.abs(gold[k + ".grad64"]).max()) for k in out["grads"])
    return abs(out["loss"] - float(gold["loss64"])), worst


@pytest.mark.parametrize("arch", list(CASES))
def test_one_step_matches_the_cpu(device, arch, tmp_path, measured):
    path, golden = (FIX / p for p in CASES[arch])
    gold = dict(np.load(golden))
    vk = golden_step(path, gold, "vulkan")
    cpu = golden_step(path, gold, "cpu")
    f16 = golden_step(f16_copy(path, tmp_path), gold, "cpu")
    assert vk["n_valid"] == cpu["n_valid"] == int(gold["n_valid"])
    assert sorted(vk["grads"]) == sorted(cpu["grads"])
    (vk_loss, vk_grad), (cpu_loss, cpu_grad), (f16_loss, f16_grad) = (
        errors(o, gold) for o in (vk, cpu, f16))
    max_loss = KEPT_SPREAD * max(f16_loss, cpu_loss, ulps(float(gold["loss64"])))
    max_grad = KEPT_SPREAD * max(f16_grad, cpu_grad, 8 * U32)
    measured(f"{arch} Vulkan loss vs float64 (CPU {cpu_loss:.2g}, F16 noise {f16_loss:.2g})",
             vk_loss, max_loss)
    measured(f"{arch} Vulkan worst LoRA gradient vs float64 (CPU {cpu_grad:.2g}, F16 noise "
             f"{f16_grad:.2g})", vk_grad, max_grad)
    assert vk_loss <= max_loss and vk_grad <= max_grad


def train_alternating(path: Path, device: str, recompute: str) -> tuple[list[float], dict]:
    """Steps of two batch shapes in turn, an evaluation after each pair: every change of
    shape re-splits and re-allocates a cached graph on the device (the scheduler's copies of
    the previous shape would be stale there).  Returns (losses and evaluation losses, the
    adapter)."""
    from pytrain.data import Example, make_batches
    from pytrain.models.lora_targets import select_targets
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.trainer import Trainer
    rng = np.random.default_rng(3)
    ex = [Example(rng.integers(0, 480, n).astype(np.int32), rng.random(n) < 0.7)
          for n in (17, 30, 9, 24, 12, 20, 26, 14, 33, 21, 45, 50)]
    short, long_ = make_batches(ex[:6], 2, seed=1), make_batches(ex[6:], 2, seed=1)
    m = pytrain.load_model(path, device=device, threads=2)
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
        tr = Trainer(m, ad, AdamWSettings(lr=LR), recompute=recompute)
        try:
            losses = []
            for i in range(STEPS // 2):
                losses.append(tr.step([short[i]], LR).loss)
                losses.append(tr.step([long_[i]], LR).loss)
                losses.append(tr.evaluate(short + long_)["loss"])
            return losses, ad.get()
        finally:
            tr.close()
    finally:
        m.close()



@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_a_few_steps_with_evaluations_train_as_on_the_cpu(device, recompute, tmp_path,
                                                          measured):
    """Six AdamW steps of Qwen3.5's fixture (DeltaNet and attention layers) and three
    evaluations on Vulkan, against the same run on the CPU; the calibration is the CPU run
    with the weights stored as F16 (ggml-vulkan's F16 matmul rounding, done by other
    kernels).  Adapters: ``bounds.assert_adamw_close`` (AdamW's own amplification of a
    rounding, calibrated); losses: ``KEPT_SPREAD`` x the calibration's largest distance from
    the CPU over the run (a rounding's effect grows and shrinks from step to step), at least 8
    ulps of the loss."""
    path = FIX / "qwen35/gqa-f32.gguf"
    vk_loss, vk_ad = train_alternating(path, "vulkan", recompute)
    cpu_loss, cpu_ad = train_alternating(path, "cpu", recompute)
    cal_loss, cal_ad = train_alternating(f16_copy(path, tmp_path), "cpu", recompute)
    assert cpu_loss[-1] < cpu_loss[2]                                  # it trained
    from bounds import assert_adamw_close
    assert_adamw_close(vk_ad, cpu_ad, [LR] * STEPS, cal_ad)
    calib = max(abs(k - c) for k, c in zip(cal_loss, cpu_loss))    # the run's rounding scale
    for i, (v, c) in enumerate(zip(vk_loss, cpu_loss)):
        bound = KEPT_SPREAD * max(calib, ulps(c))
        measured(f"recompute {recompute}: loss {i} Vulkan vs CPU (F16 calibration up to "
                 f"{calib:.2g})", abs(v - c), bound)
        assert abs(v - c) <= bound, (i, v, c, calib)
