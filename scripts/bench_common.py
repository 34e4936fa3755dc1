"""Shared code of the benchmarks (bench_forward, bench_train, bench_train_gpu, bench_memory,
bench_cpu_variants, bench_distributed): the model specs and their generation, the machine and
the clean-step loop, the training step both sides run, and report helpers.

Nothing here imports pytrain at module level: the reference interpreter (/opt/refenv) imports
this module too, to generate the models.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE_TOKENIZER = REPO / "tests" / "fixtures" / "qwen35" / "tokenizer"
DEFAULT_GGUF = REPO / "pytrain" / "assets" / "default-model.gguf"
GEN_VERSION = 1  # bump to regenerate cached models
CLEAN_OTHERS = 0.3   # cores busy with other processes above which a timed run counts as contended

# --------------------------------------------------------------------------------------------
# model specs (random Qwen3.5-shaped models made by the reference stack, cached outside git)
# --------------------------------------------------------------------------------------------

_MID = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True)
SPECS = {
    # the smallest model of this shape family (4 layers, attention at 1 and 3, vocabulary 512 =
    # the fixture tokenizer's): what tests/test_scripts_bench.py runs each benchmark on, one step
    "toy": dict(config=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=4, layer_types=["linear_attention",
                                                              "full_attention"] * 2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16,
                            tie_word_embeddings=True),
                seed=64, outtype="f32", hf_dtype="float32", batch=(1, 32), runs=1,
                desc="hidden 64, 4 layers (attn at 1, 3), 4/2 heads x 16, FFN 128, DeltaNet "
                     "2/4 x 16, vocab 512, tied: the smoke tests' model"),
    "mid": dict(config=_MID, seed=512, outtype="f32", hf_dtype="float32", batch=(2, 256), runs=5,
                desc="hidden 512, 8 layers (attn at 3, 7), 8/2 heads x 64, FFN 1536, DeltaNet "
                     "4/4 x 64, vocab 151936, tied"),
    # Qwen3.5's real vocabulary on the mid shape: the LM head and the CE dominate there
    "mid-v248k": dict(config=dict(_MID, vocab_size=248320), seed=513, outtype="f32",
                      hf_dtype="float32", batch=(2, 256), runs=5,
                      desc="the mid shape with vocab 248320 (Qwen3.5's)"),
    "2b": dict(
        config=dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144,
                    num_hidden_layers=24,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16,
                    linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True),
        seed=2048, outtype="f16", hf_dtype="float16", batch=(1, 128), runs=3, min_free_gb=10,
        desc="hidden 2048, 24 layers (attn every 4th), 8/2 heads x 256, FFN 6144, DeltaNet "
             "16/16 x 128, vocab 248320, tied"),
}


# Real models: pretrained GGUFs users start from, at the file types they come in
# (scripts/fetch_model.py fetches them under the same names, ``make real-model``).  pytrain
# trains the GGUF itself; the HF side runs on an HF folder of the same weights, dequantized from
# the GGUF once and cached beside the synthetic models (``make_real_hf``).
REAL_VERSION = 1  # bump to remake the real models' HF folders
REAL = {
    "smollm2": dict(desc="SmolLM2-135M-Instruct (llama): hidden 576, 30 layers, 9/3 heads x 64, "
                         "FFN 1536, vocab 49152, tied"),
    "gemma3-270m": dict(desc="Gemma 3 270M, the base model (gemma3): hidden 640, 18 layers "
                             "(every 6th full attention, the others a 512-token sliding window), "
                             "4/1 heads x 256, FFN 2048, vocab 262144, tied"),
}


def spec_dir(cache: Path, name: str) -> Path:
    if name in REAL:
        return real_dir(cache, name)
    spec = {k: v for k, v in SPECS[name].items() if k in ("config", "seed", "outtype", "hf_dtype")}
    h = hashlib.sha256(json.dumps([GEN_VERSION, spec], sort_keys=True).encode()).hexdigest()[:10]
    return cache / f"{name}-{h}"


def real_gguf(name: str) -> Path | None:
    """The fetched GGUF of REAL[name] (complete, of the current pin), or None."""
    from scripts import fetch_model
    return fetch_model.fetched(name)


def real_dir(cache: Path, name: str) -> Path:
    """The cache folder of a real model's HF side, named by the pinned GGUF's sha256: a new pin
    gets a new folder instead of a stale one."""
    from scripts import fetch_model
    sha = fetch_model.MODELS[name].gguf_sha256
    h = hashlib.sha256(json.dumps([REAL_VERSION, sha]).encode()).hexdigest()[:10]
    return cache / f"{name}-{h}"


def gguf_types(path: Path) -> tuple[str, dict[str, int]]:
    """(llama.cpp's ``general.file_type`` name, e.g. MOSTLY_Q4_K_M, {tensor type: count}) of a
    GGUF: what a report says the file is."""
    import gguf
    r = gguf.GGUFReader(path)
    f = r.fields.get("general.file_type")
    ft = gguf.LlamaFileType(int(f.contents())).name if f is not None else "?"
    counts: dict[str, int] = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return ft, dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def make_real_hf(name: str, out: Path) -> None:
    """The HF folder of a real model in ``out`` (reference stack): transformers' own GGUF
    loading (``from_pretrained(gguf_file=...)``, every weight unpacked: ``dequantize=True``)
    dequantizes each tensor with the gguf package's ``dequantize`` and undoes the converter's
    changes (llama's q/k row permutation, Gemma's norm weight + 1), saved float32 so that no
    value is rounded again.  A parameter the GGUF did not fill (left at its random init) or
    one not unpacked to float32 fails the run: the HF side must train the file's weights."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    torch.set_num_threads(2)
    path = real_gguf(name)
    if path is None:
        raise SystemExit(f"[{name}] not fetched: python -m scripts.fetch_model {name}")
    t0 = time.time()
    model, info = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True,
        quantization_config=GgufConfig(dequantize=True))
    unfilled = [k for k in info["missing_keys"]
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    odd = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
    if unfilled or odd:
        raise SystemExit(f"[{name}] not the GGUF's weights as float32: unfilled {unfilled[:5]}, "
                         f"other dtypes {odd}")
    # the model is a plain float32 one now; transformers still marks it as GGUF-quantized,
    # and refuses to save such a model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    n_params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "hf")
    print(f"[{name}] {path.name} dequantized into {out / 'hf'} (float32, "
          f"{n_params / 1e6:.1f} M parameters) in {time.time() - t0:.0f} s", flush=True)
    (out / "done.json").write_text(json.dumps({
        "n_params": n_params, "vocab": int(model.config.vocab_size),
        "model_type": model.config.model_type}))


def make_model(name: str, out: Path) -> None:
    """HF checkpoint + GGUF of a random model of SPECS[name] in ``out`` (reference stack); for
    a REAL model, its HF folder (``make_real_hf``)."""
    if name in REAL:
        return make_real_hf(name, out)
    from scripts import qwen35_reference as ref
    import torch
    torch.set_num_threads(2)
    spec = SPECS[name]
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    if FIXTURE_TOKENIZER.joinpath("tokenizer.json").exists():
        tok_dir.mkdir(exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(FIXTURE_TOKENIZER / f, tok_dir / f)
    else:  # the same recipe as scripts/make_qwen35_fixtures.py
        ref.save_tokenizer_dir(ref.train_tokenizer(
            ref.english_corpus(seed=2024, n_paragraphs=3000), 512), tok_dir)
    eos_id = ref.load_hf_tokenizer(tok_dir).convert_tokens_to_ids(ref.EOS_TOKEN)
    t0 = time.time()
    model = ref.build_model(ref.qwen35_text_config(eos_token_id=eos_id, **spec["config"]),
                            spec["seed"])
    ref.randomize_weights(model, spec["seed"])
    n_params = sum(p.numel() for p in model.parameters())
    if spec["hf_dtype"] != "float32":
        model = model.to(getattr(torch, spec["hf_dtype"]))
    print(f"[{name}] built {n_params / 1e6:.1f} M parameters in {time.time() - t0:.0f} s",
          flush=True)
    hf_dir = out / "hf"
    ref.save_hf_checkpoint(model, tok_dir, hf_dir)
    del model
    t0 = time.time()
    gguf = ref.convert_to_gguf(hf_dir, out / f"model-{spec['outtype']}.gguf", spec["outtype"])
    print(f"[{name}] converted to {gguf.name} ({gguf.stat().st_size / 2**30:.2f} GiB) in "
          f"{time.time() - t0:.0f} s", flush=True)
    (out / "done.json").write_text(json.dumps({"n_params": n_params, "gguf": gguf.name}))


def ensure_model(name: str, cache: Path, ref_python: str, script: str) -> Path | None:
    """The cache folder of SPECS[name] (or of REAL[name]: its HF folder), generated first (by
    ``python -m scripts.SCRIPT --make NAME --into DIR`` under the reference interpreter) when
    absent; None when that fails, the disk has too little room or a real model's GGUF was not
    fetched."""
    d = spec_dir(cache, name)
    if (d / "done.json").exists():
        return d
    if name in REAL and real_gguf(name) is None:
        print(f"[{name}] skipped: not fetched (python -m scripts.fetch_model "
              f"{name}; make real-model)", flush=True)
        return None
    need = {**REAL, **SPECS}[name].get("min_free_gb", 2)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free / 2**30
    if free < need:
        print(f"[{name}] skipped: {free:.1f} GiB free under {cache}, need {need}", flush=True)
        return None
    print(f"[{name}] generating into {d} ...", flush=True)
    r = subprocess.run([ref_python, "-m", f"scripts.{script}", "--make", name, "--into", str(d)],
                       cwd=str(REPO))
    if r.returncode != 0:
        print(f"[{name}] skipped: generation failed (exit {r.returncode})", flush=True)
        return None
    return d


# --------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------

def proc_status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, user+system jiffies of this process)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(f) - f[3] - (f[4] if len(f) > 4 else 0)   # all but idle and iowait
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12])


