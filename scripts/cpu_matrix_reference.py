"""The CPU matrix's reference cells: the goldens regenerated with torch on other kernel paths of
this machine, and the tests that read them (scripts/test_cpu_matrix.py's ``--ref``).

Why: the committed goldens (tests/fixtures/*/*.npz) hold the float32 rounding of torch +
transformers + PEFT + TRL on the CPU that made them: MKL's sgemm, oneDNN's convolutions and
ATen's vectorised loops each sum in their own order, and they pick their kernels by CPU.  A test
that holds a committed golden to a value made now on another CPU passes only if its bound
covers both machines' rounding; CI on an Intel AMX machine once proved one did not.  Each
reference cell sets library switches that make torch take another kernel path here, then

(a) runs the golden-reproduction tests (tests/test_scripts_reference.py: the generators run
    under the reference interpreter, which inherits the cell's environment) against the
    committed goldens, and
(b) regenerates the float32 goldens the parity tests read into a copy of the checkout, with
    the cell's setting, and runs the parity tests there: pytrain against goldens made on
    kernels other than the committed ones'.

The switches (``KNOBS``) are read by the libraries when they load: ``MKL_CBWR`` (MKL's
conditional numerical reproducibility branch: ``COMPATIBLE`` is its SSE2-level code path),
``MKL_ENABLE_INSTRUCTIONS`` (the highest ISA MKL may dispatch to; MKL honours it on Intel CPUs
only), ``ONEDNN_MAX_CPU_ISA`` (oneDNN's, e.g. AVX2, AVX512_CORE, AVX512_CORE_AMX) and
``ATEN_CPU_CAPABILITY`` (torch's own kernels: avx512, avx2, default).  Which of them change
anything depends on the CPU, so ``auto`` probes each candidate with scripts/reference_kernels.py
and keeps the ones whose float32 bits differ from the plain run's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "scripts" / "reference_kernels.py"

# every variable a cell may set; a cell's environment has none of them but its own, so a value
# left in the caller's shell never leaks into another cell
KNOBS = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "ONEDNN_MAX_CPU_ISA",
         "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

# what ``--ref auto`` tries: each alone, the libraries' other code paths for float32
CANDIDATES = ("MKL_CBWR=COMPATIBLE", "MKL_CBWR=AVX2", "MKL_CBWR=AVX512",
              "MKL_ENABLE_INSTRUCTIONS=AVX2", "MKL_ENABLE_INSTRUCTIONS=SSE4_2",
              "ONEDNN_MAX_CPU_ISA=AVX512_CORE", "ONEDNN_MAX_CPU_ISA=AVX2",
              "ONEDNN_MAX_CPU_ISA=AVX", "ATEN_CPU_CAPABILITY=avx2",
              "ATEN_CPU_CAPABILITY=default")

# the goldens the parity tests read, by the generator that makes each (run from the copy's root,
# writing into its tests/fixtures by default): phase 0 makes the models' own goldens, which the
# phase-1 generators rebuild their models against
GOLDENS = {
    "qwen35": (0, ["scripts.make_qwen35_fixtures"]),
    "llama": (0, ["scripts.make_llama_fixtures"]),   # llama, qwen2, qwen3, gemma3
    "peft_golden": (1, ["scripts.make_peft_golden"]),
    "peft_rslora": (1, ["scripts.make_peft_golden", "--variant", "rslora"]),
    "loraplus": (1, ["scripts.make_loraplus_golden"]),
    "pref_golden": (1, ["scripts.make_pref_golden"]),
    "peft_logits": (1, ["scripts.make_peft_logits_golden"]),
}

REPRODUCTION = ["tests/test_scripts_reference.py"]
PARITY = ["tests/test_peft_parity.py", "tests/test_preference_trl.py",
          "tests/test_lora_variants.py", "tests/test_peft_adapter.py",
          "tests/test_family_parity.py", "tests/test_llama_parity.py",
          "tests/test_qwen35_parity.py"]


def parse_setting(spec: str) -> dict[str, str]:
    """``plain`` -> {}; ``NAME=VALUE+NAME2=VALUE2`` -> those variables."""
    if spec == "plain":
        return {}
    env = {}
    for part in spec.split("+"):
        name, eq, value = part.partition("=")
        if not eq or not name or not value:
            raise ValueError(f"--ref: {spec!r}: each cell is 'plain' or NAME=VALUE joined "
                             f"with '+' (e.g. MKL_CBWR=COMPATIBLE+ATEN_CPU_CAPABILITY=avx2)")
        env[name] = value
    return env


def cell_env(setting: dict[str, str], ref_python: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update(setting, PYTRAIN_REF_PYTHON=ref_python, PYTRAIN_REQUIRE_REF="1")
    return env


def probe(ref_python: str, setting: dict[str, str]) -> dict:
    """scripts/reference_kernels.py's record under ``setting`` (ops, rng, kernels)."""
    import json
    from scripts.reference_kernels import MARK
    r = subprocess.run([ref_python, str(PROBE)], env=cell_env(setting, ref_python),
                       capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(MARK)), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"the reference kernel probe failed under {setting or 'no setting'}:"
                         f"\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def changes(rec: dict, plain: dict) -> list[str]:
    """The operations whose float32 bits differ from the plain run's."""
    return [op for op, h in rec["ops"].items() if plain["ops"].get(op) != h]


