"""Smoke tests of the benchmark scripts the README's speed and memory figures come from: each
runs its own code, at the smallest size, so that a rename in pytrain (or a typo on the
reference side) breaks a test instead of the next benchmark run.

One toy model ("toy" in scripts/bench_common.py's SPECS: hidden 64, 4 layers, vocabulary 512)
is generated once for the module by ``bench_common.ensure_model`` under the reference
interpreter (tests/reference_env.py), exactly as a benchmark makes its models; every
benchmark's workers then run one step (or one forward) of each side on it.  Nothing here is
timed: the figures are the benchmarks' job.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import bench_common as bc
from tests import reference_env

pytestmark = pytest.mark.slow

BATCH = ("1", "32")


@pytest.fixture(scope="module")
def ref_python() -> str:
    return reference_env.require()


@pytest.fixture(scope="module")
def toy(ref_python, tmp_path_factory) -> dict:
    """The toy benchmark model (HF checkpoint + F32 GGUF), made as the benchmarks make theirs."""
    d = bc.ensure_model("toy", tmp_path_factory.mktemp("bench"), ref_python, "bench_train")
    assert d is not None, "bench_common.ensure_model('toy') failed (its output is above)"
    done = json.loads((d / "done.json").read_text())
    return dict(dir=d, gguf=str(d / done["gguf"]), hf=str(d / "hf"), n_params=done["n_params"])


def worker(python: str, script: str, side: str, *args: str) -> dict:
    """One worker process of ``scripts.SCRIPT`` (one thread); its RESULT, or a failure showing
    the end of its output."""
    res, r = bc.run_result([python, "-m", f"scripts.{script}", "--worker", side, *args],
                           bc.worker_env(1), timeout=600)
    assert r.returncode == 0 and res is not None, (
        f"scripts.{script} --worker {side} exited {r.returncode}:\n{r.stdout[-2000:]}\n"
        f"{r.stderr[-4000:]}")
    return res


def test_bench_train_one_step_each_side(toy, ref_python):
    """python -m scripts.bench_train's two workers, one clean timed step each after one
    warm-up: the same batch and mask (16 targets of 32 tokens) and the same LoRA size."""
    common = ["--threads", "1", "--runs", "1", "--warmup", "1", "--batch", *BATCH,
              "--vocab", "512"]
    p = worker(sys.executable, "bench_train", "pytrain", *common, "--gguf", toy["gguf"])
    h = worker(ref_python, "bench_train", "hf", *common, "--hf", toy["hf"])
    for r in (p, h):
        assert r["tokens"] == 32 and r["n_targets"] == 16, r
        assert all(x == x and 0 < x < 100 for x in r["losses"]), r["losses"]
        assert len(r["times"]) >= 1
    assert p["lora_params"] == h["lora_params"], (p["lora_params"], h["lora_params"])
    assert p["lora_names"] == h["lora_names"] == 8      # q/k/v/o of the 2 attention layers


def test_bench_train_workers_limits_without_warmup(toy, ref_python):
    """Both workers with --limits and no warm-up step: the products (pytrain) and the FLOPs
    (HF) are counted on an extra untimed step, in the losses; --probe-square 0 probes no
    square; the HF side's torch probe runs the (M, N, K, batch) shapes it is given."""
    common = ["--threads", "1", "--runs", "1", "--warmup", "0", "--batch", *BATCH,
              "--vocab", "512", "--limits", "--probe-top", "1", "--probe-square", "0"]
    p = worker(sys.executable, "bench_train", "pytrain", *common, "--gguf", toy["gguf"])
    h = worker(ref_python, "bench_train", "hf", *common, "--hf", toy["hf"],
               "--probe-shapes", "24,8,16,1;8,8,8,2")
    assert len(p["losses"]) == len(p["times"]) + 1 and not p["warmup_s"]
    assert len(h["losses"]) == len(h["times"]) + 1 and not h["warmup_s"]
    (pp,) = p["limits"]["probes"]
    assert not pp["square"] and pp["label"] == p["limits"]["products"]["top"][0]["label"]
    assert [x["mnkb"] for x in h["limits"]["probes"]] == [[24, 8, 16, 1], [8, 8, 8, 2]]
    assert h["limits"]["probes"][1]["flops"] == 2 * 8 * 8 * 8 * 2
    assert h["limits"]["flops"]["flops"] > 0 and "aten.mm" in h["limits"]["flops"]["by_op"]


