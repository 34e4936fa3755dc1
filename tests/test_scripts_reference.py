"""Smoke tests of the scripts that made the committed references: each runs as
``python -m scripts.NAME`` into a temporary folder, at the smallest size its options offer,
and what it writes is compared with the committed file it once made.  So a generator that no
longer runs (a renamed pytrain or torch name, a changed converter) fails here, and so does a
committed fixture that its generator no longer reproduces.

The generators that need torch, transformers or PEFT run under the reference interpreter
(tests/reference_env.py: ``make test`` provides it; elsewhere they skip without it).

Bounds, where a value is recomputed rather than copied (tests/bounds.py):

* float64 references stored as float32: two float64 evaluations of the same forward differ by
  a few hundred units of 2^-53 relative, far below half a float32 step, so their float32
  roundings are equal or adjacent: at most 1 float32 ulp, 2^-23·|x|.
* float32 values made by the same float32 torch code on another CPU: two float32 evaluations
  made on different machines differ by up to both of their errors, so the bound is
  ``bounds.f32_pair_bound`` of both runs' own float32 errors, each measured against the
  float64 run the same file stores (the committed file's against its own, this run's against
  this run's).  One run's error alone is no bound: a committed golden made on an AMD EPYC was
  1.23e-6 from its float64 run where an Intel AMX machine's run was 2.2e-7.
* float64 values from that float64 run: the same operations rounded at 2^-53 instead of
  2^-24, so the larger float32 error scaled by 2^-29 (times F32_SPREAD, as for float32).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bounds import F32_SPREAD, f32_pair_bound, ulps
from tests import reference_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
ULP32 = 2.0 ** -23        # one float32 step relative to the value (|x| in [1, 2) -> 2^-23)


@pytest.fixture(scope="module")
def ref_python() -> str:
    return reference_env.require()


# Each reference generator at its smallest size: (module, arguments); OUT is the folder it
# writes to.  All are started together when the first test needs one (each mostly imports
# torch and runs one thread, so the machine's cores share them), and each test waits for its own.
GENERATORS = {
    "peft_golden": ["scripts.make_peft_golden", "--out", "OUT/peft_grads.npz"],
    "peft_rslora": ["scripts.make_peft_golden", "--variant", "rslora", "--out",
                    "OUT/peft_rslora.npz"],
    "peft_logits": ["scripts.make_peft_logits_golden", "--sets", "sparse", "--out",
                    "OUT/peft_logits.npz"],
    "qwen35": ["scripts.make_qwen35_fixtures", "--models", "gqa", "--types", "f32", "--out",
               "OUT"],
    "llama": ["scripts.make_llama_fixtures", "--family", "llama", "--models", "llama3", "--out",
              "OUT"],
    "default_model": ["scripts.make_default_model", "--fresh", "--steps", "2", "--docs", "300",
                      "--sums", "2", "--check-demo", "--demo-steps", "1", "--work", "OUT/work",
                      "--out", "OUT"],
    "chat_template": ["scripts.make_chat_template_golden", "--out", "OUT/golden.json"],
    "pref_golden": ["scripts.make_pref_golden", "--out", "OUT"],
    "loraplus": ["scripts.make_loraplus_golden", "--out", "OUT/loraplus_golden.npz"],
    "lora_init": ["scripts.make_lora_init_golden", "--out", "OUT/lora_init_golden.json"],
}


@pytest.fixture(scope="module")
def generated(ref_python, tmp_path_factory):
    """``get(name)``: the folder generator ``name`` wrote and its output, once it ended
    (a failure showing the end of its output when it did not exit 0)."""
    procs = {}
    for name, argv in GENERATORS.items():
        out = tmp_path_factory.mktemp(name)
        log = open(out / "log.txt", "w")
        cmd = [ref_python, "-m", *[a.replace("OUT", str(out)) for a in argv]]
        procs[name] = (subprocess.Popen(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT),
                       out, log)

    def get(name: str) -> tuple[Path, str]:
        p, out, log = procs[name]
        rc = p.wait(timeout=1800)
        log.close()
        text = (out / "log.txt").read_text()
        assert rc == 0, f"{' '.join(GENERATORS[name])} exited {rc}:\n{text[-5000:]}"
        return out, text
    yield get
    for p, _, log in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def assert_reproduced(new, old, key: str, where) -> None:
    """``new[key]`` and ``old[key]`` (float32 values with their float64 run ``key + "64"``)
    are the same float32 computation made on two machines: each within its own measured
    float32 error of its float64 run, the float64 runs within float64 rounding of each other
    (module docstring)."""
    exact_new, exact_old = (np.asarray(z[key + "64"], np.float64) for z in (new, old))
    e_new = float(np.abs(np.asarray(new[key], np.float64) - exact_new).max())
    e_old = float(np.abs(np.asarray(old[key], np.float64) - exact_old).max())
    d = float(np.abs(np.asarray(new[key], np.float64) - np.asarray(old[key], np.float64)).max())
    assert d <= f32_pair_bound(e_new, e_old, exact_new), (where, key, d, e_new, e_old)
    if new[key + "64"].dtype == np.float64:
        e64 = F32_SPREAD * max(e_new, e_old, ulps(exact_new)) * 2.0 ** -29
        assert np.abs(exact_new - exact_old).max() <= max(
            e64, ULP32 * float(np.abs(exact_new).max())), (where, key + "64")
    else:                                   # a float64 run stored as float32: 1 ulp
        assert (np.abs(exact_new - exact_old) <= ULP32 * np.abs(exact_old)).all(), (
            where, key + "64")


def run(python: str, *argv: str, timeout: float = 900) -> str:
    r = subprocess.run([python, "-m", *argv], cwd=str(ROOT), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    return r.stdout


def test_make_qwen35_f64_golden_reproduces_its_file(tmp_path):
    """scripts/make_qwen35_f64_golden.py (numpy alone) on gqa-f32: the committed golden to
    1 float32 ulp."""
    run(sys.executable, "scripts.make_qwen35_f64_golden", "--files", "gqa-f32", "--out",
        str(tmp_path))
    new = np.load(tmp_path / "gqa-f32.f64.npz")["logprobs"].astype(np.float64)
    old = np.load(FIX / "qwen35" / "gqa-f32.f64.npz")["logprobs"].astype(np.float64)
    assert new.shape == old.shape and np.abs(new).max() > 1
    assert (np.abs(new - old) <= ULP32 * np.abs(old)).all(), float(np.abs(new - old).max())


def test_make_chat_template_golden_reproduces_its_file(generated):
    """scripts/make_chat_template_golden.py: transformers renders the pinned template to the
    committed golden, character for character."""
    out = generated("chat_template")[0] / "golden.json"
    new, old = (json.loads(p.read_text()) for p in (out, FIX / "chat_template_golden.json"))
    assert len(new["cases"]) == len(old["cases"]) > 5
    assert new == old


@pytest.mark.parametrize("name, file", [("peft_golden", "peft_grads.npz"),
                                        ("peft_rslora", "peft_rslora.npz")])
def test_make_peft_golden_reproduces_its_file(generated, name, file):
    """scripts/make_peft_golden.py (plain LoRA and --variant rslora): the rebuilt gqa model
    passes its own check against the committed gqa.npz, PEFT's float32 and float64 gradients
    come out, and equal the committed golden to rounding (module docstring)."""
    folder, log = generated(name)
    out = folder / file
    assert "rebuilt gqa vs committed golden" in log
    new, old = np.load(out), np.load(FIX / "qwen35" / file)
    assert sorted(new.files) == sorted(old.files)
    grads = [k for k in old.files if k.endswith(".grad")]
    assert len(grads) == 16
    for k in old.files:
        if not k.endswith((".grad", ".grad64", "loss", "loss64")):   # inputs: exactly
            assert np.array_equal(new[k], old[k]), k
    for k in grads + ["loss"]:
        assert_reproduced(new, old, k, file)


def test_make_pref_golden_reproduces_its_files(generated):
    """scripts/make_pref_golden.py: TRL's tokenization, batch and LoRA values exactly, its
    losses, metrics, log-probabilities and gradients to rounding (module docstring), for both
    fixtures."""
    folder, log = generated("pref_golden")
    for fam in ("qwen35", "llama"):
        new = np.load(folder / fam / "pref_golden.npz")
        old = np.load(FIX / fam / "pref_golden.npz")
        assert sorted(new.files) == sorted(old.files), fam
        for k in old.files:
            if k.endswith("64") or k == "orpo.loss_trl_full_nll":
                continue
            if (k + "64") not in old.files and not k.endswith(".grad"):
                assert np.array_equal(new[k], old[k]), (fam, k)      # inputs: exactly
                continue
            assert_reproduced(new, old, k, fam)


def gguf_tensor_bytes(path: Path) -> dict:
    from gguf import GGUFReader
    r = GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(r.data[t.data_offset: t.data_offset + t.n_bytes]))
            for t in r.tensors}


def test_make_qwen35_fixtures_reproduces_gqa_f32(generated):
    """scripts/make_qwen35_fixtures.py --models gqa --types f32: the tokenizer and every
    tensor of gqa-f32.gguf byte for byte as committed (fixed seeds; the converter is
    deterministic), and the same tokens in the golden."""
    out, log = generated("qwen35")
    assert "numpy-from-GGUF vs HF golden" in log
    ref = FIX / "qwen35"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "tokenizer" / f).read_bytes() == (ref / "tokenizer" / f).read_bytes(), f
    assert gguf_tensor_bytes(out / "gqa-f32.gguf") == gguf_tensor_bytes(ref / "gqa-f32.gguf")
    new, old = np.load(out / "gqa.npz"), np.load(ref / "gqa.npz")
    assert np.array_equal(new["tokens"], old["tokens"])
    assert str(new["config_json"]) == str(old["config_json"])


def test_make_llama_fixtures_reproduces_llama3(generated):
    """scripts/make_llama_fixtures.py --models llama3: llama3-f32.gguf byte for byte, its
    float64 reference to 1 float32 ulp, PEFT's gradient file with the committed keys."""
    out, log = generated("llama")
    ref = FIX / "llama"
    assert gguf_tensor_bytes(out / "llama" / "llama3-f32.gguf") == \
        gguf_tensor_bytes(ref / "llama3-f32.gguf")
    new = np.load(out / "llama" / "llama3-f32.f64.npz")["logprobs64"].astype(np.float64)
    old = np.load(ref / "llama3-f32.f64.npz")["logprobs64"].astype(np.float64)
    assert (np.abs(new - old) <= ULP32 * np.abs(old)).all(), float(np.abs(new - old).max())
    assert sorted(np.load(out / "llama" / "peft_llama3.npz").files) == \
        sorted(np.load(ref / "peft_llama3.npz").files)


