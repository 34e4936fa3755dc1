"""LoRA loss and gradients against HF transformers + PEFT (no torch here: the golden is an npz).

tests/fixtures/qwen35/peft_grads.npz (scripts/make_peft_golden.py): PEFT LoRA r=4, alpha=8 on
q/k/v/o of gqa's full-attention layers 1 and 3 with random non-zero A and B, on a padded
(lengths 20, 13, 7 right-padded to 20 with the pad id, attention_mask 0 there) and
prompt-masked (prefixes 5, 3, 2) batch; HF's causal-LM loss (labels shifted inside, mean over
the 30 valid targets) and d loss / d A, d loss / d B of every adapter, twice:

  * ``loss``, ``*.grad``: the HF model the GGUF was converted from, float32 (PEFT as users run it);
  * ``loss64``, ``*.grad64``: the same in true float64 (no float32 islands) on the GGUF's exact
    weights, i.e. the exact answer for the model pytrain runs.

Here the same A and B go into pytrain's adapter on gqa-f32.gguf, targets come from
`shift_targets` with train_mask = labels != -100 and seg = -1 on padding, and GradGraph's
loss and gradients are compared.  Gradient errors are per tensor, max |error| / max |reference|.

Measured (float32, ggml CPU with F32 matmuls through OpenBLAS, 2 threads; graph width 20 / 64;
bench_results/parity.md, made by scripts/report_parity.py, has the current figures):
                          loss |error|      worst gradient error (of the tensor's max)
  pytrain vs PEFT f32     1.9e-6 / 2.9e-6   4.0e-5 / 4.2e-5   (layer 1; layer 3: 5e-6 / 7e-6)
  pytrain vs PEFT f64     6.5e-8 / 1.0e-6   1.2e-5 / 8.5e-6
  PEFT f32 vs PEFT f64    1.8e-6            4.6e-5
So the difference from PEFT float32 is PEFT's own float32 rounding (its layer-1 gradients pass
back through DeltaNet layer 2 and attention layer 3): measured against the float64 run,
pytrain's error is 0.1-0.3 of PEFT float32's on layer 1 and up to 1.4 of it on layer 3, where
both are ~5e-6.

Bounds (tests/bounds.py, ``reference_bounds``): the golden holds the float32 rounding of this
very computation on this input, PEFT float32 against the exact run, per tensor and for the
loss, made on the machine that made the golden; pytrain's own float32 rounding of the same step
is measured now (tests/step_rounding.py: rows reversed, the other matmul kernels).  pytrain's
float32 program may be ``F32_SPREAD`` (4) times the larger of the two from the exact answer
(at least a few ulps), and from PEFT float32 that plus PEFT's own distance from the exact run:
two float32 evaluations made on different machines differ by up to both of their errors.
"""
from pathlib import Path

import numpy as np
import pytest

import pytrain
from bounds import reference_bounds
from step_rounding import measure
from pytrain.step import loss as L
from pytrain.models import lora
from pytrain.step.graphs import GradGraph
from pytrain.models.lora_targets import select_targets

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
RANK, ALPHA = 4, 8


# the variants of make_peft_golden: plain LoRA, and rsLoRA (PEFT's use_rslora: alpha/sqrt(r))
GOLDENS = {"lora": "peft_grads.npz", "rslora": "peft_rslora.npz"}


@pytest.fixture(scope="module", params=sorted(GOLDENS))
def golden(request):
    return dict(np.load(FIX / GOLDENS[request.param]), variant=request.param)


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module", params=[20, 64], ids=["width20", "width64"])
def result(request, golden, model):
    """pytrain's loss and LoRA gradients for the golden batch, with the graph exactly as wide
    as the batch (20) or padded further to one full DeltaNet chunk (64); and its own float32
    rounding of that step (``step_rounding.measure``) as ``out["own"]``."""
    names = select_targets(model.config)
    ad = lora.create(model.runtime, model.config, names, rank=RANK, alpha=ALPHA, seed=0,
                     rslora=golden["variant"] == "rslora")
    ad.set({k: golden[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
    tokens, labels = golden["input_ids"], golden["labels"]
    seg = np.where(golden["attention_mask"] > 0, 0, -1)
    tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
    g = GradGraph(model, ad, B=tokens.shape[0], T=request.param)
    out = g.run(tokens, seg, tgt)
    g.close()
    out["own"] = measure(model, ad, tokens.shape[0], request.param, tokens, seg, tgt)
    return names, tgt, out


def test_golden_covers_exactly_the_default_targets(golden, result):
    names, _, out = result
    assert names == [f"blk.{i}.{t}.weight" for i in (1, 3)
                     for t in ("attn_q", "attn_k", "attn_v", "attn_output")]
    in_golden = {k.removesuffix(".lora_a.grad") for k in golden if k.endswith(".lora_a.grad")}
    assert in_golden == set(names)
    assert set(out["grads"]) == {n + s for n in names for s in (".lora_a", ".lora_b")}


def test_targets_are_hf_shifted_labels(golden, result):
    _, tgt, out = result
    labels = golden["labels"]
    # HF scores logits[t] against labels[t + 1]; the last position has no target
    np.testing.assert_array_equal(tgt[:, :-1], labels[:, 1:])
    assert (tgt[:, -1] == L.IGNORE).all()
    assert out["n_valid"] == int(golden["n_valid"]) == 30


@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_loss_matches_peft(golden, result, ref, measured):
    _, _, out = result
    exact = float(golden["loss64"])
    peft_rounding = abs(float(golden["loss"]) - exact)
    # the exact run is a float64 one (not PEFT float32 again); how far PEFT float32 lies from
    # it depends on the machine that made the golden (under MKL_CBWR=COMPATIBLE within 1e-7)
    assert float(np.float32(exact)) != exact
    want = float(golden["loss" if ref == "f32" else "loss64"])
    bound = reference_bounds(out["own"]["loss"], peft_rounding, exact)[ref == "f32"]
    measured(f"loss vs PEFT {ref}, |Δ|", abs(out["loss"] - want), bound)
    assert abs(out["loss"] - want) <= bound, (out["loss"], want, bound)


@pytest.mark.parametrize("ref", ["f32", "f64"])
def test_lora_gradients_match_peft(golden, result, ref, measured):
    names, _, out = result
    suffix = ".grad" if ref == "f32" else ".grad64"
    worst = (0.0, "")
    for n in names:
        for s in (".lora_a", ".lora_b"):
            exact = golden[n + s + ".grad64"]
            want = golden[n + s + suffix].astype(np.float64)
            got = out["grads"][n + s].astype(np.float64)
            assert got.shape == want.shape, (n + s, got.shape, want.shape)
            scale = np.abs(exact).max()
            assert scale > 1e-2, (n + s, scale)      # the golden is far from zero
            peft_rounding = np.abs(golden[n + s + ".grad"] - exact).max()
            assert (exact.astype(np.float32) != exact).any(), n + s   # a float64 run
            err = np.abs(got - want).max() / scale
            bound = reference_bounds(out["own"]["grads"][n + s], peft_rounding,
                                     exact)[ref == "f32"] / scale
            worst = max(worst, (err / bound, n + s))
            measured(f"{n + s} gradient vs PEFT {ref}, max error / max |grad|", err, bound)
            assert err <= bound, (n + s, err, bound)
    print(f"PEFT {ref}: worst gradient error {worst[0]:.2f} of its bound ({worst[1]})")
