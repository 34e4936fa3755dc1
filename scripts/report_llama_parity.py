#!/usr/bin/env python3
"""Measure the Llama parity figures the README quotes, each computed as the named test computes
it, into bench_results/llama_parity.md (+ .json).

Why: the tests assert bounds; the README gives the measured errors, and every README figure
must come from a committed file made by a committed command.  This script imports the tests'
own helpers (tests/test_llama_parity.py, test_llama_weight_types.py, test_smollm2.py), so a
figure here is what the test saw on this machine.

Usage:  .venv/bin/python scripts/report_llama_parity.py      (about a minute; needs the
        llama.cpp build and the fetched SmolLM2 for the last two sections, as `make test` does)
"""
from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "native"))
sys.path.insert(0, str(ROOT / "scripts"))

import pytrain  # noqa: E402
import test_llama_parity as P  # noqa: E402
import test_llama_weight_types as W  # noqa: E402


def forward_section(res: dict) -> list[str]:
    rows = []
    for name in ("gqa-f32", "untied-f32", "llama3-f32"):
        gold = np.load(P.FIX / f"{name.split('-')[0]}.npz")
        m = pytrain.load_model(P.FIX / f"{name}.gguf", device="cpu", threads=2)
        e = P.max_error(m, gold, gold["logprobs"])
        m.close()
        res[f"hf/{name}"] = e
        rows.append(f"| {name} vs HF `LlamaForCausalLM` float32 | {e:.2e} | 1e-4 |")
    for name in P.FILES:
        gold = np.load(P.FIX / f"{name.split('-')[0]}.npz")
        want = np.load(P.FIX / f"{name}.f64.npz")["logprobs64"]
        for policy in ("f32", "auto"):
            if policy == "auto" and name.endswith("f32"):
                continue
            m = pytrain.load_model(P.FIX / f"{name}.gguf", device="cpu", threads=2,
                                   type_policy=policy)
            e = P.max_error(m, gold, want)
            m.close()
            bound = 1e-4 if policy == "f32" else "the type's own noise (see the test)"
            res[f"f64/{name}/{policy}"] = e
            how = "loaded as F32" if policy == "f32" else "default loading (weights kept)"
            rows.append(f"| {name}, {how}, vs float64 of its weights | {e:.2e} | {bound} |")
    return ["## Forward: max |Δ log-softmax| (tests/test_llama_parity.py)", "",
            "| check | error | bound |", "|---|---|---|"] + rows