def test_bench_train_bf16_rows_and_their_report(toy, ref_python, tmp_path):
    """python -m scripts.bench_train --bf16 on (forced: a CPU without bf16 units runs it too,
    emulated): the row has all four sides, pytrain's bf16 side loaded its matrices as BF16 and
    names its oneDNN kernel, HF's bf16 side ran in bfloat16 with its kernels caught, the
    report opens with the float32 / bfloat16 table, and --report-from renders the json the same."""
    out = tmp_path / "train-bf16.md"
    run_script("scripts.bench_train", "--models", "toy", "--threads", "1", "--blas-off", "",
               "--steps", "1", "--warmup", "1", "--no-profile", "--bf16", "on", "--quiet-wait",
               "0", "--cache", str(toy["dir"].parent), "--ref-python", ref_python,
               "--out", str(out))
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    p, p16, h, h16 = (row[k] for k in ("pytrain", "pytrain_bf16", "hf", "hf_bf16"))
    from pytrain import ggml
    if os.environ.get("PYTRAIN_BLAS", "1") in ("", "0") or not ggml.bf16_kernel():
        # bf16 compute needs ggml-blas, and a CPU oneDNN has a bf16 matmul for (AVX-512):
        # refused, the row shows "-"
        assert p16 is None
    else:
        assert p16["compute_type"] == "bf16" and p16["bf16_kernel"], p16.get("compute")
        assert p16["compute"].startswith("compute bf16") and p16["bf16_kernel"] in p16["compute"]
        assert "F32->BF16" in p16["weight_types"] and "F32->BF16" not in p["weight_types"]
        assert p16["tokens"] == p["tokens"] == 32 and 0 < p16["first_loss"] < 100
    assert (h["dtype"], h16["dtype"]) == ("float32", "bfloat16")
    for x in (h, h16):
        assert sum(x["kernels"]["aten"].values()) > 0, x["kernels"]   # the products were seen
    text = out.read_text()
    assert "float32 and bfloat16" in text.splitlines()[0]
    assert "- CPU bf16 units (avx512_bf16 / amx_bf16 in /proc/cpuinfo): " in text
    section = text.split("## float32 and bfloat16", 1)[1].split("| model | threads | batch |")[0]
    cells = [c.strip() for c in next(ln for ln in section.splitlines()
                                     if ln.startswith("| toy | 1 |")).strip("|").split("|")]
    assert len(cells) == 12 and cells[6] in ("HF f32", "HF bf16"), cells
    assert "HF bf16: oneDNN" in cells[11] and "aten::mm" in cells[11], cells[11]
    if p16:
        assert "-" not in cells[2].split(" / ") and cells[5] != "-", cells
        assert f"pytrain: {p16['bf16_kernel']}" in cells[11]
    # where the limit is (on by default): every side counted its products and probed them
    for x in (p, h, h16):
        assert x["limits"]["peak_gflops"] > 0 and x["limits"]["probes"], x["limits"]
    assert p["limits"]["products"]["flops"] > 0 and h["limits"]["flops"]["flops"] > 0
    assert len(h["limits"]["probes"]) == len(p["limits"]["probes"])   # the same shapes
    limit_rows = [ln for ln in text.split("## Where the limit is", 1)[1].split("\n## ")[0]
                  .splitlines() if ln.startswith("| toy | 1 | ")]
    sides = {ln.split("|")[3].strip() for ln in limit_rows}
    assert {"pytrain f32", "HF float32", "HF bfloat16"} <= sides, sides
    again = tmp_path / "again.md"
    run_script("scripts.bench_train", "--report-from", str(out.with_suffix(".json")),
               "--out", str(again))
    assert again.read_text() == text


