"""``train.compute_type = "bf16"``: BF16 weight matrices multiplied by oneDNN's bf16 matmul in
ggml-blas (native/patches/0018), forward (MUL_MAT) and backward (OUT_PROD).

The products are checked against float64 products of the bf16-rounded operands, within the
float32 accumulation bound (the operands are exact in bf16 and their products exact in
float32, so summation is the only rounding left); and the other operand must have been
rounded to bf16 (the documented numerics: the result is farther from the unrounded product
than that bound).  A training step in bf16 is checked against the f32 step within bf16's own
rounding times the depth of the graph, and runs, plans and errors say what they compute with.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.models import precision
from pytrain.step.graphs import GradGraph
from tests.test_recompute import adapted, packed_batch

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
F32, BF16 = lib.GGML_TYPE_F32, lib.GGML_TYPE_BF16
U32 = 2.0 ** -24               # float32 unit roundoff
U_BF16 = 2.0 ** -8             # bf16's spacing relative to a value: 2^-9 rounding, twice
pytestmark = pytest.mark.skipif(os.environ.get("PYTRAIN_BLAS", "1") in ("", "0"),
                                reason="PYTRAIN_BLAS=0: bf16 compute needs the BLAS backend")
# oneDNN 3.2 has no bf16 matmul on a CPU without AVX-512 (test_a_cpu_without_onednn_bf16_...
# checks what such a CPU does instead: BF16 weights on ggml-cpu, train.compute_type refused)
needs_onednn_bf16 = pytest.mark.skipif(
    not ggml.bf16_kernel(), reason="this CPU has no oneDNN bf16 matmul (AVX2 only)")
AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 by ggml's own conversion (round to nearest even), as float32."""
    raw = ggml.to_bytes(x.astype(np.float32), BF16, x.shape[-1])
    return ggml.decode(raw, BF16, x.size).reshape(x.shape)


def run_op(build, w: np.ndarray, x: np.ndarray, x_ne: list[int]):
    """One op on the CPU runtime with a BF16 weight ``w`` (numpy [rows, cols]) and an F32
    ``x`` (ggml ne ``x_ne``): (result, the backend the scheduler ran it on)."""
    rt = ggml.Runtime("cpu", threads=2)
    assert rt.blas is not None
    ctx = ggml.Context(n_tensors=8, graph_size=16)
    c = ctx.ptr
    tw = lib.ggml_new_tensor_2d(c, BF16, w.shape[1], w.shape[0])
    tx = lib.ggml_new_tensor(c, F32, len(x_ne), ffi.new("int64_t[]", x_ne))
    for t in (tw, tx):
        lib.ggml_set_input(t)
    out = build(c, tw, tx)
    lib.ggml_set_output(out)
    graph = ggml.new_graph(ctx, 16)
    lib.ggml_build_forward_expand(graph, out)
    rt.alloc_graph(graph, ctx)
    ggml.from_numpy(tw, w)                 # rounded to BF16 by ggml
    ggml.from_numpy(tx, x)
    rt.compute(graph)
    be = lib.ggml_backend_sched_get_tensor_backend(rt.sched, out)
    got = ggml.to_numpy(out)
    return got, ffi.string(lib.ggml_backend_name(be)).decode()


def assert_bf16_product(got, w, x, contract_w_rows: bool):
    """got == bf16(x) . bf16(w) (contracting w's columns, or its rows) to within float32
    summation, and not within that of the product with x unrounded."""
    wb, xb = bf16(w).astype(np.float64), bf16(x).astype(np.float64)
    wt = wb if contract_w_rows else wb.T
    want = xb @ wt
    k = wt.shape[0]
    bound = 1.01 * k * U32 * (np.abs(xb) @ np.abs(wt)) + 1e-30
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    unrounded = x.astype(np.float64) @ wt
    assert np.any(np.abs(got - unrounded) > bound), "the F32 operand was not rounded to bf16"


