"""AdamW with global-norm clipping against a numpy reference, and a few real training steps."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pytrain
from pytrain.step import loss as L
from pytrain.models import lora
from pytrain.step.graphs import GradGraph
from pytrain.models.lora_targets import select_targets
from pytrain.step.optimizer import OptimizerState, AdamWSettings, Optimizer, schedule
from pytrain.step.trainer import Trainer

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    yield m
    m.close()


def make_batch(rng, lengths, T, prompt=2, period=None):
    B = len(lengths)
    tokens = rng.integers(0, 480, (B, T))
    if period:   # a repeating pattern: learnable in a few steps
        tokens = np.tile(rng.integers(0, 480, (B, period)), (1, -(-T // period)))[:, :T]
    seg = np.full((B, T), -1)
    train = np.zeros((B, T), bool)
    for b, n in enumerate(lengths):
        seg[b, :n] = 0
        train[b, prompt:n] = True
        tokens[b, n:] = 480
    return SimpleNamespace(tokens=tokens, seg=seg, train_mask=train)


def adamw_ref(p, g, m, v, t, hp, lr, clip):
    g = g * clip
    m = hp.beta1 * m + (1 - hp.beta1) * g
    v = hp.beta2 * v + (1 - hp.beta2) * g * g
    mh = m / (1 - hp.beta1 ** t)
    vh = v / (1 - hp.beta2 ** t)
    return p * (1 - lr * hp.weight_decay) - lr * mh / (np.sqrt(vh) + hp.eps), m, v


def test_adamw_with_clipping_matches_numpy(model):
    ad = lora.create(model.runtime, model.config, select_targets(model.config), 4, 8, seed=1)
    rng = np.random.default_rng(2)
    vals = ad.get()
    for k in vals:
        vals[k] = rng.normal(0, 0.1, vals[k].shape).astype(np.float32)
    ad.set(vals)
    hp = AdamWSettings(lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)
    opt_state = OptimizerState(model.runtime, ad.params())
    opt = Optimizer(model.runtime, opt_state, hp)
    g = GradGraph(model, ad, B=2, T=12, opt_state=opt_state)
    b = make_batch(rng, [12, 7], 12)
    tg = L.shift_targets(b.tokens, b.train_mask, b.seg)
    state = {k: (vals[k].astype(np.float64), 0.0, 0.0) for k in vals}
    for t in (1, 2):
        grads = g.run(b.tokens, b.seg, tg)["grads"]
        norm = opt.grad_norm()
        ref_norm = np.sqrt(sum((x.astype(np.float64) ** 2).sum() for x in grads.values()))
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm
        clip = opt.step(lr=1e-2, grad_norm=norm)
        assert clip < 1.0 and abs(clip - 0.05 / ref_norm) < 1e-4
        new = ad.get()
        for k in vals:
            p, m, v = state[k]
            p, m, v = adamw_ref(p, grads[k], m, v, t, hp, 1e-2, clip)
            state[k] = (p, m, v)
            np.testing.assert_allclose(new[k], p, atol=2e-6, rtol=1e-5, err_msg=k)
    g.close()


def test_schedules():
    assert schedule("constant", 5, 10, 1.0) == 1.0
    assert schedule("linear", 0, 10, 1.0, warmup=2) == 0.5
    assert abs(schedule("linear", 6, 10, 1.0, warmup=2) - 0.5) < 1e-12
    assert abs(schedule("cosine", 2, 10, 1.0, warmup=2) - 1.0) < 1e-12
    assert abs(schedule("cosine", 10, 10, 1.0, warmup=2)) < 1e-12
    with pytest.raises(ValueError, match="schedule"):
        schedule("step", 0, 1, 1.0)


def test_training_steps_lower_the_loss_on_fixed_data(model):
    """Two batches of repeating patterns: the masked loss falls, accuracy rises, the adapter
    drifts from zero."""
    ad = lora.create(model.runtime, model.config, select_targets(model.config), 8, 16, seed=0)
    tr = Trainer(model, ad, AdamWSettings(lr=1e-2, max_grad_norm=1.0))
    rng = np.random.default_rng(3)
    batches = [make_batch(rng, [16, 11], 16, period=3), make_batch(rng, [9, 16], 16, period=3)]
    first = tr.evaluate(batches)
    before = first["loss"]
    assert ad.drift() == 0.0
    for _ in range(10):
        r = tr.step(batches, lr=1e-2)
        assert r.n_valid == sum(int((L.shift_targets(b.tokens, b.train_mask, b.seg) >= 0).sum())
                                for b in batches)
    after = tr.evaluate(batches)
    assert after["loss"] < before - 0.5
    assert after["accuracy"] > first["accuracy"] + 0.6 and ad.drift() > 0
    assert tr.step([make_batch(rng, [1, 2], 4, prompt=2)], lr=1e-3) is None   # no targets
    tr.close()