def choose(ref_python: str, plain: dict, candidates=CANDIDATES) -> tuple[list[str], list[dict]]:
    """``auto``: the candidates worth a cell here, and a record of every candidate probed.  A
    candidate is dropped when it changes no float32 result (no other kernel path here), when it
    gives the same bits as one kept already, or when it changes torch's seeded draws (the
    generators' models would then be other models, not the same ones rounded otherwise)."""
    kept, seen, probed = [], {}, []
    for spec in candidates:
        rec = probe(ref_python, parse_setting(spec))
        changed = changes(rec, plain)
        bits = tuple(sorted(rec["ops"].items()))
        if rec["rng"] != plain["rng"]:
            why = "changes torch's seeded random draws (the goldens' inputs)"
        elif not changed:
            why = "changes no float32 result here"
        elif bits in seen:
            why = f"same bits as {seen[bits]}"
        else:
            why = ""
            kept.append(spec)
            seen[bits] = spec
        probed.append({"kind": "probed", "setting": spec, "changes": changed, "dropped": why,
                       "kernels": rec["kernels"]})
    return kept, probed


def kernels_text(k: dict) -> str:
    """One line naming the reference's kernels, in the libraries' own words."""
    mkl = k.get("mkl") or "?"
    sgemm = "sgemm by MKL" if k.get("sgemm_by_mkl") else f"sgemm by {k.get('blas', '?')}"
    impls = ", ".join(i.split(" ", 1)[1] for i in k.get("onednn_impls", []))
    return (f"torch {k.get('torch', '?')}: ATen {k.get('aten', '?')}; {sgemm}, {mkl}, "
            f"CNR {k.get('mkl_cnr') or '?'}; oneDNN {k.get('onednn') or '?'} "
            f"({k.get('onednn_isa') or '?'}): {impls or 'none ran'}")