def test_make_peft_logits_golden_sparse_set(generated):
    """scripts/make_peft_logits_golden.py --sets sparse: PEFT loads pytrain's folder (the
    script's own checks, llama.cpp's LoRA converter among them), and the tensors and config
    it stores equal the committed sparse set's."""
    out, log = generated("peft_logits")
    new, old = np.load(out / "peft_logits.npz"), np.load(FIX / "qwen35" / "peft_logits.npz")
    other_sets = ("all/", "rslora/")  # the same code path; only the sparse set is rebuilt here
    keys = [k for k in old.files if not k.startswith(other_sets)]
    assert sorted(new.files) == sorted(keys)
    for k in keys:
        if "logits" not in k and k != "sparse/effect" and old[k].dtype.kind != "U":
            assert np.array_equal(new[k], old[k]), k


def test_make_default_model_toy(generated):
    """scripts/make_default_model.py at a toy size (2 pretraining steps on 300 documents, one
    HF + PEFT LoRA step): converts, checks its GGUF, and writes the demo data the package
    ships, record for record."""
    out, log = generated("default_model")
    assert (out / "default-model.gguf").stat().st_size > 0 and "[demo]" in log
    assets = ROOT / "pytrain" / "assets"
    for f in ("demo_train.jsonl", "demo_valid.jsonl"):
        assert (out / f).read_bytes() == (assets / f).read_bytes(), f