@needs_onednn_bf16
@pytest.mark.parametrize("m, k, n, batch", [(40, 96, 72, 1), (33, 64, 45, 3), (64, 200, 32, 2)])
def test_bf16_weight_mul_mat_on_blas(m, k, n, batch):
    """The forward: y = x W^T for x of any batch shape (the weight broadcast over it)."""
    rng = np.random.default_rng(m * k + n)
    w = rng.normal(size=(n, k)).astype(np.float32)          # ne [k, n]
    x = rng.normal(size=(batch, m, k)).astype(np.float32)   # ne [k, m, batch]
    got, backend = run_op(lib.ggml_mul_mat, w, x, [k, m, batch])
    assert backend == "BLAS"
    assert_bf16_product(got.reshape(batch * m, n), w, x.reshape(batch * m, k),
                        contract_w_rows=False)


@needs_onednn_bf16
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("m, k, n", [(40, 96, 72), (7, 300, 45)])
def test_bf16_weight_out_prod_on_blas(transposed, m, k, n):
    """The backward for a matmul's input: dx = g W, OUT_PROD(W, g^T) as ggml's autodiff builds
    it (the gradient transposed; also a plain src1), any size."""
    rng = np.random.default_rng(m + k + n)
    w = rng.normal(size=(k, n)).astype(np.float32)           # ne [n, k]
    g = rng.normal(size=(m, k)).astype(np.float32)           # dx rows = g rows . w
    if transposed:
        def build(c, tw, tg):
            return lib.ggml_out_prod(c, tw, lib.ggml_transpose(c, tg))
        got, backend = run_op(build, w, g, [k, m])
    else:
        got, backend = run_op(lib.ggml_out_prod, w, np.ascontiguousarray(g.T), [m, k])
    assert backend == "BLAS"
    assert_bf16_product(got.reshape(m, n), w, g, contract_w_rows=True)


@needs_onednn_bf16
def test_bf16_out_prod_over_a_long_contraction_in_slabs():
    """A contraction longer than one 64 MiB bf16 slab of the gradient (the LM head's backward
    runs over the vocabulary): the slabs' products add up in f32 (a "sum" post-op).  Small
    integers are exact in bf16 and every partial sum (|s| <= 4 k < 2^24) is exact in f32, so
    the result must equal the integer product exactly; a slab lost or counted twice cannot."""
    rng = np.random.default_rng(7)
    m, k, n = 48, (1 << 20) + 5, 32                 # 48 x 2^20 bf16 = 96 MiB: two slabs
    w = rng.integers(-2, 3, size=(k, n))
    g = rng.integers(-2, 3, size=(m, k))

    def build(c, tw, tg):
        return lib.ggml_out_prod(c, tw, lib.ggml_transpose(c, tg))
    got, backend = run_op(build, w.astype(np.float32), g.astype(np.float32), [k, m])
    assert backend == "BLAS"
    want = g.astype(np.float64) @ w.astype(np.float64)     # exact: integers below 2^53
    np.testing.assert_array_equal(got.reshape(m, n), want.astype(np.float32))


def step(path, compute_type, tokens, seg, tgt, **load) -> tuple[dict, dict, int]:
    """(GradGraph.run's loss and LoRA gradients, each weight's loaded type, the layers);
    ``load``: more ``load_model`` arguments."""
    m, ad = adapted(path, compute_type=compute_type, **load)
    try:
        g = GradGraph(m, ad, B=tokens.shape[0], T=tokens.shape[1])
        try:
            types = {r.name: r.loaded_type for r in m.weights.report.values()}
            return g.run(tokens, seg, tgt), types, m.config.n_layer
        finally:
            g.close()
    finally:
        m.close()


def depth(n_layer: int) -> int:
    """bf16 roundings on the longest path from the input to the loss: each block rounds the
    input of its mixer's projections and of the mixer's output projection, and the FFN's two
    (four products, each with its weight rounded too: 2 roundings), and the head one more."""
    return 2 * (4 * n_layer + 1)