def peft_section(res: dict) -> list[str]:
    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.train import loss as L
    from pytrain.train.graphs import GradGraph
    rows = []
    for name in ("gqa", "llama3"):
        gold = dict(np.load(P.FIX / f"peft_{name}.npz"))
        m = pytrain.load_model(P.FIX / f"{name}-f32.gguf", device="cpu", threads=2)
        targets = ("attn_q", "attn_k", "attn_v", "attn_output") + \
            (("ffn_gate", "ffn_up", "ffn_down") if name == "llama3" else ())
        names = select_targets(m.config, targets)
        ad = lora.create(m.runtime, m.config, names, rank=P.RANK, alpha=P.ALPHA, seed=0)
        ad.set({k: gold[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
        seg = np.where(gold["attention_mask"] > 0, 0, -1)
        tgt = L.shift_targets(gold["input_ids"], gold["labels"] != L.IGNORE, seg)
        g = GradGraph(m, ad, B=gold["input_ids"].shape[0], T=gold["input_ids"].shape[1])
        out = g.run(gold["input_ids"], seg, tgt)
        g.close()
        m.close()
        for ref, suffix, lkey in (("f32", ".grad", "loss"), ("f64", ".grad64", "loss64")):
            worst = max(float(np.abs(out["grads"][n + s] - gold[n + s + suffix]).max()
                              / np.abs(gold[n + s + suffix]).max())
                        for n in names for s in (".lora_a", ".lora_b"))
            dl = abs(out["loss"] - float(gold[lkey]))
            res[f"peft/{name}/{ref}"] = {"loss": dl, "grad": worst}
            rows.append(f"| {name}, {len(names)} adapters, vs PEFT {ref} | {dl:.1e} | "
                        f"{worst:.1e} | {P.PEFT_TOL[ref][0]} / {P.PEFT_TOL[ref][1]} |")
    return ["## LoRA gradients vs PEFT 0.21.2 (tests/test_llama_parity.py)", "",
            "| check | |loss error| | worst gradient error (of the tensor's max) | bounds |",
            "|---|---|---|---|"] + rows


def types_section(res: dict, exe) -> list[str]:
    from llama_cpp_check import run_llama
    from scripts.gguf_models import write_llama
    from llama_ref import forward_gguf
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in W.TYPES:
            model = write_llama(Path(tmp) / f"m-{dtype}.gguf", dtype)
            want = forward_gguf(model.path, W.TOKENS)
            errs = {}
            for policy in ("f32", "auto"):
                m = pytrain.load_model(model.path, device="cpu", threads=2, type_policy=policy)
                errs[policy] = float(np.abs(W.log_softmax(m.logits(W.TOKENS)) - want).max())
                if policy == "auto":
                    ours = W.log_softmax(m.logits(W.TOKENS))
                m.close()
            cpp = ""
            if exe is not None:
                theirs = W.log_softmax(run_llama(exe, model.path, None, W.TOKENS,
                                                 Path(tmp) / "l.f32", 64))
                cpp = float(np.abs(ours - theirs).max())
                res[f"types/{dtype}/llama.cpp"] = cpp
                cpp = f"{cpp:.1e}"
            res[f"types/{dtype}"] = errs
            rows.append(f"| {dtype} | {errs['f32']:.1e} | {errs['auto']:.3g} | {cpp} |")
    return ["## Weight types (tests/test_llama_weight_types.py): max |Δ log-softmax|", "",
            "| type | loaded as F32 vs float64 | kept vs float64 | kept vs llama.cpp on the file |",
            "|---|---|---|---|"] + rows


def smollm2_section(res: dict, exe) -> list[str]:
    import fetch_model
    import test_smollm2 as S
    from llama_cpp_check import run_llama
    from llama_ref import forward_gguf
    gguf = fetch_model.fetched("smollm2")
    if gguf is None or exe is None:
        return ["## SmolLM2-135M-Instruct", "", "not measured: run `make test` first (it "
                "fetches the model and builds llama.cpp)"]
    m = pytrain.load_model(gguf, device="cpu", threads=2)
    ids = S.chat_ids(m)
    ours = S.log_softmax(m.logits(np.array(ids)))
    with tempfile.TemporaryDirectory() as tmp:
        theirs = S.log_softmax(run_llama(exe, gguf, None, ids, Path(tmp) / "l.f32", 49152))
    m.close()
    kl = (np.exp(theirs) * (theirs - ours)).sum(-1)
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    m32 = pytrain.load_model(gguf, device="cpu", threads=2, type_policy="f32")
    e32 = float(np.abs(S.log_softmax(m32.logits(np.array(ids[:24])))
                       - forward_gguf(gguf, ids[:24])).max())
    m32.close()
    res["smollm2"] = {"f32_vs_f64": e32, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                      "argmax_agree": agree, "n_tokens": len(ids)}
    return ["## SmolLM2-135M-Instruct (tests/test_smollm2.py)", "",
            "| check | measured | bound |", "|---|---|---|",
            f"| loaded as F32 vs float64 of its weights (24 tokens) | {e32:.1e} | 1e-4 |",
            f"| Q4_1 kept vs llama.cpp, KL per position ({len(ids)} chat tokens) | mean "
            f"{kl.mean():.1e}, max {kl.max():.1e} | 0.01 / 0.1 |",
            f"| the same, argmax agreement | {agree:.0%} | every position with a top-2 gap "
            f">= 0.3 |"]


def main() -> int:
    from llama_cpp_check import built_binary
    exe = built_binary()
    res: dict = {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "")
    lines = ["# Llama parity", "",
             f"Made by `.venv/bin/python scripts/report_llama_parity.py` at commit {commit}, "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, on an {cpu}, 2 threads.  "
             "Each figure is computed as the named test computes it; the float32 figures are "
             "rounding and move a little with the CPU and build, the bounds do not.", ""]
    for section in (forward_section(res), peft_section(res), types_section(res, exe),
                    smollm2_section(res, exe)):
        lines += section + [""]
    out = ROOT / "bench_results"
    (out / "llama_parity.md").write_text("\n".join(lines))
    (out / "llama_parity.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