def test_make_loraplus_golden_reproduces_its_file(generated):
    """scripts/make_loraplus_golden.py: PEFT's LoRA+ optimizer groups check out and its steps
    equal the committed golden (inputs exactly; float32 steps within both runs' own distances
    from their float64 runs, float64 steps to float64 rounding)."""
    folder, log = generated("loraplus")
    new, old = np.load(folder / "loraplus_golden.npz"), np.load(FIX / "qwen35" /
                                                                "loraplus_golden.npz")
    assert sorted(new.files) == sorted(old.files) and "wrote" in log
    for k in old.files:
        if "/after" not in k:
            assert np.array_equal(new[k], old[k]), k
        elif "/after64/" in k:
            assert np.abs(new[k] - old[k]).max() <= 1e-12 * np.abs(old[k]).max(), k
        else:
            exact_new = new[k.replace("/after/", "/after64/")]
            exact_old = old[k.replace("/after/", "/after64/")]
            e_new = float(np.abs(new[k] - exact_new).max())
            e_old = float(np.abs(old[k] - exact_old).max())
            assert np.abs(new[k] - old[k]).max() <= f32_pair_bound(e_new, e_old, exact_new), k


def test_make_lora_init_golden_reproduces_its_file(generated):
    """scripts/make_lora_init_golden.py: PEFT's initialisations draw the same statistics
    (torch's seeded generator; float64 sums of the same values, to their rounding)."""
    folder, _ = generated("lora_init")
    new, old = (json.loads(p.read_text()) for p in (folder / "lora_init_golden.json",
                                                     FIX / "qwen35" / "lora_init_golden.json"))
    assert new.keys() == old.keys() and new["rank"] == old["rank"]
    for init in ("peft", "gaussian"):
        for k, v in old[init].items():
            assert abs(new[init][k] - v) <= 1e-12 * max(1.0, abs(v)), (init, k)
