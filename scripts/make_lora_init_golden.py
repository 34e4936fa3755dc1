"""Make tests/fixtures/qwen35/lora_init_golden.json: how PEFT initialises a LoRA adapter.

Why: pytrain's ``lora.init`` offers PEFT's default (``init_lora_weights=True``: A
Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(n_in), 1/sqrt(n_in)); B zero) and
``"gaussian"`` (A ~ N(0, 1/r), B zero).  Random draws cannot match value for value (torch's
generator is not numpy's), so the reference is the distribution PEFT's own modules draw: for
each init, over every A of the gqa model's default targets (q/k/v/o of the attention layers)
at rank 16, the number of elements, their mean, standard deviation and largest magnitude,
and the largest |B|.  tests/test_lora_variants.py holds pytrain's draws to these within
sampling error.

How (repo root):  /opt/refenv/bin/python -m scripts.make_lora_init_golden
Deterministic (torch seed 0); a few seconds.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts import make_peft_golden as mg

OUT = mg.FIX / "lora_init_golden.json"
RANK = 16


def stats(init) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg, model = mg.build_gqa(torch.float32)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(
        mg.HF_TO_GGUF), layers_to_transform=full, layers_pattern="layers",
        init_lora_weights=init))
    a, b, n_in = [], [], set()
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and isinstance(mod.lora_A, torch.nn.ModuleDict):
            w = mod.lora_A["default"].weight.detach().double().numpy()
            a.append(w.reshape(-1))
            n_in.add(w.shape[1])
            b.append(mod.lora_B["default"].weight.detach().double().numpy().reshape(-1))
    a = np.concatenate(a)
    assert len(n_in) == 1, n_in            # one input width: one Kaiming bound
    return {"n": int(a.size), "n_in": n_in.pop(), "mean": float(a.mean()),
            "std": float(a.std()), "max_abs": float(np.abs(a).max()),
            "b_max_abs": float(np.abs(np.concatenate(b)).max())}


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    res = {"rank": RANK, "peft": stats(True), "gaussian": stats("gaussian")}
    a.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(json.dumps(res, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