def test_bench_train_limits_for_pytrain_alone(toy, tmp_path):
    """python -m scripts.bench_train --no-hf --threads 1,2 --probe-top 2 --probe-square 64:
    pytrain's sides only, at both thread counts; each counted its step's products (the
    profile's callback count agrees), probed the 2 largest shapes and the 64-cube with the
    ggml probe, and the report's "Where the limit is" table has a row per thread count.  The
    first row's profile is the limits' profiled step (no profile process of its own)."""
    out = tmp_path / "train.md"
    run_script("scripts.bench_train", "--models", "toy", "--threads", "1,2", "--blas-off", "",
               "--steps", "1", "--warmup", "1", "--bf16", "off", "--quiet-wait", "0",
               "--no-hf", "--probe-top", "2", "--probe-square", "64",
               "--cache", str(toy["dir"].parent), "--out", str(out))
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["threads"] for r in rows] == [1, 2]
    for r in rows:
        assert r["hf"] is None and r["no_hf"]
        lim = r["pytrain"]["limits"]
        assert "profile" not in lim            # kept once, as the row's profile
        probes = lim["probes"]
        assert len(probes) == 3 and probes[-1]["square"] and probes[-1]["mnkb"] == [64, 64, 64, 1]
        assert [p["label"] for p in probes[:2]] == [t["label"] for t in lim["products"]["top"][:2]]
        assert lim["peak_gflops"] == max(p["best_gflops"] for p in probes)
        assert lim["node_s"] == pytest.approx(lim["product_node_s"] + lim["other_node_s"])
    prof = rows[0]["pytrain_profile"]
    assert prof["product_flops"] == rows[0]["pytrain"]["limits"]["products"]["flops"]
    assert "pytrain_profile" not in rows[1]
    text = out.read_text()
    section = text.split("## Where the limit is", 1)[1].split("\n## ")[0]
    for t in (1, 2):
        row = next(ln for ln in section.splitlines()
                   if ln.startswith(f"| toy | {t} | pytrain f32 |"))
        assert row.split("|")[8].strip().endswith("%**"), row      # utilization
    assert "square MUL_MAT F32 [64 x 64] . [64 x 64]" in section
    assert "ggml-cpu variant" in section and "HF side not run: --no-hf" in text


def test_bench_train_no_limits(toy, tmp_path):
    """--no-limits: the run measures none of it, and the report has no such section."""
    out = tmp_path / "train.md"
    run_script("scripts.bench_train", "--models", "toy", "--threads", "1", "--blas-off", "",
               "--steps", "1", "--warmup", "1", "--bf16", "off", "--quiet-wait", "0",
               "--no-hf", "--no-profile", "--no-limits", "--cache", str(toy["dir"].parent),
               "--out", str(out))
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert "limits" not in row["pytrain"] and "## Where the limit is" not in out.read_text()