def copy_checkout(dest: Path) -> Path:
    """The checkout under test as a plain folder: tracked files and the untracked ones git does
    not ignore (the commit plus uncommitted changes), symbolic links kept as links to what
    they point at, and pytrain's native build (ignored by git) linked in."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    native = [p.relative_to(ROOT) for p in (ROOT / "pytrain" / "_native").glob("*")
              if p.name == "lib" or p.name == "build_info.json" or p.name.startswith("_ggml")]
    for rel in [f for f in files if f] + [str(p) for p in native]:
        src, dst = ROOT / rel, dest / rel
        if dst.exists() or dst.is_symlink() or not (src.exists() or src.is_symlink()):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink() or src.is_dir():
            dst.symlink_to(src.resolve())
        else:
            shutil.copy2(src, dst)
    return dest


def regenerate(tree: Path, names: list[str], env: dict[str, str], ref_python: str,
               logs: Path) -> dict:
    """Runs the chosen generators in ``tree``, phase by phase, as many at once as there are
    cores (each runs one torch thread); restores every fixture that is not a golden from the
    committed copy after each phase (module docstring of compare_fixtures)."""
    out: dict = {"generators": {}, "not_reproduced": {}}
    env = {**env, "PYTHONPATH": str(tree)}
    since = time.time() - 1

    def one(name: str) -> None:
        t0 = time.monotonic()
        log = logs / f"{name}.log"
        with open(log, "w") as fh:
            rc = subprocess.run([ref_python, "-m", *GOLDENS[name][1]], cwd=tree, env=env,
                                stdout=fh, stderr=subprocess.STDOUT).returncode
        out["generators"][name] = {"exit": rc, "seconds": round(time.monotonic() - t0),
                                   "tail": "" if rc == 0 else log.read_text()[-3000:]}

    for phase in sorted({GOLDENS[n][0] for n in names}):
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(one, [n for n in names if GOLDENS[n][0] == phase]))
        out["not_reproduced"].update(restore_non_goldens(tree))
    out["goldens"] = compare_goldens(tree, since)
    return out


def is_golden(rel: Path) -> bool:
    """The reference's float32 outputs: every .npz but the float64 numpy references."""
    return rel.suffix == ".npz" and not rel.name.endswith(".f64.npz")


def restore_non_goldens(tree: Path) -> dict[str, str]:
    """Everything else a generator writes (GGUF files, tokenizers, PEFT folders, float64
    references) must come out byte for byte as committed: the generators are deterministic and
    none of it is float32 arithmetic of torch.  A file that differs is reported and replaced by
    the committed one, so the parity tests read the committed models."""
    found = {}
    fix = ROOT / "tests" / "fixtures"
    for new in sorted((tree / "tests" / "fixtures").rglob("*")):
        rel = new.relative_to(tree / "tests" / "fixtures")
        old = fix / rel
        if new.is_dir() or is_golden(rel) or not old.exists() or \
                new.read_bytes() == old.read_bytes():
            continue
        found[str(rel)] = describe_difference(new, old)
        shutil.copy2(old, new)
    return found


def describe_difference(new: Path, old: Path) -> str:
    if new.suffix != ".gguf":
        return f"{new.stat().st_size} bytes against {old.stat().st_size} committed"
    from pytrain.formats.gguf_meta import metadata_from_reader, open_gguf
    a, b = open_gguf(new), open_gguf(old)
    ta = {t.name: bytes(a.data[t.data_offset: t.data_offset + t.n_bytes]) for t in a.tensors}
    tb = {t.name: bytes(b.data[t.data_offset: t.data_offset + t.n_bytes]) for t in b.tensors}
    ma, mb = metadata_from_reader(a), metadata_from_reader(b)
    keys = sorted(k for k in set(ma) | set(mb) if ma.get(k, "∅") != mb.get(k, "∅"))
    tensors = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
    return (f"tensors {'identical' if not tensors else 'differ: ' + ', '.join(tensors[:4])}; "
            f"metadata {'identical' if not keys else 'differs: ' + ', '.join(keys[:4])}")


def compare_goldens(tree: Path, since: float) -> dict[str, str]:
    """For each golden written since ``since``: how many of its arrays differ from the
    committed file's (the float32 rounding of the cell's kernels, when the tests pass)."""
    import numpy as np
    fix = ROOT / "tests" / "fixtures"
    out = {}
    for new in sorted((tree / "tests" / "fixtures").rglob("*.npz")):
        rel = new.relative_to(tree / "tests" / "fixtures")
        if not is_golden(rel) or not (fix / rel).exists() or new.stat().st_mtime < since:
            continue
        a, b = np.load(new), np.load(fix / rel)
        keys = sorted(set(a.files) | set(b.files))
        diff = sum(1 for k in keys if k not in a.files or k not in b.files
                   or a[k].shape != b[k].shape or not np.array_equal(a[k], b[k]))
        out[str(rel)] = f"{diff} of {len(keys)}"
    return out
