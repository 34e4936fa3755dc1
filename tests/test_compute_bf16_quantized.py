"""``train.compute_type = "bf16"`` on a quantized model: a quantized matrix type becomes BF16
copies (dequantized, rounded to nearest even) where a bf16 step was measured ``FASTER`` so
(``type_choice.BF16_STEP_RATIO``) and the copies fit in half the memory budget; else it is
kept, and the log and ``pytrain plan`` say which, per type, never claiming bf16 products that
do not happen.  ``model.type_policy = "keep"`` keeps the quantized types.  A step with the
copies is the f32 step (the same file's values as F32) within bf16's own rounding bound."""
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

import pytrain
from pytrain import ggml
from pytrain.cli import main
from pytrain.config import load_config
from pytrain.models import precision
from pytrain.models.model_file import open_model
from pytrain.models.weights import BF16
from pytrain.run import type_choice as tc
from pytrain.run.loop import open_session
from scripts.gguf_models import quantized_copy
from tests.test_compute_bf16 import U_BF16, depth, needs_onednn_bf16, step
from tests.test_recompute import packed_batch
from tests.test_train_cli import MODEL, write_config, write_data

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
Q4_1, Q8_0 = ggml.TYPES["q4_1"], ggml.TYPES["q8_0"]
BIG = 1 << 40
pytestmark = pytest.mark.skipif(os.environ.get("PYTRAIN_BLAS", "1") in ("", "0"),
                                reason="PYTRAIN_BLAS=0: bf16 compute needs the BLAS backend")


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory) -> Path:
    """The qwen35 gqa fixture with its quantized matrices (Q8_0 in gqa-q8_0.gguf) as Q4_1."""
    out = tmp_path_factory.mktemp("q4_1") / "gqa-q4_1.gguf"
    return quantized_copy(FIX / "gqa-f32.gguf", FIX / "gqa-q8_0.gguf", out, "q4_1")


def index(path: Path, mixed: bool = False):
    """(the file's tensor index, the shapes a model loads); ``mixed``: the index with the
    first two quantized matrices claimed as Q8_0 (a file of two quantized types, for the
    rule alone: nothing is loaded from it)."""
    _arch, _meta, infos, config = open_model(path)
    shapes = config.tensor_shapes()
    if mixed:
        infos = dict(infos)
        for n in [n for n in shapes if infos[n].type == Q4_1][:2]:
            i = infos[n]
            infos[n] = dataclasses.replace(i, type=Q8_0,
                                           n_bytes=i.n_bytes * 34 // 20)   # 34 B per 32, not 20
    return infos, shapes


def bf16_bytes(infos, shapes) -> tuple[int, int, int]:
    """(the loaded weights with the quantized matrices kept, as BF16, how many are quantized):
    from the index; float matrices BF16 and vectors F32 either way."""
    from pytrain.formats.gguf_tensors import is_elementwise
    kept = copies = n = 0
    for name, s in shapes.items():
        i = infos[name]
        if is_elementwise(name, tuple(s)):
            size = 4 * i.n_elements
            kept, copies = kept + size, copies + size
        elif i.type in (Q4_1, Q8_0):
            kept, copies, n = kept + i.n_bytes, copies + 2 * i.n_elements, n + 1
        else:
            kept, copies = kept + 2 * i.n_elements, copies + 2 * i.n_elements
    return kept, copies, n


# ----------------------------------------------------------------------------- the rule alone

def test_the_bf16_rule_is_the_table_and_the_threshold(q4_1, monkeypatch):
    """A quantized type becomes BF16 exactly when its ratio reaches FASTER; an unmeasured
    type or a device without a row keeps; keep keeps; the reason names each type's outcome
    and its matrix count; the f32 rule (STEP_RATIO) plays no part."""
    infos, shapes = index(q4_1)
    _kept, _copies, n = bf16_bytes(infos, shapes)
    monkeypatch.setattr(tc, "STEP_RATIO", {})
    for ratio, want in ((tc.FASTER - 0.01, {}), (tc.FASTER, {Q4_1: BF16}), (None, {})):
        monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {} if ratio is None else
                                                    {"Q4_1": ratio}})
        c = tc.choose("cpu+blas", infos, shapes, "auto", BIG, "test", "bf16")
        assert c.dequantize == want and c.compute_type == "bf16", c.reason
        assert c.measured == {"Q4_1": ratio}
        if want:
            assert f"Q4_1 -> BF16 ({n} matrices: a bf16 step measured {ratio:.2f}x faster)" \
                in c.reason, c.reason
        else:
            assert f"kept Q4_1 ({n} matrices: " in c.reason and "-> BF16" not in c.reason
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q4_1": 2.0}})
    assert not tc.choose("cpu", infos, shapes, "auto", BIG, "test", "bf16").dequantize
    c = tc.choose("cpu+blas", infos, shapes, "keep", BIG, "test", "bf16")
    assert not c.dequantize and f'kept Q4_1 ({n} matrices: model.type_policy = "keep")' \
        in c.reason, c.reason
    # the f32 rule would take Q4_1 to F32; under f32 compute it still does
    monkeypatch.setattr(tc, "STEP_RATIO", {"cpu+blas": {"Q4_1": (2.0, None)}})
    assert tc.choose("cpu+blas", infos, shapes, "auto", BIG, "test").dequantize == \
        {Q4_1: ggml.lib.GGML_TYPE_F32}