def machine_busy(seconds: float = 2.0) -> float:
    """CPU cores kept busy by other processes than this one over the next ``seconds``."""
    b0, o0 = cpu_jiffies()
    time.sleep(seconds)
    b1, o1 = cpu_jiffies()
    return max(0.0, (b1 - b0) - (o1 - o0)) / os.sysconf("SC_CLK_TCK") / seconds


def wait_quiet(max_wait: float, threshold: float = 0.3, sample: float = 2.0) -> float:
    """Wait (up to ``max_wait`` s) until other processes keep < ``threshold`` cores busy."""
    t0 = time.time()
    busy = machine_busy(sample)
    while busy >= threshold and time.time() - t0 < max_wait:
        busy = machine_busy(sample)
    return busy


def timed(fn) -> tuple[object, float, float, float]:
    """``fn()``'s result, wall seconds, the cores other processes kept busy meanwhile and the
    cores this process used."""
    hz = os.sysconf("SC_CLK_TCK")
    j0, t0 = cpu_jiffies(), time.perf_counter()
    r = fn()
    j1, t1 = cpu_jiffies(), time.perf_counter()
    dt = t1 - t0
    return (r, dt, max(0.0, ((j1[0] - j0[0]) - (j1[1] - j0[1])) / hz / dt),
            (j1[1] - j0[1]) / hz / dt)


