#!/usr/bin/env python3
"""Measure every parity figure the project states and write them to result files.

Writes ``bench_results/parity.md`` (a table: check, case, measured value, the bound the test
holds it to) and ``bench_results/parity.json`` (the raw numbers, per sequence and per tensor),
with the command, date, commit and CPU.  Each quantity is computed exactly as the test that
guards it computes it, reusing the tests' own helpers and parameter lists (tests/ is put on
``sys.path``):

  forward      tests/test_qwen35_parity.py: pytrain's log-softmax on the Qwen3.5 fixtures
               (F32, BF16, Q8_0 GGUFs; default loading and type_policy="f32") against the
               float64 numpy forward over each file's own weights (<file>.f64.npz, made by
               scripts/make_qwen35_f64_golden.py) and against HF transformers float32
               (<model>.npz, scripts/make_qwen35_fixtures.py); max |Δ log-softmax| over the
               5 golden sequences.  Also HF float32 itself against the float64 golden, and
               pytrain with the DeltaNet chunk (pytrain.models.delta_net.CHUNK, monkeypatched
               here) at 16 and 64 instead of 32.
  delta_net    tests/test_delta_net.py: the chunked gated delta rule and the causal conv
               against ggml's fused GATED_DELTA_NET / SSM_CONV and the float64 token-by-token
               references (max |Δ| of outputs).
  peft         tests/test_peft_parity.py: LoRA loss and per-tensor gradient errors
               (max |error| / max |reference|) against HF + PEFT float32 and float64
               (peft_grads.npz, scripts/make_peft_golden.py), graph widths 20 and 64; also
               PEFT float32 against float64, and width 64 with chunks of 64 (the chunk size
               before commit 47de06b).
  llama_cpp    tests/test_llama_cpp_adapter.py: llama.cpp's logits (scripts/llama_logits,
               built by scripts/build_llama_cpp.py) against pytrain's, without and with a
               rank-4 adapter, and the adapter's effect; gqa/untied at the test's T = 40, 100
               and also T = 160; the Q4_0 copy of gqa.  "not run" when the binary is absent.

No torch: every reference is a committed .npz (or llama.cpp itself).  About 15 seconds on
2 CPU cores.

    .venv/bin/python scripts/report_parity.py            # writes bench_results/parity.{md,json}
    .venv/bin/python scripts/report_parity.py --no-llama-cpp --out-dir /tmp/p
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "native", REPO / "scripts", REPO / "tests", REPO):
    sys.path.insert(0, str(p))

import pytrain  # noqa: E402
from pytrain.models import delta_net as dn  # noqa: E402

import test_qwen35_parity as TQ  # noqa: E402
import test_delta_net as TD  # noqa: E402
import test_peft_parity as TP  # noqa: E402
import delta_ref  # noqa: E402
from bounds import F32_SPREAD, ulps  # noqa: E402
from graph_harness import run as run_graph  # noqa: E402
from bench_forward import machine_facts  # noqa: E402

FIX = TQ.FIX
# (file, golden, loading): the F32 files and the BF16 / Q8_0 files loaded as F32 are bounded in
# tests/test_qwen35_parity.py; the kept loadings are compared with llama.cpp in
# tests/test_llama_cpp_adapter.py (no fixed bound here)
FORWARD_ROWS = [("gqa-f32", "gqa", "auto"), ("untied-f32", "untied", "auto"),
                ("gqa-bf16", "gqa", "f32"), ("gqa-q8_0", "gqa", "f32"),
                ("gqa-bf16", "gqa", "auto"), ("gqa-q8_0", "gqa", "auto")]
THREADS = 2                     # what every test here uses
PEFT_WIDTHS = (20, 64)          # test_peft_parity.result's params
DELTA_ATOL = 2e-5               # test_gated_delta_rule_matches_fused_op (fused, float64, each other)
CONV_ATOL = 1e-5                # test_causal_conv_matches_ssm_conv
EXTRA_CHUNKS = (16, 64)         # delta_net.CHUNK values measured besides the committed one
LLAMA_EXTRA_T = (160,)          # besides test_llama_cpp_adapter's T list
# what the figures depend on (an uncommitted change here is named in the report header)
INPUTS = ["pytrain", "native", "tests/fixtures/qwen35", "scripts/report_parity.py",
          "scripts/bench_forward.py", "scripts/build_llama_cpp.py", "scripts/llama_logits.c"] + [
    f"tests/{f}" for f in ("test_qwen35_parity.py", "test_delta_net.py", "test_peft_parity.py",
                           "test_llama_cpp_adapter.py", "delta_ref.py", "graph_harness.py",
                           "llama_cpp_check.py")] + ["scripts/gguf_models.py"]


def params_of(test_fn, argnames: str | None = None):
    """The argument tuples of a test's @pytest.mark.parametrize (the one naming ``argnames``)."""
    for m in getattr(test_fn, "pytestmark", []):
        if m.name == "parametrize" and (argnames is None or m.args[0] == argnames):
            return [tuple(v) if isinstance(v, (tuple, list)) else (v,) for v in m.args[1]]
    raise LookupError(f"{test_fn.__name__}: no parametrize mark {argnames or ''}")