def test_the_bf16_copies_must_fit_in_half_the_budget(q4_1, monkeypatch):
    """Mirroring the F32 rule: the BF16 copies are made while the weights so loaded fit in
    half of the budget, else the file's types are kept and the reason says by how much; the
    byte counts are the index's."""
    infos, shapes = index(q4_1)
    kept, copies, n = bf16_bytes(infos, shapes)
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q4_1": 1.5}})
    for budget, fits in ((2 * copies, True), (2 * copies - 2, False)):
        c = tc.choose("cpu+blas", infos, shapes, "auto", budget, "train.memory_gib", "bf16")
        assert c.kept_bytes == kept and c.option_bytes == {"BF16": copies}
        assert c.chosen_bytes == (copies if fits else kept)
        assert c.dequantize == ({Q4_1: BF16} if fits else {}), c.reason
        assert ("within half" in c.reason) is fits and ("over half" in c.reason) is not fits
        if not fits:
            assert c.reason.startswith(f'compute bf16, type_policy = "auto": kept Q4_1 ({n} '
                                       f'matrices: BF16 weights '), c.reason
            assert "though a bf16 step measured 1.50x faster so" in c.reason


def test_a_file_of_two_quantized_types_gets_a_line_per_type(q4_1, monkeypatch):
    infos, shapes = index(q4_1, mixed=True)
    _kept, _copies, n = bf16_bytes(infos, shapes)
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q4_1": 1.5, "Q8_0": 1.02}})
    c = tc.choose("cpu+blas", infos, shapes, "auto", BIG, "test", "bf16")
    assert c.dequantize == {Q4_1: BF16}
    assert c.reason.startswith(
        f'compute bf16, type_policy = "auto": Q4_1 -> BF16 ({n - 2} matrices: a bf16 step '
        f'measured 1.50x faster); kept Q8_0 (2 matrices: a bf16 step measured 1.02x as fast '
        f'with BF16 copies: not {tc.FASTER:.2f}x faster); BF16 weights '), c.reason
    assert json.loads(json.dumps(c.to_dict()))["dequantize"] == {"Q4_1": "BF16"}