def clean_loop(step, runs: int, threads: int):
    """Timed steps until ``runs`` clean ones are in or 3x runs were run.  A step is clean when
    other processes kept fewer than CLEAN_OTHERS cores busy beyond the cores this side leaves
    free (a 1-thread run on 2 cores does not mind one busy core).  Returns (stats, what each
    step returned, the indices of the steps the median is over)."""
    limit = CLEAN_OTHERS + max(0, len(os.sched_getaffinity(0)) - threads)
    times, others, own, extra = [], [], [], []
    while sum(o < limit for o in others) < runs and len(times) < 3 * runs:
        e, dt, oth, mine = timed(step)
        times.append(dt)
        others.append(oth)
        own.append(mine)
        extra.append(e)
    clean = [i for i, o in enumerate(others) if o < limit]
    use = clean or list(range(len(times)))
    return dict(times=times, others=others, n_clean=len(clean),
                median_s=statistics.median(times[i] for i in use), best_s=min(times),
                others_cores=statistics.mean(others), own_cores=statistics.mean(own)), extra, use


def renice(nice: int) -> None:
    """Niceness only weighs within a scheduler autogroup (one per session): the worker runs in
    a session of its own (the orchestrator starts it so) and sets that autogroup's niceness."""
    if nice:
        os.nice(nice)
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
        except OSError:
            pass