def test_bench_train_report_renders_the_committed_results(tmp_path):
    """python -m scripts.bench_train --report-from: the committed train.md and train-intel.md
    hold every line the script renders from their json (they also keep sections of earlier,
    finished investigations the script no longer makes)."""
    repo = Path(bc.REPO)
    for name in ("train", "train-intel"):
        out = tmp_path / f"{name}.md"
        r = subprocess.run([sys.executable, "-m", "scripts.bench_train", "--report-from",
                               str(repo / "bench_results" / f"{name}.json"), "--out", str(out)],
                              cwd=str(repo), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        committed = iter((repo / "bench_results" / f"{name}.md").read_text().splitlines())
        missing = [ln for ln in out.read_text().splitlines() if ln not in committed]
        assert not missing, (name, missing[:3])


def test_bench_train_vulkan_report_renders_the_committed_result(tmp_path):
    """python -m scripts.bench_train --device vulkan --report-from: the committed lavapipe
    report is what the script renders from its json (title naming llvmpipe, the lavapipe
    warning, the HF side not run and why)."""
    repo = Path(bc.REPO)
    out = tmp_path / "vk.md"
    r = subprocess.run([sys.executable, "-m", "scripts.bench_train", "--device", "vulkan",
                        "--report-from", str(repo / "bench_results" / "train-vulkan-lavapipe.json"),
                        "--out", str(out)], cwd=str(repo), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert text == (repo / "bench_results" / "train-vulkan-lavapipe.md").read_text()
    assert "llvmpipe" in text.splitlines()[0] and "runs on the CPU" in text
    assert "HF side: not run: torch has no Vulkan training backend" in text


def test_bench_train_gpu_workers_on_cpu(toy, ref_python):
    """python -m scripts.bench_train --device cuda's two workers (scripts/bench_train_gpu.py),
    dry-run on the CPU: pytrain's step and HF + PEFT's bfloat16 step, one each."""
    common = ["--device", "cpu", "--batch", *BATCH, "--warmup", "0", "--steps", "1"]
    p = worker(sys.executable, "bench_train_gpu", "pytrain", *common, "--gguf", toy["gguf"],
               "--policy", "auto")
    h = worker(ref_python, "bench_train_gpu", "hf", *common, "--hf", toy["hf"])
    assert p["tokens"] == h["tokens"] == 32 and p["n_targets"] == h["n_targets"] == 16
    assert p["lora_params"] == h["lora_params"]
    assert h["dtype"] == "bfloat16", h["dtype"]


def test_bench_train_gpu_pytrain_worker_on_vulkan(toy):
    """python -m scripts.bench_train --device vulkan's pytrain worker, one step on the Vulkan
    device (Mesa's lavapipe in CI): the step ran there (a node left to the CPU stops a GPU
    run), the report's device is ggml's, and its memory figure is ggml's own reading where
    there is no nvidia-smi."""
    from vulkan_support import vulkan_device
    from pytrain import ggml
    desc = vulkan_device()
    p = worker(sys.executable, "bench_train_gpu", "pytrain", "--device", "vulkan", "--batch",
               *BATCH, "--warmup", "0", "--steps", "1", "--gguf", toy["gguf"],
               "--policy", "auto")
    assert p["tokens"] == 32 and p["n_targets"] == 16 and len(p["times"]) == 1
    assert 0 < p["first_loss"] < 100, p["losses"]
    assert p["device_label"].endswith(f": {desc}") and p["backends"][0].startswith("Vulkan")
    assert p["lavapipe"] is ggml.is_lavapipe(desc)
    assert isinstance(p["device_used_ggml"], int) and p["device_total"] > 0


def real_model(name: str, size: str) -> Path:
    """A real model's fetched GGUF (``make real-model`` fetches it before the tests; a skip
    only where it is absent)."""
    from llama_cpp_check import fetched_model
    return fetched_model(name, size)


def test_bench_train_real_model_smollm2(ref_python, tmp_path):
    """python -m scripts.bench_train --models smollm2: the real Q4_1 file, one timed step of
    each side at the benchmark's batch (2 x 256, first half masked).  pytrain loaded the GGUF
    as a training run would (its type choice recorded); HF + PEFT ran on the folder
    dequantized from it (made once under the cache the GGUF came from), so both sides'
    first-step losses agree (only the kept Q8_0 embedding's activation rounding differs; other
    weights would differ by far more); the same LoRA targets; the report states the file type
    and what pytrain loaded each matrix as."""
    gguf = real_model("smollm2", "93 MB")
    out = tmp_path / "train.md"
    run_script("scripts.bench_train", "--models", "smollm2", "--threads", "1", "--blas-off", "",
               "--steps", "1", "--warmup", "0", "--no-profile", "--no-limits", "--bf16", "off",
               "--quiet-wait", "0", "--cache", str(gguf.parent.parent / "bench"),
               "--ref-python", ref_python, "--out", str(out))
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    p, h = row["pytrain"], row["hf"]
    assert row["file_type"] == "MOSTLY_Q4_1" and row["gguf"] == str(gguf)
    assert p["type_choice"].startswith('type_policy = "auto": '), p.get("type_choice")
    assert {k.split("->")[0] for k in p["weight_types"]} == {"Q4_1", "Q8_0", "F32"}
    assert sum(p["weight_types"].values()) == 272, p["weight_types"]
    assert p["tokens"] == h["tokens"] == 512 and p["n_targets"] == h["n_targets"] == 256
    assert p["lora_names"] == h["lora_names"] == 4 * 30       # q/k/v/o of every layer
    assert p["lora_params"] == h["lora_params"]
    assert h["dtype"] == "float32" and 0 < p["first_loss"] < 100
    assert p["first_loss"] == pytest.approx(h["first_loss"], rel=1e-3), (p["losses"], h["losses"])
    shapes = out.read_text().split("Shapes:", 1)[1]
    assert "- **smollm2**: SmolLM2-135M-Instruct (llama)" in shapes
    assert "weights file type MOSTLY_Q4_1 (Q4_1 x 210, F32 x 61, Q8_0 x 1)" in shapes
    assert "; pytrain loads its weight tensors as " in shapes
    assert f"  - pytrain's type choice, compute f32: {p['type_choice']}" in shapes


def run_script(*argv: str, timeout: float = 600) -> str:
    r = subprocess.run([sys.executable, "-m", *argv], cwd=str(bc.REPO), capture_output=True,
                          text=True, timeout=timeout, env=bc.worker_env(1))
    assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-2000:]}\n" \
                              f"{r.stderr[-4000:]}"
    return r.stdout


