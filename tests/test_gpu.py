"""The references of the CPU tests, on a CUDA device (skipped without one; ``scripts/gpu_check.sh``
runs them on a GPU machine and keeps what they print).

Bounds, and why they are wider than on the CPU:
  * F32 weights: ggml-cuda runs F32 matmuls through cuBLAS with TF32 on (common.cuh), which
    rounds both operands to a 10-bit mantissa, F16's precision.  The CPU computes exactly that
    rounding with the same weights stored as F16 (ggml-cpu's F16 matmul rounds the
    activations to F16 too): its distance from the float64 reference on the same input is
    TF32's own noise there (``tf32_noise``, measured in the test), and the device is allowed
    ``bounds.KEPT_SPREAD`` (4) times it, for log-probabilities, the loss and each gradient
    tensor (relative to its largest entry).
  * BF16 and Q8_0 weights stay in their type: compared with the CPU computing with the same
    weights kept, within the type's own noise (test_kept_weights_round_as_the_cpu_does).
The measured values are printed (``-s``) and kept by gpu_check.sh; a bound that is far from
them gets tightened after the first GPU run.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import has_gpu

# the device these tests run on: a CUDA GPU, or, for the rehearsal on CPU machines
# (tests/test_rpc_device.py), the device an RPC server serves (PYTRAIN_TEST_DEVICE=rpc:HOST:PORT)
DEVICE = os.environ.get("PYTRAIN_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not has_gpu(),
                                 reason="needs a CUDA device (ggml reports none)")]

import pytrain  # noqa: E402
from pytrain.step import loss as L  # noqa: E402
from pytrain.models import lora  # noqa: E402
from pytrain.step.graphs import GradGraph  # noqa: E402
from pytrain.models.lora_targets import select_targets  # noqa: E402

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def f16_copy(name: str, tmp: Path) -> Path:
    from scripts.gguf_models import retyped_copy
    return retyped_copy(FIX / f"{name}.gguf", tmp / f"{name}-f16.gguf", "f32", "f16")


@pytest.fixture(scope="module")
def tf32_noise(tmp_path_factory):
    """``noise(kind, ...)``: TF32's own noise, computed on the CPU with the F32 weights stored as
    F16 (both matmul operands rounded to F16's precision, as TF32 rounds them): "logprob"
    (name, golden) against the float64 golden; "step" against PEFT's float64 loss and
    gradients (relative to each tensor's largest entry)."""
    tmp = tmp_path_factory.mktemp("tf32")
    cache: dict = {}

    def noise(kind: str, *args):
        if (kind, args) not in cache:
            cache[kind, args] = (_logprob_noise(tmp, *args) if kind == "logprob"
                                 else _step_noise(tmp))
        return cache[kind, args]
    return noise


def _logprob_noise(tmp: Path, name: str, golden: str) -> float:
    g = np.load(FIX / f"{golden}.npz")
    truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
    m = pytrain.load_model(f16_copy(name, tmp), device="cpu", threads=2)
    try:
        return max(float(np.abs(log_softmax(m.logits(t[:n])) - truth[i, :n]).max())
                   for i, (t, n) in enumerate(zip(g["tokens"], g["lengths"])))
    finally:
        m.close()


def _step_noise(tmp: Path) -> tuple[float, float]:
    gold = dict(np.load(FIX / "peft_grads.npz"))
    out = peft_step(f16_copy("gqa-f32", tmp), gold, "cpu")
    return step_errors(out, gold)


def peft_step(path: Path, gold: dict, device: str, recompute: str = "off") -> dict:
    """pytrain's loss and LoRA gradients on the PEFT golden's batch (tests/test_peft_parity)."""
    from pytrain.step.recompute import RecomputeGraph
    m = pytrain.load_model(path, device=device)
    try:
        names = select_targets(m.config)
        ad = lora.create(m.runtime, m.config, names, rank=4, alpha=8, seed=0)
        ad.set({k: gold[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
        tokens, labels = gold["input_ids"], gold["labels"]
        seg = np.where(gold["attention_mask"] > 0, 0, -1)
        tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
        g = (GradGraph(m, ad, tokens.shape[0], 20) if recompute == "off"
             else RecomputeGraph(m, ad, tokens.shape[0], 20))
        out = g.run(tokens, seg, tgt)
        g.close()
        return out
    finally:
        m.close()


def step_errors(out: dict, gold: dict) -> tuple[float, float]:
    """(|loss - PEFT float64|, worst gradient error relative to the tensor's largest entry)."""
    loss_err = abs(out["loss"] - float(gold["loss64"]))
    worst = max(float(np.abs(out["grads"][k] - gold[k + ".grad64"]).max()
                      / np.abs(gold[k + ".grad64"]).max()) for k in out["grads"])
    return loss_err, worst


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("name, golden", [("gqa-f32", "gqa"), ("untied-f32", "untied")])
def test_cuda_logits_match_the_float64_reference(name, golden, tf32_noise):
    from bounds import KEPT_SPREAD, ulps
    g = np.load(FIX / f"{golden}.npz")
    truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
    m = pytrain.load_model(FIX / f"{name}.gguf", device=DEVICE)
    try:
        assert m.runtime.device == DEVICE.split(":")[0]
        err = max(np.abs(log_softmax(m.logits(t[:n])) - truth[i, :n]).max()
                  for i, (t, n) in enumerate(zip(g["tokens"], g["lengths"])))
    finally:
        m.close()
    bound = KEPT_SPREAD * max(tf32_noise("logprob", name, golden), ulps(truth[truth > -np.inf]))
    print(f"\n{name} on {DEVICE} vs float64: max |Δ log-softmax| {err:.3g} (bound {bound:.3g})")
    assert err <= bound


@pytest.mark.parametrize("name, golden", [("gqa-bf16", "gqa"), ("gqa-q8_0", "gqa")])
def test_kept_weights_round_as_the_cpu_does(name, golden):
    """BF16 and Q8_0 weights stay in their type on the device, and its matmuls round the
    activations to that type (cuBLAS's BF16 GEMM; MMQ's Q8_1) as ggml-cpu does with the same
    weights kept (``type_policy="keep"``): two roundings of one function, within the kept
    type's own noise on these tokens (``bounds.assert_same_rounding``, pytrain on the CPU with
    the weights as F32 for the function).  BF16 activations keep 8 bits: this is far coarser
    than TF32, and than the CPU's default F16 loading of a BF16 file."""
    from bounds import assert_same_rounding
    g = np.load(FIX / f"{golden}.npz")
    out = {}
    for key, device, policy in (("dev", DEVICE, "auto"), ("keep", "cpu", "keep"),
                                ("f32", "cpu", "f32")):
        m = pytrain.load_model(FIX / f"{name}.gguf", device=device, type_policy=policy)
        try:
            out[key] = [log_softmax(m.logits(t[:n])) for t, n in zip(g["tokens"], g["lengths"])]
        finally:
            m.close()
    for i, (a, b, f) in enumerate(zip(out["dev"], out["keep"], out["f32"])):
        print(f"\n{name} row {i}: {DEVICE} vs CPU keep {np.abs(a - b).max():.3g}, CPU keep vs "
              f"F32 {np.abs(b - f).max():.3g}")
        assert_same_rounding(a, b, f)


@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_cuda_lora_gradients_match_peft(recompute, tf32_noise):
    from bounds import KEPT_SPREAD, U32
    gold = dict(np.load(FIX / "peft_grads.npz"))
    out = peft_step(FIX / "gqa-f32.gguf", gold, DEVICE, recompute)
    loss_err, worst = step_errors(out, gold)
    noise_loss, noise_grad = tf32_noise("step")
    max_loss = KEPT_SPREAD * max(noise_loss, 8 * U32 * float(gold["loss64"]))
    max_grad = KEPT_SPREAD * max(noise_grad, 8 * U32)
    print(f"\nCUDA ({recompute}) vs PEFT float64: loss {loss_err:.3g} (bound {max_loss:.3g}), "
          f"worst gradient {worst:.3g} (bound {max_grad:.3g})")
    assert out["n_valid"] == 30
    assert loss_err <= max_loss and worst <= max_grad


@pytest.mark.parametrize("B, T", [(1, 32), (16, 4096)])
def test_training_graphs_stay_on_the_gpu(B, T):
    """The runtime refuses a graph the scheduler would split onto the CPU (CPUFallbackError):
    allocating the step graphs at the largest micro-batch proves none falls back."""
    from pytrain.step.recompute import RecomputeGraph
    m = pytrain.load_model(FIX / "gqa-q8_0.gguf", device=DEVICE)
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 4, 8.0)
        g = GradGraph(m, ad, B, T, rows=B * T // 2)
        m.runtime.alloc_graph(g.graph, g.ctx)
        assert not m.runtime.cpu_fallbacks(g.graph)
        g.close()
        r = RecomputeGraph(m, ad, B, T)
        for part in [r.pre, *r.fwd, r.head, *r.bwd.values()]:
            m.runtime.alloc_graph(part.graph, part.ctx)
        r.close()
    finally:
        m.close()


def test_cuda_training_run_lowers_the_loss_and_llama_cpp_loads_its_adapter(tmp_path, capsys):
    """`pytrain train` on CUDA (the animal chats of test_train_run), then llama.cpp (CPU
    build) runs the written adapter: its logits match pytrain's on CUDA within TF32's bound."""
    from test_train_run import records, write_config, write_data

    from pytrain.cli import main
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=30)
    cfg.write_text(cfg.read_text().replace('device = "cpu"', f'device = "{DEVICE}"'))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    valid = [r for r in records(tmp_path / "out") if r.get("split") == "valid"]
    print(f"\nCUDA run: validation loss {valid[0]['loss']:.3f} -> {valid[-1]['loss']:.3f}")
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.5
    from llama_cpp_check import built_binary, llama_cpp_compatible, run_llama
    exe = built_binary()
    if exe is None:
        pytest.skip("llama.cpp not built (scripts/build_llama_cpp.py)")
    from pytrain.cli import _load_adapter
    base = llama_cpp_compatible(FIX / "gqa-f32.gguf", tmp_path)
    m = pytrain.load_model(base, device=DEVICE)
    try:
        ad = _load_adapter(m, tmp_path / "out" / "adapter.gguf")
        toks = np.random.default_rng(7).integers(0, 480, 40)
        ours = m.logits(toks, lora=ad.hook)
    finally:
        m.close()
    cpp = run_llama(exe, base, tmp_path / "out" / "adapter.gguf", toks, tmp_path / "l.f32",
                    ours.shape[-1])
    d = float(np.abs(log_softmax(cpp) - log_softmax(ours)).max())
    # TF32's noise on these tokens with this adapter: the CPU with the weights as F16 against
    # the CPU in F32 (llama.cpp, the CPU in F32, is float32 rounding away from the latter)
    from bounds import KEPT_SPREAD, ulps
    cpu = {}
    for key, path in (("f32", base), ("f16", f16_copy("gqa-f32", tmp_path))):
        mc = pytrain.load_model(path, device="cpu", threads=2)
        try:
            cpu[key] = log_softmax(mc.logits(toks, lora=_load_adapter(mc, tmp_path / "out" /
                                                                        "adapter.gguf").hook))
        finally:
            mc.close()
    bound = KEPT_SPREAD * max(float(np.abs(cpu["f16"] - cpu["f32"]).max()), ulps(cpu["f32"]))
    print(f"llama.cpp (CPU) with the CUDA-trained adapter vs pytrain on CUDA: {d:.3g} "
          f"(bound {bound:.3g})")
    (tmp_path / "measured.json").write_text(json.dumps({"llama_vs_cuda": d, "bound": bound}))
    assert d <= bound


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA build's doctor line")
def test_pytrain_doctor_sees_the_gpu():
    import sys
    out = subprocess.run([sys.executable, "-m", "pytrain", "doctor"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    assert "cuda" in out.lower() and " gpu " in out