def machine_facts() -> dict:
    """CPU model, RAM, pytrain commit and the ggml build (with its CMake options from
    build_info.json) for a report header."""
    cpu, mem = platform.processor() or "?", "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    ggml_v = "?"
    bi = REPO / "pytrain" / "_native" / "build_info.json"
    if bi.exists():
        j = json.loads(bi.read_text())
        ggml_v = f"{j.get('ggml_version')} ({j.get('archive_project')}, cuda={j.get('cuda')})"
        opts = [o[2:] for o in j.get("options", []) if o.startswith("-DGGML_")]
        if opts:
            ggml_v += ", " + ", ".join(sorted(opts))
    return {"cpu": cpu, "mem": mem, "commit": git_commit(), "ggml": ggml_v}


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=str(REPO)).stdout.strip() or "?"


def dirty(*paths: str) -> list[str]:
    """Files with uncommitted changes under ``paths``."""
    out = subprocess.run(["git", "status", "--porcelain", "--", *paths], capture_output=True,
                         text=True, cwd=str(REPO)).stdout
    return sorted({ln[3:] for ln in out.split("\n") if ln.strip()})


def command_line(script: str, argv: list[str] | None = None) -> str:
    """This run's command line (``python -m scripts.SCRIPT ...``), --note texts elided."""
    args, skip = [], False
    for x in sys.argv[1:] if argv is None else argv:
        if skip:
            args.append("...")
        elif x.startswith("--note="):
            x = "--note=..."
        if not skip:
            args.append(x)
        skip = x == "--note"
    return " ".join(["python", "-m", f"scripts.{script}"] + args)


def fmt_gib(b) -> str:
    return f"{b / 2**30:.2f} GiB" if b is not None else "-"


