"""Training tokens/s with the frozen weights kept in the file's type against dequantized to
F32 (and F16), side by side in one run: what ``model.type_policy = "auto"``'s rule for
training runs (``pytrain/run/type_choice.py``) is measured from.  The bf16 sides do the same
under ``train.compute_type = "bf16"``: ``bf16-keep`` keeps the quantized matrices (the F32/F16
ones BF16), ``bf16`` loads them as BF16 copies too; ``type_choice.BF16_STEP_RATIO`` is copied
from their ratio (``--sides f32,bf16-keep,bf16 --name type_policy_bf16``); on a real model
whose bf16 choice (``type_choice.choose_bf16``) copies only some of its types, that choice is
measured too, as ``bf16-auto``.

Two parts:

* real models at the README's demo settings (config/demo-real.toml and demo-real-gemma3.toml:
  the demo's date chats, batch 8, max_seq_len 128, LoRA r 8 on q/k/v/o, AdamW, the config's
  threads): SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M), fetched by
  ``python -m scripts.fetch_model [gemma3-270m]``; the rows also say which side ``auto`` takes
  on this machine and how far that is from the faster one;
* a synthetic llama (scripts/gguf_models.write_llama: hidden 1024, FFN 3072, 16/4 heads of 64,
  vocabulary 32768, rows that every K-quant takes) per weight type, random tokens in full rows of the demo's
  batch shape: the per-type table ``type_choice.STEP_RATIO`` is copied from these rows.

Every side of a model is loaded at once, each in a worker process of its own (sides in one
process share OpenMP's and OpenBLAS's threads, which made a 2-thread step up to 10x slower
than alone), and the sides are stepped in turn (ABC CBA ...), so a machine shared with other
work slows all sides alike; medians over the rounds, and the ratio as the median of
each round's ratio; each step's CPU seconds (all threads) are recorded beside its wall time,
the steadier measure on a busy machine.  With ``--blas both`` the synthetic part runs with
ggml's BLAS backend and without it (PYTRAIN_BLAS=0), which the table keys apart.  The
synthetic part runs first: the real models' ``auto`` side is what this run's table makes
(printed, to paste into type_choice.py, when it differs from the committed one).

Usage:
    python -m scripts.bench_type_policy [--models smollm2,gemma3-270m] [--types F16,Q8_0,...]
        [--sides keep,f32,f16,bf16-keep,bf16] [--rounds 5] [--threads 2] [--real-threads 2,1]
        [--device cpu|cuda] [--blas on|off|both] [--size demo|smoke] [--results bench_results]
        [--note TEXT] [--name type_policy]

``--size smoke`` is the smallest run (a 2-layer synthetic model, 2 types, 2 rounds, no real
model): what tests/test_bench_type_policy.py runs so that the script keeps working.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as bc

ROOT = Path(__file__).resolve().parent.parent
REAL = {"smollm2": ("demo-real.toml", "SmolLM2-135M-Instruct", "Q4_1"),
        "gemma3-270m": ("demo-real-gemma3.toml", "Gemma 3 270M", "Q4_K_M")}
FLOATS = ("F16", "BF16")     # bf16 compute makes their matrices BF16 on either bf16 side
TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ4_NL", "IQ4_XS"]
SIZES = {   # synthetic llama shapes: demo = the table's; smoke = the smoke test's
    # the table's: matrices as wide as the small real models' (SmolLM2 576, Gemma 3 270M 640,
    # Qwen3.5-0.8B 1024) and a 32k vocabulary, at the demo's batch of 8 x 128.  A narrower
    # model (hidden 512, vocabulary 2048, 8 x 64) favoured the kept types: there BLAS's GEMMs
    # are too small to pay, and its table kept Q5_0, which Gemma 3 270M's step then ran 1.27x
    # slower than as F32 (bench_results/type_policy.md of commit eb32796)
    "demo": dict(n_layer=2, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=4, head_dim=64,
                 n_vocab=32768, batch=(8, 128)),
    "smoke": dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                  n_vocab=64, batch=(2, 32)),
}
LORA = dict(rank=8, alpha=16.0, targets=["attn_q", "attn_k", "attn_v", "attn_output"])
LR = 1e-3
SHARED = ("The sides are stepped in turn, so other work on the machine (the note says whether "
          "there was any) slows each alike: the ratios are the measure.")


# ------------------------------------------------------------------------------- one side

SIDES = ("keep", "f32", "f16", "bf16-keep", "bf16")
BF16_SIDES = ("bf16-keep", "bf16", "bf16-auto")      # train.compute_type = "bf16" (bf16-auto:
                                                     # the trainer's choice, where it is neither)


def side_types(side: str):
    """The ``dequantize`` function load_model calls for a side: every matrix type of the file
    to F32 or F16 ("keep": none; auto's support rule still applies, so BF16 is F16 on a CPU);
    under bf16 compute every quantized type to BF16 ("bf16"; the float types are BF16 under
    bf16 compute anyway) or none ("bf16-keep")."""
    from pytrain.ggml import lib
    floats = (lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16)
    target = {"keep": None, "bf16-keep": None, "f32": lib.GGML_TYPE_F32,
              "f16": lib.GGML_TYPE_F16, "bf16": lib.GGML_TYPE_BF16}[side]

    def choose(_rt, infos, shapes):
        if target is None:
            return {}
        skip = floats if side == "bf16" else (lib.GGML_TYPE_F32, target)
        return {infos[n].type: target for n in shapes if infos[n].type not in skip}
    return choose


class Side:
    """One side in this process (a worker's job): the model loaded with that side's types,
    LoRA and AdamW, and its batches; stepped on demand."""

    def __init__(self, spec: dict):
        from pytrain import ggml
        from pytrain.models import lora
        from pytrain.models.lora_targets import select_targets
        from pytrain.models.model import load_model
        from pytrain.step.optimizer import AdamWSettings
        from pytrain.step.trainer import Trainer
        names = {k.upper(): v for k, v in ggml.TYPES.items()}
        dq = spec.get("dequantize")          # file type -> target, by name (the auto side)
        self.model = load_model(spec["path"], spec["device"], spec["threads"], "auto",
                                dequantize=side_types(spec["side"]) if dq is None else
                                {names[k]: names[v] for k, v in dq.items()},
                                compute_type="bf16" if spec["side"] in BF16_SIDES else "f32")
        targets = select_targets(self.model.config, LORA["targets"])
        self.adapter = lora.create(self.model.runtime, self.model.config, targets, LORA["rank"],
                                   LORA["alpha"], seed=0)
        self.trainer = Trainer(self.model, self.adapter, AdamWSettings(lr=LR, max_grad_norm=1.0),
                               recompute="off")
        b = spec["batches"]
        if "real" in b:
            self.batches, _cfg = demo_batches(b["real"], Path(spec["path"]), Path(b["folder"]),
                                              self.model)
        else:
            from types import SimpleNamespace
            tokens, train, seg = bc.make_batch(*b["synthetic"], seed=0)
            self.batches = [SimpleNamespace(tokens=tokens, seg=seg, train_mask=train)]

    def info(self) -> dict:
        loaded: dict[str, int] = {}
        for r in self.model.weights.report.values():
            if r.file_type != "F32":
                k = r.file_type if r.file_type == r.loaded_type else f"{r.file_type}->{r.loaded_type}"
                loaded[k] = loaded.get(k, 0) + 1
        rt = self.model.runtime
        return dict(loaded=loaded, weight_bytes=self.model.weights.loaded_bytes,
                    key="cpu+blas" if rt.blas is not None else rt.device)  # type_choice's key

    def step(self, i: int) -> dict:
        c0 = time.process_time()            # this process's CPU seconds, all its threads
        r, _dt, others, _own = bc.timed(
            lambda: self.trainer.step([self.batches[i % len(self.batches)]], LR))
        return dict(seconds=r.seconds, tokens=r.tokens, cpu=time.process_time() - c0,
                    others=others)


def worker(spec: str) -> int:
    """``--worker SPEC``: one side, stepped on batch N for each line N on stdin (a JSON line of
    timings back on stdout) until "quit"."""
    out, sys.stdout = sys.stdout, sys.stderr       # stdout carries the replies only
    side = Side(json.loads(spec))
    print(json.dumps(side.info()), file=out, flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(json.dumps(side.step(int(line))), file=out, flush=True)
    side.model.close()
    return 0


class Arm:
    """One side in a process of its own, stepped on command.  Why processes: in one process
    the sides share OpenMP's and OpenBLAS's thread pools, and at 2 threads Gemma 3's kept step
    ran 10x slower between the other sides' steps (24 s) than alone (2.4 s); a worker that is
    not stepping waits on its pipe and leaves the cores to the one that is."""

    def __init__(self, spec: dict, blas: bool = True):
        self.side = spec["side"]
        env = dict(os.environ, PYTRAIN_BLAS="1" if blas else "0")
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.bench_type_policy",
                                      "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = self._read()
        self.loaded, self.weight_bytes, self.key = info["loaded"], info["weight_bytes"], info["key"]
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.others: list[float] = []
        self.cpu: list[float] = []

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.side} worker ended (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def step(self, i: int, record: bool = True) -> None:
        self.proc.stdin.write(f"{i}\n")
        self.proc.stdin.flush()
        r = self._read()
        if record:
            self.times.append(r["seconds"])
            self.tokens.append(r["tokens"])
            self.others.append(r["others"])
            self.cpu.append(r["cpu"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait(timeout=120)


def race(arms: list[Arm], rounds: int) -> dict:
    """One warm-up step per side (graph building), then ``rounds`` rounds in which every side
    steps once on the same batch, the order reversed every other round."""
    for a in arms:
        a.step(0, record=False)
    for i in range(rounds):
        for a in (arms if i % 2 == 0 else arms[::-1]):
            a.step(i)
    out = {}
    for a in arms:
        tps = [n / s for n, s in zip(a.tokens, a.times)]
        out[a.side] = dict(tokens_per_s=statistics.median(tps), step_s=statistics.median(a.times),
                           steps_s=[round(t, 4) for t in a.times], tokens=a.tokens,
                           cpu_s=statistics.median(a.cpu),
                           others_cores=round(statistics.mean(a.others), 2),
                           loaded=a.loaded, weight_bytes=a.weight_bytes)
    for a in arms:         # per round: another side's step time over this side's (> 1: this
        over = lambda b, cpu=False: statistics.median(    # one is faster than b)
            k / t for k, t in zip(*((b.cpu, a.cpu) if cpu else (b.times, a.times))))
        out[a.side]["over"] = {b.side: round(over(b), 4) for b in arms if b is not a}
        out[a.side]["over_cpu"] = {b.side: round(over(b, True), 4) for b in arms if b is not a}
        ref = "bf16-keep" if a.side == "bf16" else "keep"      # the ratios the tables hold
        if ref in out[a.side]["over"]:
            out[a.side]["keep_over_this"] = over(next(b for b in arms if b.side == ref))
            out[a.side]["keep_over_this_cpu"] = over(next(b for b in arms if b.side == ref),
                                                     True)
    return out


# ------------------------------------------------------------------------------- real models

def demo_config(name: str, path: Path, folder: Path):
    """The demo's config with its data (written once into ``folder``/NAME)."""
    from pytrain.config import load_config
    from scripts.demo_real import write_data
    data = folder / name
    if not (data / "train.jsonl").exists():
        write_data(data)
    return load_config(ROOT / "config" / REAL[name][0],
                       [f"model.path={json.dumps(str(path))}",
                        f"data.train={json.dumps(str(data / 'train.jsonl'))}",
                        f"data.validation={json.dumps(str(data / 'valid.jsonl'))}"])


def demo_batches(name: str, path: Path, folder: Path, model) -> tuple[list, object]:
    """The demo's training batches (its data, chat template and batching) and its config."""
    from pytrain.data import load_data, make_batches
    cfg = demo_config(name, path, folder)
    splits = load_data(cfg.data, model.tokenizer)
    t = cfg.train
    return make_batches(splits.train, t.batch_size, cfg.data.packing, t.seed,
                        max_seq_len=cfg.data.max_seq_len, pad_id=model.pad_id), cfg


def auto_choice(path: Path, threads: int, device: str = "cpu", compute_type: str = "f32"):
    """``auto``'s choice (``type_choice.TypeChoice``) for a training run of ``path`` on this
    machine's ``device`` under ``compute_type``, as the trainer makes it."""
    from pytrain.ggml import Runtime
    from pytrain.models.model_file import open_model
    from pytrain.run.type_choice import choose, device_key, runtime_budget
    _arch, _meta, infos, config = open_model(path)
    rt = Runtime(device, threads=threads)
    try:
        return choose(device_key(rt.device, rt.blas is not None), infos, config.tensor_shapes(),
                      "auto", *runtime_budget(rt, None), compute_type)
    finally:
        rt.close()


def auto_side(choice, matrix_types: set[str]) -> str:
    """The side ``auto`` is: keep (nothing dequantized), f32 (every matrix type) or auto (some:
    then measured as a side of its own)."""
    got = {ggml_name(t) for t in choice.dequantize}
    return "keep" if not got else "f32" if got >= matrix_types else "auto"


def ggml_name(t: int) -> str:
    from pytrain import ggml
    return ggml.type_name(t)


def bench_real(name: str, sides: list[str], rounds: int, folder: Path, log,
               threads: int = 2, device: str = "cpu") -> dict | None:
    from scripts import fetch_model
    path = fetch_model.fetched(name)
    if path is None:
        log(f"{name}: not fetched (python -m scripts.fetch_model {name}); skipped")
        return None
    cfg = demo_config(name, path, folder)
    assert cfg.model.threads == 2, "the demo configs run on 2 threads"
    choice = auto_choice(path, threads, device)
    bf16 = auto_choice(path, threads, device, "bf16") if set(sides) & set(BF16_SIDES) else None
    spec = dict(path=str(path), threads=threads, device=device,
                batches=dict(real=name, folder=str(folder)))
    arms: list[Arm] = []
    try:
        for s in sides:
            log(f"{name}: loading as {s}")
            arms.append(Arm(dict(spec, side=s)))
        auto = auto_side(choice, {k.split("->")[0] for k in arms[0].loaded}) \
            if "keep" in sides else None
        if auto == "auto":               # some types dequantized: a side of its own
            log(f"{name}: loading as auto")
            arms.append(Arm(dict(spec, side="auto", dequantize={
                ggml_name(k): ggml_name(v) for k, v in choice.dequantize.items()})))
        if bf16 is not None and bf16.dequantize and "bf16" in sides and \
                len(bf16.dequantize) < len(bf16.measured):   # bf16 copies of some types only
            log(f"{name}: loading as bf16-auto")
            arms.append(Arm(dict(spec, side="bf16-auto", dequantize={
                ggml_name(k): ggml_name(v) for k, v in bf16.dequantize.items()})))
        log(f"{name}: {rounds} rounds of {len(arms)} sides on the demo's batches, {threads} "
            f"threads")
        res = race(arms, rounds)
    finally:
        for a in arms:
            a.close()
    out = dict(model=REAL[name][1], quant=REAL[name][2], file=path.name, threads=threads,
               device=choice.device, batch_size=cfg.train.batch_size,
               max_seq_len=cfg.data.max_seq_len, sides=res, auto=auto,
               auto_reason=choice.reason)
    if auto:
        out.update(**compare(res, auto, ["keep", "f32"]),
                   **{k + "_all": v for k, v in compare(res, auto, list(res)).items()})
    if bf16 is not None:
        out.update(bf16_auto=("bf16-keep" if not bf16.dequantize else "bf16-auto"
                              if "bf16-auto" in res else "bf16"), bf16_reason=bf16.reason)
    return out


def compare(res: dict, auto: str, among: list[str]) -> dict:
    """The faster of the sides ``among`` (by median tokens/s, and by median CPU seconds) and
    ``auto``'s speed as a fraction of it."""
    among = [s for s in among if s in res]
    best = max(among, key=lambda s: res[s]["tokens_per_s"])
    best_cpu = min(among, key=lambda s: res[s]["cpu_s"])
    return dict(faster=best, faster_cpu=best_cpu,
                auto_vs_faster=res[auto]["tokens_per_s"] / res[best]["tokens_per_s"],
                auto_vs_faster_cpu=res[best_cpu]["cpu_s"] / res[auto]["cpu_s"])


# ------------------------------------------------------------------------------- synthetic

def bench_type(type_name: str, sides: list[str], size: str, rounds: int, blas: bool,
               folder: Path, threads: int, device: str = "cpu") -> dict:
    from pytrain import ggml
    from scripts.gguf_models import write_llama
    hp = dict(SIZES[size])
    B, T = hp.pop("batch")
    path = folder / f"llama-{size}-{type_name.lower()}.gguf"
    if not path.exists():
        dtype = {k.upper(): k for k in ggml.TYPES}[type_name]     # ggml's spelling: q4_K
        write_llama(path, dtype, seed=0, **hp)
    spec = dict(path=str(path), threads=threads, device=device,
                batches=dict(synthetic=[hp["n_vocab"], B, T]))
    arms: list[Arm] = []
    try:
        for s in sides:
            if not (s == "f16" and type_name == "F16" or s == "bf16" and type_name in FLOATS):
                arms.append(Arm(dict(spec, side=s), blas))
        res = race(arms, rounds)
    finally:
        for a in arms:
            a.close()
    key = arms[0].key
    return dict(type=type_name, device=key, blas=key == "cpu+blas", batch=[B, T], sides=res)


# ------------------------------------------------------------------------------- report

def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"# Training step: frozen weights kept in the file's type vs dequantized", "",
             f"Made by `{r['command']}` at commit {m['commit']}, {r['date']}, on "
             f"{r['threads']} threads of an {m['cpu']} ({m['mem']}); ggml {m['ggml']}.", "",
             r["shared_note"], ""]
    if r.get("note"):
        lines += [r["note"], ""]
    if r["real"]:
        lines += ["## Real models at the README's demo settings", "",
                  "Batch 8 of the demo's date chats (max_seq_len 128; rows as long as the "
                  "longest chat of the batch), LoRA r 8 on q/k/v/o, AdamW; ggml's BLAS backend "
                  "on a CPU.  "
                  "Tokens/s: median over the rounds; `other side / this side`: each other "
                  "side's step time over this side's, median of the rounds' ratios (> 1: this "
                  "side is faster).  bf16 sides: `train.compute_type = \"bf16\"`.", "",
                  "| model | threads | side | weights loaded | MiB | tokens/s | step s | CPU s | "
                  "other side / this side | the same, CPU s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for x in r["real"]:
            for s, v in x["sides"].items():
                loaded = ", ".join(f"{k} x{n}" for k, n in sorted(v["loaded"].items()))
                ratio = lambda k: ", ".join(f"{o} {f:.2f}" for o, f in v.get(k, {}).items())
                lines.append(f"| {x['model']} ({x['quant']}) | {x['threads']} | {s} | {loaded} | "
                             f"{v['weight_bytes'] / 2**20:.0f} | {v['tokens_per_s']:.1f} | "
                             f"{v['step_s']:.2f} | {v['cpu_s']:.2f} | {ratio('over')} "
                             f"| {ratio('over_cpu')} |")
        lines.append("")
        pct = lambda f: "-" if f is None else f"{f:.0%}"
        for x in r["real"]:
            if x.get("bf16_reason"):
                lines.append(f"- {x['model']}, {x['threads']} threads, compute bf16: the "
                             f"trainer takes **{x['bf16_auto']}** ({x['bf16_reason']}).")
            if not x["auto"]:
                continue
            lines.append(f"- {x['model']}, {x['threads']} threads: `auto` is **{x['auto']}** "
                         f"({x['auto_reason']}).  The faster of keep and f32 by wall time: "
                         f"{x['faster']} (auto's tokens/s: {pct(x['auto_vs_faster'])} of it); "
                         f"by CPU time: {x['faster_cpu']} (auto: "
                         f"{pct(x['auto_vs_faster_cpu'])} of its speed).  Of every side: "
                         f"{x['faster_all']} by wall time ({pct(x['auto_vs_faster_all'])}), "
                         f"{x['faster_cpu_all']} by CPU time "
                         f"({pct(x['auto_vs_faster_cpu_all'])}).")
        lines.append("")
    syn_bf16 = [x for x in r["synthetic"] if "bf16-keep" in x["sides"]]
    if syn_bf16:
        hp = SIZES[r["size"]]
        lines += ["## Per weight type under compute bf16 (synthetic llama)", "",
                  f"scripts/gguf_models.write_llama: {hp['n_layer']} layers, hidden "
                  f"{hp['n_embd']}, FFN {hp['n_ff']}, {hp['n_head']}/{hp['n_head_kv']} heads of "
                  f"{hp['head_dim']}, vocabulary {hp['n_vocab']}; every matrix in the type; "
                  f"random tokens, batch {hp['batch'][0]} x {hp['batch'][1]}.  `bf16-keep`: "
                  f"compute bf16 with the quantized matrices kept; `bf16`: as BF16 copies; "
                  f"`bf16-keep/bf16` > 1: the BF16 copies' step is that much faster (the "
                  f"table's figure); `f32/bf16` > 1: faster than compute f32 with F32 copies.  "
                  f"F16 and BF16 matrices are BF16 on both bf16 sides.", "",
                  "| type | f32 tok/s | bf16-keep tok/s | bf16 tok/s | bf16-keep/bf16 | "
                  "bf16-keep/bf16 CPU | f32/bf16 | f32/bf16-keep |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in syn_bf16:
            s = x["sides"]
            tps = lambda k: f"{s[k]['tokens_per_s']:.0f}" if k in s else "-"
            over = lambda k, o, cpu="": (f"{s[k]['over' + cpu][o]:.2f}"
                                         if k in s and o in s[k]["over" + cpu] else "-")
            lines.append(f"| {x['type']} | {tps('f32')} | {tps('bf16-keep')} | {tps('bf16')} | "
                         f"{over('bf16', 'bf16-keep')} | {over('bf16', 'bf16-keep', '_cpu')} | "
                         f"{over('bf16', 'f32')} | {over('bf16-keep', 'f32')} |")
        lines.append("")
    syn = [x for x in r["synthetic"] if "keep" in x["sides"]]
    if syn:
        hp = SIZES[r["size"]]
        lines += ["## Per weight type (synthetic llama)", "",
                  f"scripts/gguf_models.write_llama: {hp['n_layer']} layers, hidden "
                  f"{hp['n_embd']}, FFN {hp['n_ff']}, {hp['n_head']}/{hp['n_head_kv']} heads of "
                  f"{hp['head_dim']}, vocabulary {hp['n_vocab']}; every matrix in the type; "
                  f"random tokens, batch {hp['batch'][0]} x {hp['batch'][1]} (the second half "
                  f"of each row a target).  `keep/f32` > 1: the kept type's step is that many "
                  f"times slower than F32's.", "",
                  "| type | device | keep tok/s | f32 tok/s | f16 tok/s | keep/f32 | keep/f32 CPU "
                  "| keep/f16 | keep/f16 CPU |", "|---|---|---|---|---|---|---|---|---|"]
        for x in syn:
            s = x["sides"]
            tps = lambda k: f"{s[k]['tokens_per_s']:.0f}" if k in s else "-"
            ratio = lambda k, cpu="": (f"{s[k]['keep_over_this' + cpu]:.2f}" if k in s else "-")
            lines.append(f"| {x['type']} | {x['device']} | {tps('keep')} | "
                         f"{tps('f32')} | {tps('f16')} | {ratio('f32')} | {ratio('f32', '_cpu')} "
                         f"| {ratio('f16')} | {ratio('f16', '_cpu')} |")
        lines.append("")
    if r.get("bf16_table") and syn_bf16:
        from pytrain.run.type_choice import FASTER
        lines += ["## What compute bf16 does for a training run with these figures", "",
                  f"A quantized type becomes BF16 copies when its bf16 step kept takes at least "
                  f"{FASTER:.2f}x the step with BF16 copies and those fit in half the memory "
                  f"budget; this run's table "
                  + ("is" if r.get("bf16_table_is_committed") else "is NOT")
                  + " the one pytrain/run/type_choice.py holds (BF16_STEP_RATIO).", ""]
        for key, row in r["bf16_table"].items():
            to = [k for k, v in row.items() if v >= FASTER]
            kept = [k for k, v in row.items() if v < FASTER]
            lines.append(f"- {key}: to BF16: {', '.join(to) or 'none'}; kept: "
                         f"{', '.join(kept) or 'none'}")
        lines.append("")
    if r.get("table") and syn:
        from pytrain.run.type_choice import FASTER
        lines += ["## What `auto` does for a training run with these figures", "",
                  f"A type is dequantized when its kept step takes at least {FASTER:.2f}x the "
                  f"F32 one (F16 when only that fits half the memory budget and is "
                  f"{FASTER:.2f}x faster than kept); this run's table "
                  + ("is" if r.get("table_is_committed") else "is NOT")
                  + " the one pytrain/run/type_choice.py holds.", ""]
        for key, row in r["table"].items():
            f32 = [k for k, v in row.items() if v[0] >= FASTER]
            kept = [k for k, v in row.items() if v[0] < FASTER]
            lines.append(f"- {key}: to F32: {', '.join(f32) or 'none'}; kept: "
                         f"{', '.join(kept) or 'none'}")
        lines.append("")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m",
                    help="real models, comma-separated (smollm2, gemma3-270m; '' for none)")
    ap.add_argument("--types", default=",".join(TYPES),
                    help="synthetic model's weight types, comma-separated ('' for none)")
    ap.add_argument("--sides", default="keep,f32,f16", help="of keep, f32, f16, bf16-keep, "
                    "bf16 (compute bf16); keep first where given (f32/f16's ratios are over "
                    "it), bf16 with bf16-keep (its ratio is over that)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per side (after one "
                    "warm-up step)")
    ap.add_argument("--threads", type=int, default=2, help="the synthetic part's threads (the "
                    "real models run on their demo config's)")
    ap.add_argument("--real-threads", default="2", help="the real models' thread counts, "
                    "comma-separated, each a run of its own (default: their demo config's, 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the steps run (cuda: the table's cuda row; --blas is then moot)")
    ap.add_argument("--blas", choices=("on", "off", "both"), default="both",
                    help="synthetic part: ggml's BLAS backend on, off (PYTRAIN_BLAS=0) or both")
    ap.add_argument("--size", choices=sorted(SIZES), default="demo")
    ap.add_argument("--results", type=Path, help="write type_policy.md and .json here")
    ap.add_argument("--note", default="", help="a sentence for the report (what else ran)")
    ap.add_argument("--name", default="type_policy", help="the result files' name in --results "
                    "(NAME.md, NAME.json)")
    a = ap.parse_args(argv)
    a.sides = a.sides.split(",")
    if (set(a.sides) - set(SIDES) or len(set(a.sides)) != len(a.sides)
            or "keep" in a.sides and a.sides[0] != "keep"
            or {"f16"} & set(a.sides) and "keep" not in a.sides
            or "bf16" in a.sides and "bf16-keep" not in a.sides):
        ap.error("--sides: of keep, f32, f16, bf16-keep, bf16, each once; keep first where "
                 "given, f16 with keep, bf16 with bf16-keep")
    a.models = [x for x in a.models.split(",") if x]
    try:
        a.real_threads = [int(x) for x in a.real_threads.split(",")]
    except ValueError:
        ap.error(f"--real-threads: comma-separated counts, got {a.real_threads!r}")
    a.types = [x.upper() for x in a.types.split(",") if x]
    for x in a.models:
        if x not in REAL:
            ap.error(f"--models: {x!r} is not one of {', '.join(REAL)}")
    for x in a.types:
        if x not in TYPES:
            ap.error(f"--types: {x!r} is not one of {', '.join(TYPES)}")
    return a


def table(rows: list[dict]) -> dict[str, dict[str, tuple]]:
    """``type_choice.STEP_RATIO`` as these synthetic rows measure it (rows of the committed
    table this run did not measure are kept)."""
    from pytrain.run import type_choice as tc
    out = {k: dict(v) for k, v in tc.STEP_RATIO.items()}
    for x in rows:
        s = x["sides"]
        if "f32" not in s or "keep" not in s:
            continue
        f16 = s["f16"]["keep_over_this"] if "f16" in s else None
        out.setdefault(x["device"], {})[x["type"]] = (
            round(s["f32"]["keep_over_this"], 2), None if f16 is None else round(f16, 2))
    return out


def bf16_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    """``type_choice.BF16_STEP_RATIO`` as these synthetic rows measure it (bf16-keep's step
    time over bf16's; rows of the committed table this run did not measure are kept)."""
    from pytrain.run import type_choice as tc
    out = {k: dict(v) for k, v in tc.BF16_STEP_RATIO.items()}
    for x in rows:
        s = x["sides"]
        if "bf16" in s and "bf16-keep" in s:
            out.setdefault(x["device"], {})[x["type"]] = round(s["bf16"]["keep_over_this"], 2)
    return out


def table_source(t: dict) -> str:
    """``t`` as the literal pytrain/run/type_choice.py holds."""
    lines = ["STEP_RATIO: dict[str, dict[str, tuple[float, float | None]]] = {"]
    for key, row in t.items():
        lines.append(f'    "{key}": {{')
        lines += [f'        "{k}": {v},' for k, v in row.items()]
        lines.append("    },")
    return "\n".join(lines + ["}"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        return worker(args[1])
    a = parse(argv)
    log = lambda s: print(s, flush=True)
    result = dict(date=f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
                  command=bc.command_line("bench_type_policy", argv), machine=bc.machine_facts(),
                  threads=a.threads, size=a.size, rounds=a.rounds, shared_note=SHARED,
                  note=a.note, real=[], synthetic=[])
    blas = {"on": [True], "off": [False], "both": [True, False]}[a.blas]
    if a.device != "cpu":
        blas = [True]                 # a GPU runtime has no BLAS backend: one pass
    with tempfile.TemporaryDirectory(prefix="bench_type_policy-") as tmp:
        folder = Path(tmp)
        for b in blas:
            # without BLAS an F16 weight's OUT_PROD runs on ggml-cpu, as slow as a kept one:
            # the f16 side is left out there
            # (and bf16 compute needs the BLAS backend: oneDNN is in it)
            sides = a.sides if b else [x for x in a.sides if x not in ("f16",) + BF16_SIDES]
            for t in a.types:
                x = bench_type(t, sides, a.size, a.rounds, b, folder, a.threads, a.device)
                result["synthetic"].append(x)
                log(f"{t} {x['device']}: " + ", ".join(
                    f"{s} {v['tokens_per_s']:.0f} tok/s" for s, v in x["sides"].items()))
        from pytrain.run import type_choice as tc
        result["table"] = table(result["synthetic"])
        committed, tc.STEP_RATIO = tc.STEP_RATIO, result["table"]   # auto as this run measures
        result["table_is_committed"] = committed == result["table"]
        result["bf16_table"] = bf16_table(result["synthetic"])
        committed16, tc.BF16_STEP_RATIO = tc.BF16_STEP_RATIO, result["bf16_table"]
        result["bf16_table_is_committed"] = committed16 == result["bf16_table"]
        try:
            for name in a.models:
                for n in a.real_threads:
                    x = bench_real(name, a.sides, a.rounds, folder, log, n, a.device)
                    if x:
                        result["real"].append(x)
                        log(json.dumps({s: round(v["tokens_per_s"], 1)
                                        for s, v in x["sides"].items()}))
        finally:
            tc.STEP_RATIO, tc.BF16_STEP_RATIO = committed, committed16
    md = markdown(result)
    print("\n" + md)
    if not result["table_is_committed"]:
        print("this run's table differs from pytrain/run/type_choice.py's; to use it there:\n"
              + table_source(result["table"]))
    if not result["bf16_table_is_committed"]:
        print("this run's bf16 table differs from pytrain/run/type_choice.py's "
              "(BF16_STEP_RATIO): " + json.dumps(result["bf16_table"]))
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
        (a.results / f"{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (a.results / f"{a.name}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