@needs_onednn_bf16
@pytest.mark.parametrize("fixture", ["gqa-f32.gguf", "gqa-bf16.gguf"])
def test_bf16_step_is_the_f32_step_within_bf16_rounding(fixture):
    """A step's loss within depth x 2^-8 of the f32 step's (relative), and every LoRA
    gradient within twice that depth (the backward's OUT_PRODs round the gradient once per
    product on the way back) in norm.  Padding, a packed row and masked prompt tokens are in
    the batch, so the masked loss's bookkeeping is the same in both."""
    tokens, seg, tgt = packed_batch()
    f32, types32, n_layer = step(FIX / fixture, "f32", tokens, seg, tgt)
    b16, types16, _ = step(FIX / fixture, "bf16", tokens, seg, tgt)
    assert "BF16" not in types32.values()              # the f32 path loads no BF16 weight
    assert {types16[n] for n in types16 if n.endswith("attn_q.weight")} == {"BF16"}
    assert b16["n_valid"] == f32["n_valid"] > 0
    d = depth(n_layer)
    assert abs(b16["loss"] - f32["loss"]) <= d * U_BF16 * abs(f32["loss"]), (b16["loss"], f32["loss"])
    assert b16["loss"] != f32["loss"]                    # bf16 did round something
    for name, g in f32["grads"].items():
        err = np.linalg.norm(b16["grads"][name] - g)
        assert err <= 2 * d * U_BF16 * np.linalg.norm(g), (name, err, np.linalg.norm(g))


def test_cpu_bf16_units_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    assert precision.cpu_bf16_units(info) == ["avx512_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n")
    assert precision.cpu_bf16_units(info) == ["amx_bf16", "avx512_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    assert precision.cpu_bf16_units(info) == []
    assert precision.cpu_bf16_units(tmp_path / "missing") == []


def test_compute_type_checks():
    assert precision.type_policy_for("f32", "keep") == "keep"
    assert precision.type_policy_for("bf16", "auto") == "bf16"
    with pytest.raises(precision.ComputeTypeError, match="type_policy must be auto or keep"):
        precision.type_policy_for("bf16", "f32")
    with pytest.raises(precision.ComputeTypeError, match="for CPU training"):
        precision.check("bf16", "cuda", blas=False)
    with pytest.raises(precision.ComputeTypeError, match="BLAS backend with oneDNN"):
        precision.check("bf16", "cpu", blas=False)
    if not ggml.bf16_kernel():
        with pytest.raises(precision.ComputeTypeError, match="needs a CPU with AVX-512"):
            precision.check("bf16", "cpu", blas=True)
        return
    line = precision.check("bf16", "cpu", blas=True)
    assert ggml.bf16_kernel() in line and ggml.bf16_kernel()
    assert ("WARNING" in line) == (not precision.cpu_bf16_units())


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_a_cpu_without_onednn_bf16_keeps_bf16_weights_on_ggml_cpu():
    """oneDNN's bf16 matmul exists wherever the CPU has AVX-512 (its emulation needs
    avx512_core at least); where the probe finds none, ggml-blas does not claim BF16 weights
    (a BF16 product runs on ggml-cpu, no abort) and a bf16 run is refused by name."""
    if AVX512_CORE <= cpu_flags():
        assert ggml.bf16_kernel(), "an AVX-512 CPU without oneDNN's bf16 matmul"
    if ggml.bf16_kernel():
        return
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 64)).astype(np.float32)
    x = rng.normal(size=(1, 8, 64)).astype(np.float32)
    got, backend = run_op(lib.ggml_mul_mat, w, x, [64, 8, 1])
    assert backend == "CPU"
    want = x.reshape(8, 64).astype(np.float64) @ bf16(w).astype(np.float64).T
    # ggml-cpu rounds x to bf16 as well: each product off by 2^-9 of itself, at most
    bound = U_BF16 * (np.abs(x.reshape(8, 64)) @ np.abs(bf16(w)).T) + 64 * U32
    assert np.all(np.abs(got.reshape(8, 24) - want) <= bound)