def fmt(x, digits: int = 2) -> str:
    """6.1e-5 style (README's), plain for 0.01 <= |x| < 100."""
    if x is None:
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    if 0.01 <= abs(x) < 100:
        return f"{x:.{digits}g}"
    m, e = f"{x:.{digits - 1}e}".split("e")
    return f"{m}e{int(e)}"


# ---------------------------------------------------------------- forward (test_qwen35_parity)

def per_sequence(model, golden, logprobs) -> list[float]:
    """TQ.errors, sequence by sequence (its max is TQ.errors)."""
    return [float(np.abs(TQ.log_softmax(model.logits(toks[:n])) - logprobs[i, :n]).max())
            for i, (toks, n) in enumerate(zip(golden["tokens"], golden["lengths"]))]


def forward_section(log) -> dict:
    cache = {}

    def model(name, policy):
        if (name, policy) not in cache:
            cache[name, policy] = pytrain.load_model(FIX / f"{name}.gguf", device="cpu",
                                                     threads=THREADS, type_policy=policy)
        return cache[name, policy]

    rows, hf_vs_f64, chunks = [], [], []
    try:
        for name, golden, policy in FORWARD_ROWS:
            g = np.load(FIX / f"{golden}.npz")
            truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
            m = model(name, policy)
            e_truth, e_hf = per_sequence(m, g, truth), per_sequence(m, g, g["logprobs"])
            # the test's own function gives the same maxima
            assert abs(max(e_truth) - TQ.errors(m, g, truth)) < 1e-12
            vs_truth = vs_hf = None              # kept types: against llama.cpp, in its test
            if policy == "f32" or name.endswith("f32"):   # test_float32_logits_match_references
                hf_round = TQ.golden_gap(g["logprobs"], np.load(
                    FIX / f"{golden}-f32.f64.npz")["logprobs"], g)
                vs_truth = F32_SPREAD * max(hf_round, ulps(truth[truth > -np.inf]))
                vs_hf = TQ.golden_gap(truth, g["logprobs"], g) + vs_truth
            types = sorted({int(t.type) for t in m.weights.tensors.values()})
            rows.append(dict(file=name, golden=golden, policy=policy, chunk=dn.CHUNK,
                             vs_f64=max(e_truth), vs_hf=max(e_hf),
                             vs_f64_per_seq=e_truth, vs_hf_per_seq=e_hf,
                             bound_vs_f64=vs_truth, bound_vs_hf=vs_hf,
                             lengths=[int(n) for n in g["lengths"]],
                             loaded_types=[ggml_type_name(t) for t in types]))
            log(f"forward {name} {policy}: vs f64 {fmt(max(e_truth))}, vs HF {fmt(max(e_hf))}")
        for name, golden in (("gqa-f32", "gqa"), ("untied-f32", "untied"),
                             ("gqa-bf16", "gqa"), ("gqa-q8_0", "gqa")):
            g = np.load(FIX / f"{golden}.npz")
            truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
            e = [float(np.abs(g["logprobs"][i, :n] - truth[i, :n]).max())
                 for i, n in enumerate(g["lengths"])]
            hf_vs_f64.append(dict(file=name, golden=golden, max=max(e), per_seq=e))
        saved = dn.CHUNK
        try:
            for c in EXTRA_CHUNKS:
                dn.CHUNK = c
                for name, golden in (("gqa-f32", "gqa"), ("untied-f32", "untied")):
                    g = np.load(FIX / f"{golden}.npz")
                    truth = np.load(FIX / f"{name}.f64.npz")["logprobs"]
                    m = model(name, "auto")
                    e_truth, e_hf = per_sequence(m, g, truth), per_sequence(m, g, g["logprobs"])
                    chunks.append(dict(file=name, chunk=c, vs_f64=max(e_truth), vs_hf=max(e_hf),
                                       vs_f64_per_seq=e_truth, vs_hf_per_seq=e_hf))
                    log(f"forward {name} CHUNK={c}: vs f64 {fmt(max(e_truth))}")
        finally:
            dn.CHUNK = saved
    finally:
        for m in cache.values():
            m.close()
    return dict(rows=rows, hf_vs_f64=hf_vs_f64, chunk_variants=chunks, committed_chunk=dn.CHUNK)