class GpuMemory:
    """The device's used memory (MiB) every 100 ms from ``nvidia-smi -lms``, while a worker runs;
    nothing (None) on a machine without nvidia-smi."""

    CMD = ["nvidia-smi", "--id=0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

    def __init__(self):
        self.idle = self._once() if shutil.which("nvidia-smi") else None
        self.samples: list[int] = []
        self.proc = None

    def _once(self) -> int | None:
        try:
            return int(subprocess.check_output(self.CMD, text=True, timeout=30).split()[0])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None

    def __enter__(self):
        if self.idle is not None:
            self.proc = subprocess.Popen(self.CMD + ["-lms", "100"], stdout=subprocess.PIPE,
                                         text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append(int(line.split()[0]))
            except (ValueError, IndexError):
                pass

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def result(self) -> dict | None:
        if self.idle is None or not self.samples:
            return None
        peak = max(self.samples)
        return dict(idle_mib=self.idle, peak_mib=peak, peak_above_idle_mib=peak - self.idle,
                    n_samples=len(self.samples))


def worker_env(threads: int, **extra: str) -> dict:
    """A worker process's environment: one thread count for every library, offline HF."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", **extra)


# --------------------------------------------------------------------------------------------
# the training step both sides run
# --------------------------------------------------------------------------------------------

RANK, ALPHA, LR, MAX_NORM = 16, 32.0, 1e-4, 1.0


def make_batch(vocab: int, B: int, T: int, seed: int):
    """tokens [B, T] int64, train_mask [B, T] bool (second half of each row), seg [B, T] (0)."""
    import numpy as np
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(B, T)).astype(np.int64)
    train = np.zeros((B, T), bool)
    train[:, T // 2:] = True
    return tokens, train, np.zeros((B, T), np.int64)


def n_targets(train) -> int:
    """Targets after the shift: position t predicts t+1 when t+1 is trained."""
    return int(train[:, 1:].sum())


def pytrain_trainer(gguf, device: str, threads: int | None, recompute: str, seed: int,
                    batch: tuple[int, int], compute_type: str = "f32",
                    type_choice: list | None = None):
    """(model, trainer, target names, batch, train mask) of pytrain's side: the model loaded
    (``compute_type`` "bf16": its weight matrices as BF16, multiplied in bf16), LoRA on the
    default targets, AdamW, and the benchmark's batch.  ``type_choice`` (a list): the weights'
    types are chosen as ``pytrain train`` chooses them (``pytrain.run.type_choice``, policy auto:
    a quantized file's types dequantized where that was measured faster) and the choice's
    reason is appended; None: ``load_model``'s plain rule (what the synthetic rows ran; their
    F32 files are loaded as F32 either way)."""
    from types import SimpleNamespace

    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.models.model import load_model
    from pytrain.run.type_choice import for_training
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.trainer import Trainer
    dq = None if type_choice is None else for_training("auto", None, type_choice.append,
                                                       compute_type=compute_type)
    m = load_model(gguf, device=device, threads=threads, dequantize=dq, compute_type=compute_type)
    names = select_targets(m.config)
    ad = lora.create(m.runtime, m.config, names, RANK, ALPHA, seed=0)
    tr = Trainer(m, ad, AdamWSettings(lr=LR, max_grad_norm=MAX_NORM), recompute=recompute)
    tokens, train, seg = make_batch(m.config.n_vocab, *batch, seed)
    return m, tr, names, SimpleNamespace(tokens=tokens, seg=seg, train_mask=train), train


def step_facts(m, tr, names) -> dict:
    """What a report says about pytrain's side: weight types (file -> loaded, counted), the
    step's kind and nodes, LoRA size, backends."""
    from pytrain import ggml
    from pytrain.models.lora_targets import lora_param_count
    from pytrain.plan.profile import step_graphs, step_kind
    types: dict[str, int] = {}
    for r in getattr(m.weights, "report", {}).values():
        k = f"{r.file_type}->{r.loaded_type}" if r.file_type != r.loaded_type else str(r.loaded_type)
        types[k] = types.get(k, 0) + 1
    return dict(weight_types=types, step_graph=step_kind(tr),
                graph_nodes=sum(int(ggml.lib.ggml_graph_n_nodes(g)) for g, _ in step_graphs(tr)),
                lora_params=lora_param_count(m.config, names, RANK), lora_names=len(names),
                backends=[ggml.backend_name(b) for b in m.runtime.backends],
                blas=m.runtime.blas is not None)


def profile_pytrain(tr, batch) -> dict:
    """One step node by node (``pytrain profile``'s code), as a dict."""
    from pytrain.plan.profile import profile_step
    return profile_step(tr, [batch], LR).to_dict()


def profile_lines(title: str, p: dict, top: int = 20) -> list[str]:
    """Markdown tables of a pytrain step profile (``profile_pytrain``): by part, by op and
    backend."""
    tot = p.get("total") or sum(p["by_op"].values())
    lines = ["", f"## Profile: {title}, one step node by node (wall {p['wall']:.2f} s with the "
             f"per-node dispatch; {p['n_nodes']} nodes; node times sum {tot:.3f} s, "
             f"{p['overhead'] * 1e6:.0f} us per-node overhead taken off each)", "",
             f"Step: {p.get('step_graph', '?')}; backends {', '.join(p.get('backends', []))}.", "",
             "| part | time (s) | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.4f} | {v / tot:.1%} |" for k, v in
              sorted(p["by_part"].items(), key=lambda kv: -kv[1])]
    lines += ["", "| op [backend] | time (s) | share | nodes |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v:.4f} | {v / tot:.1%} | {p['count_op_backend'].get(k, 0)} |"
              for k, v in sorted(p["by_op_backend"].items(), key=lambda kv: -kv[1])[:top]]
    return lines


def run_result(cmd: list[str], env: dict | None = None, timeout: float | None = None,
               **kw) -> tuple[dict | None, subprocess.CompletedProcess]:
    """Run a worker; its result is the JSON of its last stdout line starting "RESULT "."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                       timeout=timeout, **kw)
    res = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
    return res, r


def hf_side(path, dtype: str, attn: str, device: str, seed: int, batch: tuple[int, int]):
    """HF + PEFT's side of the step (LoRA r 16 on q/k/v/o, AdamW, clipping) on the benchmark's
    batch: a namespace with ``one()`` (one step, returns the loss), the model, the trainable
    parameters, the labels and the library versions."""
    from types import SimpleNamespace

    import peft
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    dev = torch.device(device)
    # the checkpoint's class: Qwen3_5ForCausalLM for the synthetic shapes (qwen3_5_text),
    # LlamaForCausalLM / Gemma3ForCausalLM for the real models
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn).to(dev)
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                          bias="none", task_type="CAUSAL_LM",
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens, train, _seg = make_batch(model.config.vocab_size, *batch, seed)
    ids = torch.from_numpy(tokens).to(dev)
    labels = ids.clone()
    labels[torch.from_numpy(~train).to(dev)] = -100

    def one() -> float:
        loss = pm(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    cuda = dev.type == "cuda"
    facts = dict(tokens=batch[0] * batch[1], n_targets=int((labels[:, 1:] != -100).sum()),
                 lora_params=sum(p.numel() for p in params),
                 lora_names=sum(1 for n, _ in pm.named_modules() if n.endswith(".lora_A.default")),
                 lora_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in params}),
                 attn=model.config._attn_implementation, dtype=dtype, torch=torch.__version__,
                 transformers=transformers.__version__, peft=peft.__version__)
    return SimpleNamespace(one=one, cuda=cuda, facts=facts,
                           sync=torch.cuda.synchronize if cuda else (lambda: None))


def hf_profile(hf, top: int = 20) -> dict:
    """One HF step under torch.profiler: top ops by self device (GPU) or CPU time, as
    (name, seconds, calls)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hf.cuda else [])
    with profile(activities=acts) as prof:
        hf.sync()
        t1 = time.perf_counter()
        hf.one()
        hf.sync()
        wall = time.perf_counter() - t1
    key = "self_device_time_total" if hf.cuda else "self_cpu_time_total"
    ka = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))
    return dict(wall=wall, total_s=sum(getattr(e, key, 0) for e in ka) / 1e6, key=key,
                top=[(e.key, getattr(e, key, 0) / 1e6, int(e.count)) for e in ka[:top]])