def test_bench_forward_both_sides(toy, ref_python, tmp_path):
    """python -m scripts.bench_forward on the toy model: both sides loaded, one timed round,
    their log-softmax compared, the report written."""
    out = tmp_path / "forward.md"
    run_script("scripts.bench_forward", "--models", "toy", "--threads", "1", "--runs", "1",
               "--quiet-wait", "0", "--cache", str(toy["dir"].parent), "--ref-python", ref_python,
               "--out", str(out))
    row = next(ln for ln in out.read_text().splitlines() if ln.startswith("| toy |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1 x 32" and cells[4] != "-" and cells[5] != "-", row


def test_bench_memory_at_one_short_length(tmp_path):
    """python -m scripts.bench_memory at batch 1 x 64 (the 2B shape's graphs, nothing
    allocated): the tables and the json are written."""
    run_script("scripts.bench_memory", "--batch", "1", "--lengths", "64", "--out", str(tmp_path))
    j = json.loads((tmp_path / "memory.json").read_text())
    (row,) = j["steps"]
    assert row["T"] == 64 and row["one_graph"] > 0 and row["acc"]["nodes"] > 0, row
    # the CPU's graph: the fused recurrence keeps less than the GPU's chunked one
    assert 0 < row["one_graph_cpu"] < row["one_graph"], row
    assert "| 64 | 64 |" in (tmp_path / "memory.md").read_text()


def test_bench_cpu_variants_toy(tmp_path):
    """python -m scripts.bench_cpu_variants --shape toy: bench_train's pytrain worker under the
    best variant and the most portable one (x64), F32 with BLAS and F16 without."""
    out = tmp_path / "cpu_variants.md"
    run_script("scripts.bench_cpu_variants", "--shape", "toy", "--variants", "best,x64",
               "--rounds", "1", "--steps", "1", "--threads", "1", "--out", str(out))
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["dtype"], r["blas"]) for r in rows] == [("f32", "1"), ("f16", "0")]
    assert all(r["loaded"]["x64"] == "x64" and r["seconds"]["x64"] > 0 for r in rows), rows


def test_bench_distributed_toy(toy, ref_python, tmp_path):
    """python -m scripts.bench_distributed --shape toy: `pytrain train` as 1 process and under
    mpiexec -n 2, the same global batch, the same losses (the script checks), 3 steps."""
    out = tmp_path / "distributed.md"
    run_script("scripts.bench_distributed", "--shape", "toy", "--steps", "3", "--cache",
               str(toy["dir"].parent), "--ref-python", ref_python, "--out", str(out))
    j = json.loads(out.with_suffix(".json").read_text())
    assert j["one"]["ranks"] == 1 and j["two"]["ranks"] == 2
    assert j["one"]["losses"] == j["two"]["losses"] and len(j["one"]["losses"]) == 1


def test_bench_cross_entropy_small(tmp_path):
    """python -m scripts.bench_cross_entropy at [1000, 8]: the best variant and haswell, one
    round each, both ops timed, the loss of the op (one-hot labels over N(0, 3) logits: about
    log V plus a few) reported, the table and json written."""
    out = tmp_path / "ce.md"
    run_script("scripts.bench_cross_entropy", "--vocab", "1000", "--rows", "8", "--threads",
               "1", "--rounds", "1", "--reps", "2", "--variants", "best,haswell", "--out",
               str(out))
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["variant"] for r in rows] == ["best", "haswell"] and rows[1]["loaded"] == "haswell"
    for r in rows:
        assert r["forward"]["n"] == r["backward"]["n"] == 2 and r["forward"]["min_ms"] > 0, r
        assert 6.0 < r["loss"] < 30.0, r
    assert "| haswell | haswell |" in out.read_text()
