"""``model.type_policy = "auto"`` in a training run: each of the file's matrix types is kept or
dequantized to F32 by its measured step cost (``type_choice.STEP_RATIO``, copied from
bench_results/type_policy.json) and the memory budget (F32 weights within half of it); the
trainer and ``pytrain plan`` choose alike, explicit policies are left alone, and inference
(``pytrain.load_model``) keeps the file's types."""
import json
from pathlib import Path

import pytest

import pytrain
from pytrain import ggml
from pytrain.cli import main
from pytrain.config import load_config
from pytrain.models.model_file import open_model
from pytrain.train import type_choice as tc
from pytrain.train.run import _run_facts, open_session
from scripts.gguf_models import quantized_copy
from tests.test_train_cli import MODEL, write_config, write_data

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "tests" / "fixtures" / "llama"
KEY = tc.device_key("cpu", ggml.blas_enabled())     # the row a CPU run here reads


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory) -> Path:
    """The gqa llama fixture with its matrices as Q4_1 (norms F32), tokenizer and template
    unchanged: a type measured well over ``FASTER`` on both CPU rows."""
    out = tmp_path_factory.mktemp("q4_1") / "gqa-q4_1.gguf"
    return quantized_copy(LLAMA / "gqa-f32.gguf", LLAMA / "gqa-q8_0.gguf", out, "q4_1")


@pytest.fixture
def cfg(tmp_path, q4_1) -> Path:
    write_data(tmp_path, copies=1)
    c = write_config(tmp_path, batch_size=2, max_steps=1, data={"max_seq_len": 64})
    c.write_text(c.read_text().replace(str(MODEL), str(q4_1)))
    return c


def f32_and_file_bytes(path: Path) -> tuple[int, int]:
    """(bytes of every loaded tensor as F32, bytes as stored): from the file's own index."""
    _arch, _meta, infos, config = open_model(path)
    shapes = config.tensor_shapes()
    return (sum(4 * infos[n].n_elements for n in shapes),
            sum(infos[n].n_bytes for n in shapes))


def session(cfg: Path, *sets: str):
    log: list[str] = []
    s = open_session(load_config(cfg, list(sets)), cfg.parent / "out", log.append)
    return s, log


def loaded(s) -> set[tuple[str, str]]:
    return {(r.file_type, r.loaded_type) for r in s.model.weights.report.values()}


def test_the_measured_slow_type_is_dequantized_for_training(cfg, q4_1):
    """Q4_1 is measured slower kept than as F32 on this CPU's row (BLAS or not): a training
    run loads it as F32, logs why, and every rank must agree on the types."""
    assert tc.STEP_RATIO[KEY]["Q4_1"] >= tc.FASTER
    s, log = session(cfg)
    try:
        assert loaded(s) == {("Q4_1", "F32"), ("F32", "F32")}
        assert s.model.weights.loaded_bytes == f32_and_file_bytes(q4_1)[0]
        assert any("Q4_1 dequantized to F32" in line for line in log), log
        assert _run_facts(s)["weight types"] == "F32->F32, Q4_1->F32"
    finally:
        s.close()


def test_inference_keeps_the_file_types(q4_1):
    m = pytrain.load_model(q4_1, device="cpu", threads=1)
    try:
        assert {r.loaded_type for r in m.weights.report.values()} == {"Q4_1", "F32"}
    finally:
        m.close()


def test_f32_weights_over_half_the_budget_keep_the_file_types(cfg, q4_1, capsys):
    """train.memory_gib just under twice the F32 weights: kept, in the trainer and the plan;
    just over: dequantized in both."""
    f32, stored = f32_and_file_bytes(q4_1)
    for times, want in ((1.99, {("Q4_1", "Q4_1"), ("F32", "F32")}),
                        (2.01, {("Q4_1", "F32"), ("F32", "F32")})):
        gib = f"train.memory_gib={times * f32 / 2**30!r}"
        s, log = session(cfg, gib)
        try:
            assert loaded(s) == want, log
        finally:
            s.close()
        capsys.readouterr()
        main(["plan", str(cfg), "--json", "--set", gib])
        d = json.loads(capsys.readouterr().out)
        assert {(g["file_type"], g["loaded_type"]) for g in d["weights"]} == want
        assert (d["types"]["kept_bytes"], d["types"]["f32_bytes"]) == \
            ((stored, stored) if times < 2 else (stored, f32))
        assert ("over half" if times < 2 else "within half") in d["types"]["reason"]


def test_plan_shows_the_choice_and_its_memory(cfg, q4_1, capsys):
    f32, stored = f32_and_file_bytes(q4_1)
    capsys.readouterr()
    assert main(["plan", str(cfg)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("types:"))
    assert "Q4_1 dequantized to F32" in line and f"Q4_1 {tc.STEP_RATIO[KEY]['Q4_1']:.2f}x" in line
    assert f"F32 weights {f32 / 2**20:.0f} MiB (kept: {stored / 2**20:.0f} MiB)" in line
    assert "Q4_1 -> F32" in out


def test_explicit_policies_are_left_alone(cfg):
    s, log = session(cfg, 'model.type_policy="keep"')
    try:
        assert loaded(s) == {("Q4_1", "Q4_1"), ("F32", "F32")}
        assert any('model.type_policy = "keep"' in line for line in log)
    finally:
        s.close()
    s, _ = session(cfg, 'model.type_policy="f32"')
    try:
        assert loaded(s) == {("Q4_1", "F32"), ("F32", "F32")}
    finally:
        s.close()


def test_the_rule_is_the_table_and_the_threshold(q4_1, monkeypatch):
    """A type is dequantized exactly when its ratio reaches FASTER on the run's row; an
    unmeasured type or device (CUDA has no row yet) keeps the file's types."""
    _arch, _meta, infos, config = open_model(q4_1)
    shapes, big = config.tensor_shapes(), 1 << 40
    for ratio, chosen in ((tc.FASTER - 0.01, False), (tc.FASTER, True), (None, False)):
        monkeypatch.setattr(tc, "STEP_RATIO", {"cpu+blas": {} if ratio is None else
                                               {"Q4_1": ratio}})
        c = tc.choose("cpu+blas", infos, shapes, "auto", big, "test")
        assert bool(c.dequantize) is chosen, c.reason
        assert c.measured == {"Q4_1": ratio}
    assert not tc.choose("cuda", infos, shapes, "auto", big, "test").dequantize


def test_the_table_is_the_committed_measurement():
    """STEP_RATIO holds the synthetic rows of bench_results/type_policy.json (keep/f32 step
    time, median of the rounds' ratios, 2 decimals): what the rule reads was measured."""
    r = json.loads((ROOT / "bench_results" / "type_policy.json").read_text())
    measured: dict[str, dict[str, float]] = {}
    for x in r["synthetic"]:
        key = tc.device_key("cpu", x["blas"])
        measured.setdefault(key, {})[x["type"]] = round(x["sides"]["f32"]["keep_over_this"], 2)
    assert tc.STEP_RATIO == measured


def test_the_table_rows_are_real_types():
    for row in tc.STEP_RATIO.values():
        for name, ratio in row.items():
            assert name.lower() in {k.lower() for k in ggml.TYPES} and ratio > 0
