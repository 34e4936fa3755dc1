"""Make tests/fixtures/qwen35/loraplus_golden.npz: LoRA+ steps of PEFT's own optimizer.

Why: LoRA+ changes no loss and no gradient, only the optimizer: PEFT's
``create_loraplus_optimizer`` puts every lora_B in a parameter group whose learning rate is
lr · loraplus_lr_ratio.  pytrain's ``lora.loraplus_lr_ratio`` must step the adapter exactly
as that optimizer does.

What:
  * the PEFT-wrapped gqa model of scripts/make_peft_golden.py (r=4, alpha=8, q/k/v/o of the
    attention layers 1 and 3) with its deterministic non-zero A and B (``lora_values``);
  * ``create_loraplus_optimizer(model, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=RATIO,
    loraplus_weight_decay=WD, betas=BETAS, eps=EPS)``: the groups it made are checked (every
    lora_A at lr, every lora_B at lr · ratio);
  * STEPS steps, each on fixed gradients (N(0, 1) per tensor, seeded; set as ``.grad``, no
    forward: the optimizer is what is compared); the tensors after each step are kept;
  * once in float32 (as users run it) and once in float64 (the exact answer, so the test can
    bound pytrain by float32 rounding).

Output keys: lr, ratio, weight_decay, beta1, beta2, eps (float64 []), steps (int64 []), and per
adapted tensor T (GGUF names, ``<base>.lora_a`` / ``.lora_b``):
    T float32 (before), T/grad/<i> float32, T/after/<i> float32, T/after64/<i> float64.

How (repo root):  /opt/refenv/bin/python -m scripts.make_loraplus_golden
Deterministic (fixed seeds, one thread); a few seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

from scripts import make_peft_golden as mg

OUT = mg.FIX / "loraplus_golden.npz"
LR, RATIO, WD, BETAS, EPS, STEPS = 1e-3, 16.0, 0.1, (0.9, 0.999), 1e-8, 3


def run(dtype, values: dict, grads: list[dict]) -> list[dict]:
    """The adapter after each LoRA+ AdamW step, in ``dtype``."""
    import torch
    from peft.optimizers import create_loraplus_optimizer
    cfg, model = mg.build_gqa(dtype)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    pm, adapted = mg.wrap_peft(model, full)
    pm.to(dtype)
    params = {}
    with torch.no_grad():
        for base, mod in adapted.items():
            for s, p in ((".lora_a", mod.lora_A["default"].weight),
                         (".lora_b", mod.lora_B["default"].weight)):
                p.copy_(torch.tensor(values[base + s], dtype=dtype))
                params[base + s] = p
    opt = create_loraplus_optimizer(pm, torch.optim.AdamW, lr=LR, loraplus_lr_ratio=RATIO,
                                    loraplus_weight_decay=WD, betas=BETAS, eps=EPS)
    by_lr = {}
    for g in opt.param_groups:
        for p in g["params"]:
            by_lr[id(p)] = g["lr"]
    for name, p in params.items():
        want = LR * RATIO if name.endswith(".lora_b") else LR
        assert by_lr[id(p)] == want, (name, by_lr[id(p)], want)
    assert len(by_lr) == len(params)              # nothing else is trained
    out = []
    for g in grads:
        for name, p in params.items():
            p.grad = torch.tensor(g[name], dtype=dtype)
        opt.step()
        out.append({n: p.detach().numpy().copy() for n, p in params.items()})
    return out


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    import numpy as np
    import torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg, model = mg.build_gqa(torch.float32)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    _, adapted = mg.wrap_peft(model, full)
    values = mg.lora_values(adapted)
    rng = np.random.default_rng(77)
    grads = [{k: rng.normal(0, 1, v.shape).astype(np.float32) for k, v in sorted(values.items())}
             for _ in range(STEPS)]
    f32, f64 = run(torch.float32, values, grads), run(torch.float64, values, grads)
    res = {"lr": np.float64(LR), "ratio": np.float64(RATIO), "weight_decay": np.float64(WD),
           "beta1": np.float64(BETAS[0]), "beta2": np.float64(BETAS[1]), "eps": np.float64(EPS),
           "steps": np.int64(STEPS)}
    for k, v in values.items():
        res[k] = v.astype(np.float32)
        for i in range(STEPS):
            res[f"{k}/grad/{i}"] = grads[i][k]
            res[f"{k}/after/{i}"] = f32[i][k].astype(np.float32)
            res[f"{k}/after64/{i}"] = f64[i][k].astype(np.float64)
        moved = np.abs(f64[-1][k] - v).max()
        err = np.abs(f32[-1][k] - f64[-1][k]).max()
        print(f"{k:32s} moved {moved:.3g}, float32 - float64 after {STEPS} steps {err:.2g}")
    np.savez_compressed(a.out, **res)
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