# the torch ops a training step's matrix products end in (torch.profiler's names; aten::linear
# and aten::matmul only dispatch to these)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_linear")


def onednn_matmuls(verbose: str) -> dict[str, int]:
    """{implementation: executions} of oneDNN's matmul and inner_product primitives in its
    verbose output (``onednn_verbose,[v1,]primitive,exec,cpu,matmul,brg_matmul:...``)."""
    out: dict[str, int] = {}
    for line in verbose.splitlines():
        f = line.split(",")
        if not f or f[0] != "onednn_verbose" or "exec" not in f:
            continue
        i = f.index("exec")
        if len(f) > i + 3 and f[i + 2] in ("matmul", "inner_product"):
            out[f[i + 3]] = out.get(f[i + 3], 0) + 1
    return out


def hf_kernels(hf) -> dict:
    """Which kernels one HF step's matrix products ran on: oneDNN's matmul implementations
    (its verbose output of the step, caught at the file descriptor since oneDNN prints from C)
    and torch.profiler's matmul op counts (torch's f32 products go to its CPU BLAS, not
    oneDNN: there the op names are all there is)."""
    import ctypes
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof, \
                    torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                hf.one()
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    ops = {e.key: int(e.count) for e in prof.key_averages() if e.key in MATMUL_OPS}
    return dict(onednn=onednn_matmuls(text), aten=ops,
                blas="MKL" if torch.backends.mkl.is_available() else "torch's own")


def kernel_summary(k: dict | None) -> str:
    """One line for a report: "oneDNN brg_matmul:avx512_core_bf16 x 75; aten::mm x 96, ...
    (MKL BLAS where not oneDNN)"."""
    if not k:
        return "-"
    def fmt(d: dict) -> str:
        return ", ".join(f"{n} x {c}" for n, c in sorted(d.items(), key=lambda kv: -kv[1]))
    return (f"oneDNN {fmt(k.get('onednn') or {}) or 'none'}; {fmt(k.get('aten') or {}) or '-'} "
            f"({k.get('blas', '?')} BLAS where not oneDNN)")