def ggml_type_name(t: int) -> str:
    from pytrain import ggml
    return {v: k for k, v in ggml.TYPES.items()}.get(t, str(t)).upper()


# ---------------------------------------------------------------- DeltaNet ops (test_delta_net)

def delta_net_section(log) -> dict:
    rule, conv = [], []
    for T, Hk in params_of(TD.test_gated_delta_rule_matches_fused_op):
        # the body of test_gated_delta_rule_matches_fused_op
        rng = np.random.default_rng(T)
        B, H, S = 2, 2, 16
        q, k, v, g, beta = TD.random_gdn(rng, B, T, H, S, Hk)
        Tp = dn.padded_length(T)
        C = dn.chunk_size(Tp)
        seg = np.zeros((B, Tp), np.int64)
        build, extra = TD.build_ours(C, B, seg)
        pt = lambda a: TD.f32(TD.pad_time(a, Tp))  # noqa: E731
        ours = run_graph(build, {**dict(q=pt(q), k=pt(k), v=pt(v), g=pt(g), beta=pt(beta)),
                                 **extra})[:, :T]
        ref_fused = TD.fused(q, k, v, g, beta)
        qr, kr = (np.tile(a, (1, 1, H // Hk, 1)) for a in (q, k))
        ref64 = delta_ref.gated_delta_rule(qr, kr, v, g, beta)
        rule.append(dict(T=T, Hk=Hk, chunk=C, ours_vs_fused=float(np.abs(ours - ref_fused).max()),
                         ours_vs_f64=float(np.abs(ours - ref64).max()),
                         fused_vs_f64=float(np.abs(ref_fused - ref64).max()),
                         out_scale=float(np.abs(ref64).max()), bound=DELTA_ATOL))
        log(f"delta rule T={T} Hk={Hk}: vs fused {fmt(rule[-1]['ours_vs_fused'])}")
    for (T,) in params_of(TD.test_causal_conv_matches_ssm_conv):
        # the body of test_causal_conv_matches_ssm_conv
        rng = np.random.default_rng(T)
        B, Ch, K = 2, 24, 4
        x = rng.normal(size=(B, T, Ch))
        w = rng.normal(size=(Ch, K))
        seg = np.zeros((B, T), np.int64)
        got = run_graph(lambda ctx, t: dn.causal_conv(ctx, t["x"], t["w"], t["zeros"], t["keep"]),
                        dict(x=TD.f32(x), w=TD.f32(w),
                             zeros=np.zeros((B, T + K - 1, Ch), np.float32),
                             keep=TD.conv_keep(seg, K)))

        def fused_conv(ctx, t):
            xt = TD.lib.ggml_cont(ctx, TD.lib.ggml_transpose(ctx, t["xpad"]))
            return TD.lib.ggml_ssm_conv(ctx, xt, t["w"])
        xpad = np.concatenate([np.zeros((B, K - 1, Ch)), x], axis=1)
        ref_fused = run_graph(fused_conv, dict(xpad=TD.f32(xpad), w=TD.f32(w)))
        ref64 = delta_ref.causal_conv(x, w)
        conv.append(dict(T=T, ours_vs_fused=float(np.abs(got - ref_fused).max()),
                         ours_vs_f64=float(np.abs(got.reshape(ref64.shape) - ref64).max()),
                         fused_vs_f64=float(np.abs(ref_fused.reshape(ref64.shape) - ref64).max()),
                         out_scale=float(np.abs(ref64).max()), bound=CONV_ATOL))
        log(f"causal conv T={T}: vs fused {fmt(conv[-1]['ours_vs_fused'])}")
    return dict(delta_rule=rule, causal_conv=conv)


# ---------------------------------------------------------------- PEFT (test_peft_parity)

def peft_one(model, golden, width) -> dict:
    """The `result` fixture of test_peft_parity, then every comparison its tests make."""
    from pytrain.train import loss as L
    from pytrain.models import lora
    from pytrain.train.graphs import GradGraph
    from pytrain.models.lora_targets import select_targets

    names = select_targets(model.config)
    ad = lora.create(model.runtime, model.config, names, rank=TP.RANK, alpha=TP.ALPHA, seed=0)
    ad.set({k: golden[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
    tokens, labels = golden["input_ids"], golden["labels"]
    seg = np.where(golden["attention_mask"] > 0, 0, -1)
    tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
    g = GradGraph(model, ad, B=tokens.shape[0], T=width)
    out = g.run(tokens, seg, tgt)
    g.close()

    loss64, loss32 = float(golden["loss64"]), float(golden["loss"])
    tensors = {}
    for n in names:
        for s in (".lora_a", ".lora_b"):
            exact = golden[n + s + ".grad64"].astype(np.float64)
            peft = golden[n + s + ".grad"].astype(np.float64)
            ours = out["grads"][n + s].astype(np.float64)
            sc32, sc64 = np.abs(peft).max(), np.abs(exact).max()
            e32 = float(np.abs(ours - peft).max() / sc32)         # test_lora_gradients_match_peft
            e64 = float(np.abs(ours - exact).max() / sc64)
            e_peft = float(np.abs(peft - exact).max() / sc64)     # test_peft_float32_rounding...
            gap, rounding = (ours - peft).ravel(), (exact - peft).ravel()
            cos = float(gap @ rounding / (np.linalg.norm(gap) * np.linalg.norm(rounding)))
            tensors[n + s] = dict(vs_peft_f32=e32, vs_peft_f64=e64, peft_f32_vs_f64=e_peft,
                                  ratio_to_peft_f32=e64 / e_peft, cos_gap_rounding=cos,
                                  f32_gap_in_peft_roundings=e32 * sc32 / sc64 / e_peft)

    def worst(key, layer=None):
        items = {k: v[key] for k, v in tensors.items()
                 if layer is None or k.startswith(f"blk.{layer}.")}
        k = max(items, key=items.get)
        return dict(value=items[k], tensor=k)

    return dict(width=width, padded_width=int(g.T), chunk=dn.chunk_size(int(g.T)),
                loss=out["loss"], loss_peft_f32=loss32, loss_peft_f64=loss64,
                loss_vs_peft_f32=abs(out["loss"] - loss32), loss_vs_peft_f64=abs(out["loss"] - loss64),
                peft_f32_loss_vs_f64=abs(loss32 - loss64), n_valid=int(out["n_valid"]),
                worst={key: {"all": worst(key), "layer1": worst(key, 1), "layer3": worst(key, 3)}
                       for key in ("vs_peft_f32", "vs_peft_f64", "peft_f32_vs_f64",
                                   "ratio_to_peft_f32", "f32_gap_in_peft_roundings")},
                cos_layer1_min=min(v["cos_gap_rounding"] for k, v in tensors.items()
                                   if k.startswith("blk.1.")),
                tensors=tensors)


def peft_section(log) -> dict:
    golden = dict(np.load(FIX / "peft_grads.npz"))
    model = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=THREADS)
    runs = []
    try:
        for w in PEFT_WIDTHS:
            runs.append(peft_one(model, golden, w))
            r = runs[-1]
            log(f"peft width {w}: loss vs f32 {fmt(r['loss_vs_peft_f32'])} f64 "
                f"{fmt(r['loss_vs_peft_f64'])}; grad vs f32 {fmt(r['worst']['vs_peft_f32']['all']['value'])}"
                f" f64 {fmt(r['worst']['vs_peft_f64']['all']['value'])}")
        saved = dn.CHUNK
        try:
            dn.CHUNK = 64                      # width 64 as one chunk, as before commit 47de06b
            r = peft_one(model, golden, 64)
            r["note"] = "delta_net.CHUNK = 64 (diagnostic, not a test case)"
            runs.append(r)
            log(f"peft width 64 CHUNK=64: grad vs f64 {fmt(r['worst']['vs_peft_f64']['all']['value'])}")
        finally:
            dn.CHUNK = saved
    finally:
        model.close()
    # the tests' bounds: these multiples of PEFT float32's own rounding (tests/test_peft_parity.py)
    return dict(runs=runs, spread=dict(TP.SPREAD), rank=TP.RANK, alpha=TP.ALPHA)


# ---------------------------------------------------------------- llama.cpp (test_llama_cpp_adapter)

def llama_section(log) -> dict:
    from llama_cpp_check import built_binary, llama_cpp_compatible, run_llama
    exe = built_binary()
    if exe is None:
        log("llama.cpp: not built (python scripts/build_llama_cpp.py); not run")
        return dict(run=False, reason="scripts/llama_logits not built "
                                      "(python scripts/build_llama_cpp.py)")
    import test_llama_cpp_adapter as TL
    from scripts.gguf_models import quantized_copy
    from pytrain.models import lora
    from pytrain.formats.adapter_gguf import check_adapter_matches, write_lora_gguf
    from pytrain.models.lora_targets import select_targets

    test_fn = TL.test_llama_cpp_loads_adapter_and_matches_pytrain
    fixtures = [a[0] for a in params_of(test_fn, "fixture")]
    test_T = [a[0] for a in params_of(test_fn, "T")]
    cases = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for fixture in fixtures:
            for T in list(test_T) + list(LLAMA_EXTRA_T):
                d = tmp / f"{fixture}-{T}"
                d.mkdir()
                cases.append(dict(fixture=fixture, T=T, in_test=T in test_T,
                                  **llama_one(exe, FIX / fixture, d, T, TL, lora, select_targets,
                                              check_adapter_matches, write_lora_gguf,
                                              llama_cpp_compatible, run_llama)))
                log(f"llama.cpp {fixture} T={T}: base {fmt(cases[-1]['base'])}, "
                    f"adapter {fmt(cases[-1]['with_adapter'])}")
        # test_llama_cpp_keeps_weights_out_of_extra_buffer_types, second half (Q4_0)
        d = tmp / "q4_0"
        d.mkdir()
        compat = llama_cpp_compatible(FIX / "gqa-f32.gguf", d)
        q4 = quantized_copy(compat, FIX / "gqa-q8_0.gguf", d / "gqa-q4_0.gguf", "q4_0")
        cases.append(dict(fixture="gqa-q4_0 (quantized_copy of gqa-f32)", T=40, in_test=True,
                          **llama_one(exe, q4, d, 40, TL, lora, select_targets,
                                      check_adapter_matches, write_lora_gguf, None, run_llama,
                                      seed_a=0)))
        log(f"llama.cpp Q4_0 T=40: base {fmt(cases[-1]['base'])}")
    return dict(run=True, exe=str(exe), atol=TL.ATOL, min_effect=TL.MIN_EFFECT, cases=cases)


def llama_one(exe, fixture, tmp, T, TL, lora, select_targets, check_adapter_matches,
              write_lora_gguf, compatible, run_llama, seed_a=0) -> dict:
    """test_llama_cpp_loads_adapter_and_matches_pytrain's body (``compatible`` None: the file
    is already llama.cpp-compatible, as the Q4_0 copy)."""
    path = compatible(fixture, tmp) if compatible else fixture
    m = pytrain.load_model(path, device="cpu", threads=THREADS)
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8,
                         seed=seed_a)
        rng = np.random.default_rng(1)
        vals = ad.get()
        for k in vals:
            vals[k] = rng.normal(0, 0.3, vals[k].shape).astype(np.float32)
        ad.set(vals)
        tensors = ad.get()
        check_adapter_matches(m.config, tensors)
        arch = m.metadata["general.architecture"]
        adapter_file = write_lora_gguf(tmp / "adapter.gguf", arch, ad.alpha, tensors,
                                       {"general.name": f"parity {Path(fixture).name}"})
        toks = TL.tokens_for(m.config.n_vocab, T)
        ours_base = m.logits(toks)
        ours_lora = m.logits(toks, lora=ad.hook)
    finally:
        m.close()
    V = ours_base.shape[-1]
    cpp_base = run_llama(exe, path, None, toks, tmp / "base.f32", V)
    cpp_lora = run_llama(exe, path, adapter_file, toks, tmp / "lora.f32", V)
    return dict(base=float(np.abs(cpp_base - ours_base).max()),
                with_adapter=float(np.abs(cpp_lora - ours_lora).max()),
                effect=float(np.abs(cpp_lora - cpp_base).max()),
                logit_scale=float(np.abs(ours_lora).max()))


# ---------------------------------------------------------------- report

def git(*args) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def header(cmd: str, elapsed: dict) -> dict:
    from pytrain import ggml
    facts = machine_facts()
    dirty = [line[3:] for line in subprocess.run(
        ["git", "status", "--porcelain", "--", *INPUTS], capture_output=True, text=True,
        cwd=REPO).stdout.splitlines()]
    return dict(command=cmd, date=time.strftime("%Y-%m-%d %H:%M %Z"),
                commit=git("rev-parse", "--short", "HEAD"), uncommitted_code_changes=dirty,
                cpu=facts["cpu"], cores=os.cpu_count(), mem=facts["mem"], ggml=facts["ggml"],
                cpu_features=ggml.cpu_features(),
                python=platform.python_version(), threads=THREADS, seconds=elapsed)


def markdown(res: dict) -> str:
    h = res["header"]
    L = ["# Parity: pytrain against references it did not write", "",
         f"Made by `{h['command']}` (see its docstring: each figure is computed as the named test "
         "computes it, from the tests' own helpers and parameters).", "",
         f"- date: {h['date']}; pytrain commit {h['commit']}"
         + (f" (uncommitted changes in: {', '.join(h['uncommitted_code_changes'])})"
            if h["uncommitted_code_changes"] else ""),
         f"- CPU: {h['cpu']}, {h['cores']} cores visible, {h['mem']} RAM; ggml threads {h['threads']}",
         f"- ggml {h['ggml']}; python {h['python']}",
         f"- ggml-cpu features: {', '.join(h['cpu_features'])}. The float32 figures (not the "
         "bounds) depend on the CPU and the ggml build (GGML_NATIVE picks the SIMD kernels, "
         "GGML_LLAMAFILE the F32 matmul): they are rounding, reproducible on one build, "
         "not across machines.",
         "- seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in h["seconds"].items()), ""]

    fw = res["forward"]
    L += ["## Forward: max |Δ log-softmax| (tests/test_qwen35_parity.py)", "",
          "Over the 5 golden sequences (lengths 1, 7, 33, 64, 100) of each fixture, each run alone. "
          "float64 = the numpy forward over the file's own (dequantized) weights "
          "(`<file>.f64.npz`); HF = transformers `Qwen3_5ForCausalLM` float32 of the model the "
          f"F32 file was converted from (`<model>.npz`). DeltaNet chunk {fw['committed_chunk']} "
          "unless stated.", "",
          "| check | file | loading (weight types) | vs float64 | bound | vs HF float32 | bound |",
          "|---|---|---|---|---|---|---|"]
    for r in fw["rows"]:
        what = ("F32 GGUF" if r["file"].endswith("f32") else
                "BF16 / Q8_0 GGUF loaded as F32" if r["policy"] == "f32" else
                "BF16 / Q8_0 GGUF, default loading")
        L.append(f"| {what} | {r['file']} | {r['policy']} ({'/'.join(r['loaded_types'])}) | "
                 f"{fmt(r['vs_f64'])} | {fmt(r['bound_vs_f64'])} | {fmt(r['vs_hf'])} | "
                 f"{fmt(r['bound_vs_hf'])} |")
    for r in fw["chunk_variants"]:
        L.append(f"| F32 GGUF, DeltaNet chunks of {r['chunk']} (delta_net.CHUNK patched) | "
                 f"{r['file']} | auto | {fmt(r['vs_f64'])} | - | {fmt(r['vs_hf'])} | - |")
    for r in fw["hf_vs_f64"]:
        L.append(f"| HF float32 itself vs float64 of {r['file']}'s weights | {r['golden']}.npz | - | "
                 f"{fmt(r['max'])} | - | - | - |")
    L += ["", "Per sequence (lengths " + ", ".join(map(str, fw["rows"][0]["lengths"]))
          + "), vs float64:", ""]
    for r in fw["rows"] + fw["chunk_variants"]:
        tag = f"{r['file']} {r.get('policy', 'auto')} chunk {r['chunk']}"
        L.append(f"- {tag}: " + ", ".join(fmt(x) for x in r["vs_f64_per_seq"]))

    dnr = res["delta_net"]
    L += ["", "## DeltaNet ops vs ggml's fused ops: max |Δ| (tests/test_delta_net.py)", "",
          "Random inputs as in the tests (B 2, 2 value heads of 16; conv 24 channels, kernel 4); "
          "float64 = the token-by-token references in tests/delta_ref.py.", "",
          "| op | case | ours vs fused | ours vs float64 | fused vs float64 | bound | output scale |",
          "|---|---|---|---|---|---|---|"]
    for r in dnr["delta_rule"]:
        L.append(f"| chunked gated delta rule vs GATED_DELTA_NET | T {r['T']}, key heads {r['Hk']}, "
                 f"chunk {r['chunk']} | {fmt(r['ours_vs_fused'])} | {fmt(r['ours_vs_f64'])} | "
                 f"{fmt(r['fused_vs_f64'])} | {fmt(r['bound'])} | {fmt(r['out_scale'])} |")
    for r in dnr["causal_conv"]:
        L.append(f"| causal conv vs SSM_CONV | T {r['T']} | {fmt(r['ours_vs_fused'])} | "
                 f"{fmt(r['ours_vs_f64'])} | {fmt(r['fused_vs_f64'])} | {fmt(r['bound'])} | "
                 f"{fmt(r['out_scale'])} |")

    pf = res["peft"]
    L += ["", "## LoRA loss and gradients vs HF + PEFT (tests/test_peft_parity.py)", "",
          f"gqa-f32, r={pf['rank']}, alpha={pf['alpha']} on q/k/v/o of layers 1 and 3; padded, "
          "prompt-masked batch of 3 (30 targets). Gradient error = per tensor max |error| / "
          "max |reference|, worst tensor (and worst per layer). PEFT f64 = the same HF+PEFT run in "
          "float64 on the GGUF's exact weights.", "",
          "| check | width (chunk) | loss |error| | bound | worst grad error | tensor | layer 1 / layer 3 | bound |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in pf["runs"]:
        wc = f"{r['width']} ({r['chunk']}{', patched' if 'note' in r else ''})"
        for key, ref, lk in (("vs_peft_f32", "f32", "loss_vs_peft_f32"),
                             ("vs_peft_f64", "f64", "loss_vs_peft_f64")):
            w = r["worst"][key]
            k = pf["spread"][ref]
            L.append(f"| pytrain vs PEFT {ref} | {wc} | {fmt(r[lk])} | "
                     f"{fmt(k * r['peft_f32_loss_vs_f64'])} ({k:g}x PEFT f32's rounding) | "
                     f"{fmt(w['all']['value'])} | {w['all']['tensor']} | "
                     f"{fmt(w['layer1']['value'])} / {fmt(w['layer3']['value'])} | "
                     f"{k:g}x PEFT f32's rounding of each tensor |")
        rt = r["worst"]["ratio_to_peft_f32"]
        L.append(f"| pytrain err / PEFT f32 err (both vs f64) | {wc} | - | - | "
                 f"{fmt(rt['all']['value'])} | {rt['all']['tensor']} | "
                 f"{fmt(rt['layer1']['value'])} / {fmt(rt['layer3']['value'])} | 2 (layer 1: 0.5) |")
    r0 = pf["runs"][0]
    w = r0["worst"]["peft_f32_vs_f64"]
    L.append(f"| PEFT f32 vs PEFT f64 | - | {fmt(r0['peft_f32_loss_vs_f64'])} | - | "
             f"{fmt(w['all']['value'])} | {w['all']['tensor']} | "
             f"{fmt(w['layer1']['value'])} / {fmt(w['layer3']['value'])} | - |")
    L.append("")
    L.append("cos(pytrain - PEFT f32, PEFT's rounding) on layer 1, min over tensors: "
             + ", ".join(f"width {r['width']}{' chunk 64' if 'note' in r else ''} "
                         f"{r['cos_layer1_min']:.4f}" for r in pf["runs"]) + " (bound > 0.99).")
    L += ["", "Per tensor, pytrain vs PEFT f64 (width 20 / 64 / 64 with chunks of 64):", ""]
    for k in r0["tensors"]:
        L.append(f"- {k}: " + " / ".join(fmt(r["tensors"][k]["vs_peft_f64"]) for r in pf["runs"])
                 + f" (PEFT f32: {fmt(r0['tensors'][k]['peft_f32_vs_f64'])})")

    ll = res["llama_cpp"]
    L += ["", "## llama.cpp logits vs pytrain: max |Δ logits| (tests/test_llama_cpp_adapter.py)", ""]
    if not ll["run"]:
        L.append(f"not run: {ll['reason']}.")
    else:
        L += ["llama.cpp (`scripts/llama_logits`, pinned source, 2 threads, extra buffer types off) "
              "on the llama.cpp-compatible copy of each fixture; rank-4 alpha-8 adapter with "
              "A, B ~ N(0, 0.3) on q/k/v/o of the attention layers; tokens "
              "`tokens_for(n_vocab, T)`. Effect = max |llama.cpp with adapter - without|.", "",
              "| model | T | in test | base | with adapter | bound | adapter effect (min) | logit scale |",
              "|---|---|---|---|---|---|---|---|"]
        for c in ll["cases"]:
            L.append(f"| {c['fixture']} | {c['T']} | {'yes' if c['in_test'] else 'no'} | "
                     f"{fmt(c['base'])} | {fmt(c['with_adapter'])} | {fmt(ll['atol'])} | "
                     f"{fmt(c['effect'])} ({fmt(ll['min_effect'])}) | {fmt(c['logit_scale'])} |")
    return "\n".join(L) + "\n"


def check_bounds(res: dict) -> list[str]:
    """Each measured figure that exceeds the bound its test uses."""
    bad = []
    for r in res["forward"]["rows"]:
        for k in ("vs_f64", "vs_hf"):
            if r["bound_" + k] is not None and r[k] > r["bound_" + k]:
                bad.append(f"forward {r['file']} {r['policy']} {k} {r[k]:.3g} > {r['bound_' + k]}")
    for kind in ("delta_rule", "causal_conv"):
        for r in res["delta_net"][kind]:
            for k in ("ours_vs_fused", "ours_vs_f64"):
                if r[k] > r["bound"]:
                    bad.append(f"{kind} T={r['T']} {k} {r[k]:.3g} > {r['bound']}")
    spread = res["peft"]["spread"]
    for r in res["peft"]["runs"]:
        if "note" in r:
            continue
        for ref, ratio in (("f32", "f32_gap_in_peft_roundings"), ("f64", "ratio_to_peft_f32")):
            if r[f"loss_vs_peft_{ref}"] > spread[ref] * r["peft_f32_loss_vs_f64"]:
                bad.append(f"peft width {r['width']} loss vs {ref}")
            if r["worst"][ratio]["all"]["value"] > spread[ref]:
                bad.append(f"peft width {r['width']} grad vs {ref}")
    if res["llama_cpp"]["run"]:
        for c in res["llama_cpp"]["cases"]:
            if c["in_test"] and max(c["base"], c["with_adapter"]) >= res["llama_cpp"]["atol"]:
                bad.append(f"llama.cpp {c['fixture']} T={c['T']}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(REPO / "bench_results"))
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparisons")
    a = ap.parse_args(argv)
    cmd = " ".join([".venv/bin/python", "scripts/report_parity.py", *sys.argv[1:]])

    def log(msg):
        print(msg, flush=True)

    res, elapsed = {}, {}
    sections = [("forward", forward_section), ("delta_net", delta_net_section),
                ("peft", peft_section), ("llama_cpp", llama_section)]
    for name, fn in sections:
        t0 = time.perf_counter()
        if name == "llama_cpp" and a.no_llama_cpp:
            res[name] = dict(run=False, reason="--no-llama-cpp")
        else:
            res[name] = fn(log)
        elapsed[name] = time.perf_counter() - t0
    res = {"header": header(cmd, elapsed), **res}
    res["over_bound"] = check_bounds(res)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    if res["over_bound"]:
        md += "\n**Over the test's bound:** " + "; ".join(res["over_bound"]) + "\n"
    (out / "parity.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "parity.md").write_text(md)
    log(f"wrote {out / 'parity.md'} and {out / 'parity.json'}"
        + (f"; OVER BOUND: {res['over_bound']}" if res["over_bound"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