@needs_onednn_bf16
def test_plan_and_run_say_what_they_compute_with(capsys, tmp_path):
    """`pytrain plan` prints the compute line and loads the matrices as BF16; `pytrain train`
    logs it, trains, and writes an adapter; a type_policy or device that contradicts bf16 is
    an error naming train.compute_type and the config file's line."""
    from pytrain.cli import main
    from tests.test_train_cli import write_config, write_data
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, batch_size=2, max_steps=2, compute_type="bf16",
                       data={"max_seq_len": 64})
    capsys.readouterr()
    assert main(["plan", str(cfg), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["compute"].startswith("compute bf16: BF16 weight matrices through oneDNN's ")
    kinds = {(g["file_type"], g["loaded_type"]) for g in d["weights"]}
    assert kinds == {("F32", "BF16"), ("F32", "F32")}, kinds
    assert main(["train", str(cfg)]) == 0
    out = capsys.readouterr()
    assert "compute bf16: BF16 weight matrices through oneDNN" in out.out + out.err
    assert (tmp_path / "out" / "adapter.gguf").exists()
    line = next(i for i, s in enumerate(cfg.read_text().splitlines(), 1) if "compute_type" in s)
    rc = main(["plan", str(cfg), "--set", 'model.type_policy="f32"'])
    err = capsys.readouterr().err
    assert rc == 1 and f"{cfg}:{line}: train.compute_type:" in err, err
    assert "type_policy must be auto or keep" in err


@needs_onednn_bf16
def test_the_log_says_which_matrices_bf16_leaves_quantized(capsys, tmp_path, monkeypatch):
    """The issue's case: a quantized type that a bf16 step was not measured faster with as
    BF16 copies (Q8_0 below FASTER here) keeps its type and ggml-cpu's kernels, as under f32.
    On the Q8_0 fixture every matrix is then kept: the run's log and ``pytrain plan`` say
    that no matrix is BF16 (not the claim of BF16 matrices through oneDNN) and warn, naming
    the settings that change it; on the F32 fixture the line is the one it was."""
    from collections import Counter

    from pytrain.cli import main
    from pytrain.config import load_config
    from pytrain.formats.gguf_tensors import is_elementwise
    from pytrain.run import type_choice as tc
    from pytrain.run.loop import open_session
    from tests.test_train_cli import MODEL, write_config, write_data
    monkeypatch.setattr(tc, "BF16_STEP_RATIO", {"cpu+blas": {"Q8_0": tc.FASTER - 0.05}})
    write_data(tmp_path, copies=1)
    cfg = write_config(tmp_path, batch_size=2, max_steps=1, compute_type="bf16",
                       data={"max_seq_len": 64})
    plain = precision.check("bf16", "cpu", True)
    q8 = tmp_path / "q8.toml"
    q8.write_text(cfg.read_text().replace(str(MODEL), str(FIX / "gqa-q8_0.gguf")))
    for path, quantized in ((cfg, False), (q8, True)):
        log: list[str] = []
        s = open_session(load_config(path), tmp_path / "out", log.append)
        try:
            mats = Counter((r.file_type, r.loaded_type) for r in s.model.weights.report.values()
                           if not is_elementwise(r.name, r.shape))
        finally:
            s.close()
        said = [line for line in log if line.startswith("compute ")]
        capsys.readouterr()
        assert main(["plan", str(path), "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)["compute"]
        if not quantized:
            assert mats.keys() == {("F32", "BF16")}
            assert said == [plain] and planned == plain
            continue
        assert mats == {("Q8_0", "Q8_0"): 31}
        assert len(said) == 1 and said[0] == planned, (said, planned)
        first, warning = said[0].split("\n")
        assert first.startswith("compute bf16: no weight matrix is BF16 (31 kept Q8_0): "
                                "ggml-cpu's Q8_0 kernels multiply them"), first
        assert "oneDNN" not in first
        assert warning.startswith("warning: bf16 compute does not apply to this model's 31 "
                                  "matrices kept as Q8_0"), warning
        assert 'train.compute_type = "f32"' in warning and "F16 or BF16 GGUF" in warning
        why = next(line for line in log if line.startswith("weights: "))
        assert why.startswith('weights: compute bf16, type_policy = "auto": kept Q8_0 (31 '
                              'matrices: a bf16 step measured'), why