def test_the_compute_line_says_what_each_matrix_became():
    """``precision.with_matrices``: all BF16 leaves the line as it is; some kept counts each
    kind (BF16 by source type) and names the kernels of the kept ones; none BF16 replaces the
    claim of BF16 matrices through oneDNN by what happens, with a warning."""
    line = "compute bf16: BF16 weight matrices through oneDNN's K (avx512_bf16)"
    mixed = [("F32", "BF16")] * 3 + [("Q4_1", "BF16")] * 5 + [("Q8_0", "Q8_0")]
    assert precision.with_matrices(line, mixed) == (
        f"{line}; weight matrices: 3 F32 -> BF16, 5 Q4_1 -> BF16, 1 kept Q8_0 (ggml-cpu's Q8_0 "
        f"kernels multiply it, as under f32)")
    assert precision.with_matrices(line, mixed[:8]) == line
    first, warning = precision.with_matrices(line, [("Q8_0", "Q8_0")] * 31).split("\n")
    assert first.startswith("compute bf16: no weight matrix is BF16 (31 kept Q8_0): ggml-cpu's "
                            "Q8_0 kernels multiply them"), first
    assert "through oneDNN" not in first and "bf16 applies to none" in first
    assert warning.startswith("warning: bf16 compute does not apply to this model's 31 "
                              "matrices kept as Q8_0")


def test_bf16_accepts_type_policy_keep_and_refuses_f32():
    assert precision.type_policy_for("bf16", "keep") == "bf16"
    with pytest.raises(precision.ComputeTypeError, match="must be auto or keep"):
        precision.type_policy_for("bf16", "f32")


# ----------------------------------------------------------------------------- real runs

@needs_onednn_bf16
def test_a_bf16_step_with_bf16_copies_is_the_f32_step_within_bf16_rounding(q4_1, monkeypatch):
    """The Q4_1 matrices as BF16 copies (dequantized, then rounded: one rounding of each
    weight, as F32 -> BF16 is) against the f32 step on the same values as F32: the loss
    within depth x 2^-8 relative and each LoRA gradient within twice that in norm, the bound
    of test_compute_bf16 (each product's two operands rounded to bf16 once)."""
    from pytrain.models.model import load_model
    monkeypatch.setattr(pytrain, "load_model", load_model)    # the one taking ``dequantize``
    tokens, seg, tgt = packed_batch()
    f32, types32, n_layer = step(q4_1, "f32", tokens, seg, tgt, type_policy="f32")
    b16, types16, _ = step(q4_1, "bf16", tokens, seg, tgt, dequantize={Q4_1: BF16})
    assert {types32[n] for n in types32} == {"F32"}
    assert {types16[n] for n in types16 if n.endswith("attn_q.weight")} == {"BF16"}
    assert "Q4_1" not in types16.values()
    assert b16["n_valid"] == f32["n_valid"] > 0
    d = depth(n_layer)
    assert abs(b16["loss"] - f32["loss"]) <= d * U_BF16 * abs(f32["loss"]), (b16["loss"],
                                                                            f32["loss"])
    assert b16["loss"] != f32["loss"]
    for name, g in f32["grads"].items():
        err = np.linalg.norm(b16["grads"][name] - g)
        assert err <= 2 * d * U_BF16 * np.linalg.norm(g), (name, err, np.linalg.norm(g))


def bf16_config(tmp_path: Path, model: Path) -> Path:
    write_data(tmp_path, copies=1)
    c = write_config(tmp_path, batch_size=2, max_steps=2, compute_type="bf16",
                     data={"max_seq_len": 64})
    c.write_text(c.read_text().replace(str(MODEL), str(model)))
    return c


