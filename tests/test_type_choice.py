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
from pytrain.run import type_choice as tc
from pytrain.run.loop import _run_facts, open_session
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


def weight_bytes(path: Path) -> dict[str, int]:
    """The loaded tensors' bytes as stored, with the quantized matrices as F32 and as F16
    (norms F32 either way): from the file's own index."""
    _arch, _meta, infos, config = open_model(path)
    mats = [infos[n] for n in config.tensor_shapes() if infos[n].type_name != "F32"]
    vecs = [infos[n] for n in config.tensor_shapes() if infos[n].type_name == "F32"]
    rest = sum(i.n_bytes for i in vecs)
    return {"stored": rest + sum(i.n_bytes for i in mats),
            "F32": rest + sum(4 * i.n_elements for i in mats),
            "F16": rest + sum(2 * i.n_elements for i in mats)}


def session(cfg: Path, *sets: str):
    log: list[str] = []
    s = open_session(load_config(cfg, list(sets)), cfg.parent / "out", log.append)
    return s, log


def loaded(s) -> set[tuple[str, str]]:
    return {(r.file_type, r.loaded_type) for r in s.model.weights.report.values()}


def test_the_measured_slow_type_is_dequantized_for_training(cfg, q4_1):
    """Q4_1 is measured slower kept than as F32 on this CPU's row (BLAS or not): a training
    run loads it as F32, logs why, and every rank must agree on the types."""
    assert tc.STEP_RATIO[KEY]["Q4_1"][0] >= tc.FASTER
    s, log = session(cfg)
    try:
        assert loaded(s) == {("Q4_1", "F32"), ("F32", "F32")}
        assert s.model.weights.loaded_bytes == weight_bytes(q4_1)["F32"]
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


def test_the_memory_budget_picks_f32_f16_or_the_file_types(cfg, q4_1, capsys):
    """Q4_1 is measured slower kept than as F32 and as F16: F32 while its weights fit in half
    of train.memory_gib, else F16 while those fit, else kept; the trainer and the plan agree."""
    assert min(tc.STEP_RATIO[KEY]["Q4_1"]) >= tc.FASTER
    size = weight_bytes(q4_1)
    for budget, want in ((2.01 * size["F32"], "F32"), (1.99 * size["F32"], "F16"),
                         (2.01 * size["F16"], "F16"), (1.99 * size["F16"], "Q4_1")):
        gib = f"train.memory_gib={budget / 2**30!r}"
        s, log = session(cfg, gib)
        try:
            assert loaded(s) == {("Q4_1", want), ("F32", "F32")}, log
            assert s.model.weights.loaded_bytes == size.get(want, size["stored"])
        finally:
            s.close()
        capsys.readouterr()
        main(["plan", str(cfg), "--json", "--set", gib])
        d = json.loads(capsys.readouterr().out)
        assert {(g["file_type"], g["loaded_type"]) for g in d["weights"]} == \
            {("Q4_1", want), ("F32", "F32")}
        t = d["types"]
        assert t["option_bytes"] == {"F32": size["F32"], "F16": size["F16"]}
        assert t["kept_bytes"] == size["stored"]
        assert t["chosen_bytes"] == d["weight_bytes"] == size.get(want, size["stored"])
        assert ("over half" in t["reason"]) is (want != "F32"), t["reason"]