@needs_onednn_bf16
def test_a_run_trains_on_bf16_copies_and_says_so(q4_1, tmp_path, capsys, monkeypatch):
    """With Q4_1 measured faster as BF16 copies: the run loads them, logs per type what each
    matrix became, its compute line claims BF16 products only for BF16 matrices, ``pytrain
    plan`` says the same, the adapter records Q4_1 -> BF16 with compute bf16, and
    ``pytrain.load`` of the adapter loads the copies again and gives the run's validation
    loss (the same graph and kernels: a few float32 ulps for alpha/r read back)."""
    from bounds import ulps
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q4_1": 1.5}})
    cfg = bf16_config(tmp_path, q4_1)
    log: list[str] = []
    s = open_session(load_config(cfg), tmp_path / "out", log.append)
    try:
        mats = {(r.file_type, r.loaded_type) for r in s.model.weights.report.values()}
        assert mats == {("Q4_1", "BF16"), ("F32", "F32")}, mats
    finally:
        s.close()
    weights = [line for line in log if line.startswith("weights: compute bf16")]
    assert len(weights) == 1 and "Q4_1 -> BF16 (" in weights[0] and "kept Q" not in weights[0]
    compute = [line for line in log if line.startswith("compute ")]
    assert compute == [precision.check("bf16", "cpu", True)], compute   # every matrix BF16
    capsys.readouterr()
    assert main(["plan", str(cfg)]) == 0
    out = capsys.readouterr().out
    said = weights[0].removeprefix("weights: ").split("; BF16 weights")[0]   # the budget moves
    assert "Q4_1 -> BF16" in out and said in out, out
    assert main(["train", str(cfg), "--no-progress", "--set", "train.eval_every=1"]) == 0
    run = tmp_path / "out"
    rec = tc.read_record(run / "adapter.gguf")
    assert rec == {"compute_type": "bf16", "matrices": {"Q4_1": "BF16"}}, rec
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = [r for r in valid if r.get("split") == "valid"][-1]["loss"]
    c = load_config(cfg)
    with pytrain.load(q4_1, run / "adapter.gguf", device="cpu", threads=c.model.threads) as m:
        assert {(r.file_type, r.loaded_type) for r in m.model.weights.report.values()} == \
            {("Q4_1", "BF16"), ("F32", "F32")}
        ev = m.eval(c.data, batch_size=c.train.batch_size)
    assert abs(ev.loss - want) <= ulps(want), (ev.loss, want)


@needs_onednn_bf16
def test_keep_keeps_the_quantized_types_and_the_log_claims_no_bf16(q4_1, tmp_path,
                                                                   monkeypatch):
    """``model.type_policy = "keep"`` under bf16: Q4_1 kept whatever the table says, the
    weights line says why, and the compute line says no matrix is BF16, with a warning."""
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q4_1": 1.5}})
    cfg = bf16_config(tmp_path, q4_1)
    log: list[str] = []
    s = open_session(load_config(cfg, ['model.type_policy="keep"']), tmp_path / "out",
                     log.append)
    try:
        mats = {(r.file_type, r.loaded_type) for r in s.model.weights.report.values()}
    finally:
        s.close()
    assert mats == {("Q4_1", "Q4_1"), ("F32", "F32")}, mats
    assert any('kept Q4_1' in x and 'model.type_policy = "keep"' in x for x in log), log
    compute = next(x for x in log if x.startswith("compute "))
    assert compute.startswith("compute bf16: no weight matrix is BF16 (") and \
        "through oneDNN" not in compute, compute


def test_the_bf16_table_is_backed_by_the_committed_measurements():
    """Every type BF16_STEP_RATIO holds was measured in bench_results/type_policy_bf16*.json
    (bf16-keep's step time over bf16's, median of the rounds' ratios), and its figure is the
    lowest of those medians: on a machine shared with other work the table may be more
    conservative than one noisy run, never bolder than any."""
    root = Path(__file__).resolve().parent.parent
    measured: dict[tuple[str, str], list[float]] = {}
    for f in sorted((root / "bench_results").glob("type_policy_bf16*.json")):
        for x in json.loads(f.read_text())["synthetic"]:
            if "bf16" in x["sides"]:
                measured.setdefault((x["device"], x["type"]), []).append(
                    round(x["sides"]["bf16"]["keep_over_this"], 2))
    assert tc.BF16_STEP_RATIO["cpu+blas"], "no measured type"
    for key, row in tc.BF16_STEP_RATIO.items():
        for name, ratio in row.items():
            assert name not in ("F32", "F16", "BF16")       # BF16 under bf16 compute anyway
            assert ratio == min(measured[key, name]), (name, ratio, measured[key, name])