def test_plan_shows_the_choice_and_its_memory(cfg, q4_1, capsys):
    size = weight_bytes(q4_1)
    capsys.readouterr()
    assert main(["plan", str(cfg)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("types:"))
    assert "Q4_1 dequantized to F32" in line and f"Q4_1 {tc.STEP_RATIO[KEY]['Q4_1'][0]:.2f}x" in line
    assert f"F32 weights {size['F32'] / 2**20:.0f} MiB (kept: {size['stored'] / 2**20:.0f} MiB)" \
        in line
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
    """A type is dequantized exactly when its ratio reaches FASTER on the run's row (to F32
    before F16); an unmeasured type or device (CUDA has no row yet) keeps the file's types."""
    from pytrain.models.weights import F16, F32
    _arch, _meta, infos, config = open_model(q4_1)
    shapes, big, q = config.tensor_shapes(), 1 << 40, ggml.TYPES["q4_1"]
    below, at = tc.FASTER - 0.01, tc.FASTER
    for ratios, want in (((below, below), {}), ((at, below), {q: F32}), ((below, at), {q: F16}),
                         ((at, at), {q: F32}), ((at, None), {q: F32}), (None, {})):
        monkeypatch.setattr(tc, "STEP_RATIO", {"cpu+blas": {} if ratios is None else
                                               {"Q4_1": ratios}})
        c = tc.choose("cpu+blas", infos, shapes, "auto", big, "test")
        assert c.dequantize == want, c.reason
        assert c.measured == {"Q4_1": ratios}
    assert not tc.choose("cuda", infos, shapes, "auto", big, "test").dequantize
    assert not tc.choose("cpu+blas", infos, shapes, "keep", big, "test").dequantize


def test_the_table_is_the_committed_measurement():
    """STEP_RATIO holds the synthetic rows of bench_results/type_policy.json (keep's step time
    over F32's and F16's, medians of the rounds' ratios, 2 decimals): the rule reads what was
    measured."""
    r = json.loads((ROOT / "bench_results" / "type_policy.json").read_text())
    measured: dict[str, dict] = {}
    for x in r["synthetic"]:
        s = x["sides"]
        f16 = s["f16"]["keep_over_this"] if "f16" in s else None
        measured.setdefault(x["device"], {})[x["type"]] = (
            round(s["f32"]["keep_over_this"], 2), None if f16 is None else round(f16, 2))
    assert tc.STEP_RATIO == measured


def test_the_table_rows_are_real_types():
    for row in tc.STEP_RATIO.values():
        for name, (f32, f16) in row.items():
            assert name.lower() in {k.lower() for k in ggml.TYPES} and f32 > 0
            assert f16 is None if name == "F16" else (f16 is None or f16 > 0)


def test_eval_loads_the_weights_as_the_run_did(cfg, q4_1, capsys, monkeypatch):
    """The run above computes its validation on Q4_1 loaded as F32; the adapter it writes
    records that, and ``pytrain eval`` and ``pytrain.load(...).eval`` of it load the weights
    so too and give the run's last validation loss.  Bound: the same graph, kernels, weights,
    threads and batches, so the same float32 operations; ``bounds.ulps`` of the loss allows
    the few units of rounding a scale alpha/r read back from the adapter's float32 alpha could
    cost.  With the file's Q4_1 kept (activations rounded to 8 bits) the loss moves far more
    than that, and eval says why and which setting loads the weights as the run did: when
    asked for other types, and when the run's types do not fit in memory now."""
    from bounds import ulps
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_steps=2",
                 "--set", "train.eval_every=1"]) == 0
    out = cfg.parent / "out"
    valid = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [r for r in valid if r.get("split") == "valid"][-1]["loss"]
    adapter = out / "adapter.gguf"
    c = load_config(cfg)
    with pytrain.load(q4_1, adapter, device="cpu", threads=c.model.threads) as m:
        ev = m.eval(c.data, batch_size=c.train.batch_size)
        assert abs(ev.loss - want) <= ulps(want), (ev.loss, want)
        assert {(r.file_type, r.loaded_type) for r in m.model.weights.report.values()} == \
            {("Q4_1", "F32"), ("F32", "F32")}
    capsys.readouterr()
    assert main(["eval", str(cfg), "--adapter", str(adapter)]) == 0
    said = capsys.readouterr()
    assert f"loss {ev.loss:.4f}" in said.out and "note" not in said.err, said
    # the file's types kept: another number, and eval says so and how to match the run
    with pytrain.load(q4_1, adapter, device="cpu", threads=c.model.threads,
                      type_policy="keep") as m:
        with pytest.warns(UserWarning, match=r"Q4_1 -> F32.*type_policy") as w:
            kept = m.eval(c.data, batch_size=c.train.batch_size)
    print(f"\nrun {want!r}, eval {ev.loss!r}, kept Q4_1 {kept.loss!r}: {w[0].message}")
    assert abs(kept.loss - want) > 100 * ulps(want)
    assert main(["eval", str(cfg), "--adapter", str(adapter),
                 "--set", 'model.type_policy="keep"']) == 0
    err = capsys.readouterr().err
    assert err.startswith("note: ") and "Q4_1 -> F32" in err and 'model.type_policy = "auto"' \
        in err, err
    monkeypatch.setattr(tc, "runtime_budget", lambda rt, gib, share=1: (2**20, "test memory"))
    with pytrain.load(q4_1, adapter, device="cpu", threads=c.model.threads) as m:
        with pytest.warns(UserWarning, match=r"Q4_1 -> F32, here they are Q4_1 \(its types "
                          r"need 1 MiB of weights, over half of the 1 MiB of test memory\).*"
                          r'type_policy "f32"'):
            assert m.eval(c.data, batch_size=c.train.batch_size).loss == kept.loss


def test_generate_loads_the_weights_as_the_run_did_unless_told(cfg, q4_1, capsys, monkeypatch):
    """``pytrain generate --adapter`` reproduces the run's samples by loading the base as the
    adapter's run did (Q4_1 as F32 here); ``--type-policy keep`` keeps the file's Q4_1 (a
    faster decode in less memory), as a user may prefer for generation."""
    from pytrain import api
    assert main(["train", str(cfg), "--no-progress"]) == 0
    adapter = cfg.parent / "out" / "adapter.gguf"
    loaded = []
    real_load = api.load

    def load(*a, **k):             # the real load; the types it loaded are noted
        m = real_load(*a, **k)
        loaded.append({(r.file_type, r.loaded_type) for r in m.model.weights.report.values()})
        return m
    monkeypatch.setattr(api, "load", load)
    common = ["generate", str(q4_1), "--adapter", str(adapter), "--raw", "--prompt", "the",
              "--max-new-tokens", "2", "--device", "cpu", "--threads", "1"]
    assert main(common) == 0
    assert main(common + ["--type-policy", "keep"]) == 0
    assert [("Q4_1", "F32") in t for t in loaded] == [True, False]
    assert ("Q4_1", "Q4_1") in loaded[1]
