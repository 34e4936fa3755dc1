"""LoRA variants as PEFT 0.21 defines them: rsLoRA (``use_rslora``, scale alpha/sqrt(r)).

The gradients of rsLoRA against PEFT's own module are in test_peft_parity.py (the
``rslora`` golden of scripts/make_peft_golden.py).  Here: the adapter files.  PEFT loads the
folder pytrain writes and computes the same logits (tests/fixtures/qwen35/peft_logits.npz's
``rslora`` set, scripts/make_peft_logits_golden.py); the adapter GGUF holds alpha·sqrt(r),
because llama.cpp always scales by alpha/r, and llama.cpp's logits with it match pytrain's."""
import json
from pathlib import Path

import numpy as np
import pytest

import pytrain
from pytrain.cli import main
from pytrain.formats.adapter_gguf import read_lora_gguf, write_lora_gguf
from pytrain.formats.adapter_peft import CONFIG_NAME, read_peft_adapter, write_peft_adapter
from pytrain.models import lora
from test_peft_adapter import bases_of, bounds_of, restore, tensor_set
from test_train_run import FIX, records, write_config, write_data

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(FIX / "peft_logits.npz"))


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    yield m
    m.close()


def rslora_logits(model, tensors, toks):
    ad = lora.create(model.runtime, model.config, bases_of(tensors), RANK, ALPHA, rslora=True)
    ad.set(tensors)
    return model.logits(toks, lora=ad.hook)


def test_rslora_scale_is_alpha_over_sqrt_rank(model):
    ad = lora.create(model.runtime, model.config, ["blk.1.attn_q.weight"], RANK, ALPHA,
                     rslora=True)
    assert ad.scale_of("blk.1.attn_q.weight") == ALPHA / 2 and ad.plain_alpha == 16.0
    plain = lora.create(model.runtime, model.config, ["blk.1.attn_q.weight"], RANK, ALPHA)
    assert plain.scale_of("blk.1.attn_q.weight") == ALPHA / RANK and plain.plain_alpha == ALPHA


def test_rslora_logits_match_hf_peft(gold, model):
    """pytrain's rsLoRA adapter against HF + PEFT with the folder pytrain wrote (PEFT scaled
    it by alpha/sqrt(r), the generator checked), within the bounds of the plain sets."""
    tensors = tensor_set(gold, "rslora")
    assert float(gold["rslora/effect"]) > 5.0
    for j, n in enumerate(gold["lengths"]):
        toks = gold["tokens"][j, :n]
        ours = rslora_logits(model, tensors, toks)
        bound, hf = bounds_of(gold, "rslora", j, n)
        assert float(np.abs(ours - gold["rslora/logits64"][j, :n]).max()) <= bound
        assert float(np.abs(ours - gold["rslora/logits"][j, :n]).max()) <= bound + hf
    # the same tensors as a plain LoRA (scale alpha/r, half as large) are far off
    plain = lora.create(model.runtime, model.config, bases_of(tensors), RANK, ALPHA)
    plain.set(tensors)
    n = int(gold["lengths"][0])
    d = float(np.abs(model.logits(gold["tokens"][0, :n], lora=plain.hook)
                     - gold["rslora/logits"][0, :n]).max())
    assert d > 100 * sum(bounds_of(gold, "rslora", 0, n)), d


def test_rslora_folder_is_what_peft_writes_and_reads_back(gold, model, tmp_path):
    tensors = tensor_set(gold, "rslora")
    folder = write_peft_adapter(tmp_path / "ad", tensors, ALPHA, RANK, model_config=model.config,
                                use_rslora=True)
    ours = json.loads((folder / CONFIG_NAME).read_text())
    for theirs in (json.loads(str(gold["rslora/peft_config_json"])),
                   json.loads(gold[f"rslora/peft_saved/{CONFIG_NAME}"].tobytes())):
        theirs["target_modules"] = sorted(theirs["target_modules"])
        assert ours == theirs
    assert ours["use_rslora"] is True and ours["lora_alpha"] == 8
    # the folder PEFT itself re-saved reads back as a plain LoRA of alpha·sqrt(r): the same
    # logits as the rsLoRA adapter, bit for bit
    back, alpha, rank, _ = read_peft_adapter(restore(gold, "rslora", "peft_saved",
                                                     tmp_path / "peft"), model.config)
    assert (alpha, rank) == (16.0, RANK)
    n = int(gold["lengths"][0])
    toks = gold["tokens"][0, :n]
    plain = lora.create(model.runtime, model.config, bases_of(back), rank, alpha)
    plain.set(back)
    np.testing.assert_array_equal(model.logits(toks, lora=plain.hook),
                                  rslora_logits(model, tensors, toks))


@pytest.mark.slow
def test_llama_cpp_applies_the_rslora_scale(llama_logits_exe, tmp_path, model):
    """The GGUF of an rsLoRA adapter (alpha·sqrt(r)) in llama.cpp --lora against pytrain's
    rsLoRA logits, bounded as test_llama_cpp_adapter.py's plain adapters are."""
    from llama_cpp_check import deltas_with_adapter, llama_cpp_compatible
    from perturbation import adapter_bounds
    from test_llama_cpp_adapter import tokens_for
    path = llama_cpp_compatible(FIX / "gqa-f32.gguf", tmp_path)
    m = pytrain.load_model(path, device="cpu", threads=2)
    names = ["blk.1.attn_q.weight", "blk.3.attn_v.weight", "blk.3.attn_output.weight"]
    try:
        ad = lora.create(m.runtime, m.config, names, RANK, ALPHA, rslora=True)
        rng = np.random.default_rng(1)
        tensors = {k: rng.normal(0, 0.3, v.shape).astype(np.float32)
                   for k, v in ad.get().items()}
        ad.set(tensors)
        adapter_file = write_lora_gguf(tmp_path / "rs.gguf", "qwen35", ad.plain_alpha, tensors)
        assert read_lora_gguf(adapter_file)[1] == 16.0
        toks = tokens_for(m.config.n_vocab, 40)
        ours_base, ours_lora = m.logits(toks), m.logits(toks, lora=ad.hook)
    finally:
        m.close()

    def same(mp):
        adp = lora.create(mp.runtime, mp.config, names, RANK, ALPHA, rslora=True)
        adp.set(tensors)
        return adp
    atol_base, atol_lora = adapter_bounds(path, tmp_path, toks, ours_base, ours_lora, same)
    d_base, d_lora, effect = deltas_with_adapter(llama_logits_exe, path, adapter_file, toks,
                                                 ours_base, ours_lora, tmp_path)
    assert effect > 0.05 and d_base <= atol_base
    assert d_lora <= atol_lora, (d_lora, atol_lora)


def test_a_run_with_rslora_writes_both_formats_at_its_scale(tmp_path, capsys):
    """lora.use_rslora in a run: the GGUF holds alpha·sqrt(r), the PEFT folder alpha with
    use_rslora, and `pytrain eval` with either gives the run's final validation."""
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=4, eval_every=0)
    cfg.write_text(cfg.read_text().replace("alpha = 16.0", "alpha = 16.0\nuse_rslora = true"))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    final = [r for r in records(out) if r.get("split") == "valid"][-1]
    _, alpha, tensors, _ = read_lora_gguf(out / "adapter.gguf")
    assert alpha == np.float32(16.0 * np.sqrt(8))     # rank 8 in write_config; GGUF f32
    peft_cfg = json.loads((out / "peft" / CONFIG_NAME).read_text())
    assert peft_cfg["use_rslora"] is True and peft_cfg["lora_alpha"] == 16
    for adapter in (out / "adapter.gguf", out / "peft"):
        capsys.readouterr()
        assert main(["eval", str(cfg), "--adapter", str(adapter)]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert f"loss {final['loss']:.4f}" in line, (adapter, line)


# --------------------------------------------------------------------------- LoRA+

def test_loraplus_steps_as_peft_create_loraplus_optimizer(model):
    """Three AdamW steps on fixed gradients against PEFT's LoRA+ optimizer (torch AdamW with
    lora_B at lr·ratio; tests/fixtures/qwen35/loraplus_golden.npz, made by
    scripts/make_loraplus_golden.py).  Bound per tensor: F32_SPREAD x how far torch float32
    is from the float64 run (at least 8 ulps of the tensor): both apply the same update
    formula to the same float32 inputs, each rounding its own way."""
    from bounds import F32_SPREAD, ulps
    from pytrain import ggml
    from pytrain.step.optimizer import AdamWSettings, Optimizer, OptimizerState
    g = dict(np.load(FIX / "loraplus_golden.npz"))
    names = sorted({k.rsplit(".", 1)[0] for k in g if k.endswith((".lora_a", ".lora_b"))})
    ad = lora.create(model.runtime, model.config, names, RANK, ALPHA)
    ad.set({k: g[k] for k in g if k.endswith((".lora_a", ".lora_b"))})
    state = OptimizerState(model.runtime, ad.params())
    hp = AdamWSettings(lr=float(g["lr"]), beta1=float(g["beta1"]), beta2=float(g["beta2"]),
                       eps=float(g["eps"]), weight_decay=float(g["weight_decay"]),
                       max_grad_norm=0.0, b_lr_ratio=float(g["ratio"]))
    opt = Optimizer(model.runtime, state, hp)
    try:
        for i in range(int(g["steps"])):
            for k in state.grad:
                ggml.from_numpy(state.grad[k], g[f"{k}/grad/{i}"])
            opt.step(hp.lr, grad_norm=0.0)
            got = ad.get()
            for k, v in got.items():
                exact = g[f"{k}/after64/{i}"]
                torch_err = float(np.abs(g[f"{k}/after/{i}"] - exact).max())
                bound = F32_SPREAD * max(torch_err, ulps(exact))
                assert float(np.abs(v - exact).max()) <= bound, (k, i)
        # the ratio is what moved B: B went ~16x as far as A (Adam's first steps move every
        # element by about lr), and a plain step would not reach PEFT's B at all
        before = {k: g[k] for k in got}
        move = {k: float(np.abs(got[k] - before[k]).max()) for k in got}
        assert min(v for k, v in move.items() if k.endswith("lora_b")) > \
            8 * max(v for k, v in move.items() if k.endswith("lora_a"))
    finally:
        opt.close()
        state.close()


def test_a_run_with_loraplus_moves_b_at_the_ratio(tmp_path):
    """lora.loraplus_lr_ratio in a run: AdamW's first step moves an element whose gradient
    is well above eps by lr·sign(g) (no weight decay), so B (zero at the start) reaches
    lr·ratio in its largest element; A, whose gradient is zero while B is, stays."""
    write_data(tmp_path)
    lr, ratio = 1e-3, 16.0
    cfg = write_config(tmp_path, max_steps=1, eval_every=0, lr=lr, formats=["gguf"])
    cfg.write_text(cfg.read_text().replace("alpha = 16.0",
                                           f"alpha = 16.0\nloraplus_lr_ratio = {ratio}"))
    init = tmp_path / "init"
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={init}",
                 "--set", "train.lr=1e-30"]) == 0           # the initial adapter, to rounding
    after, before = (read_lora_gguf(p / "adapter.gguf")[2] for p in (tmp_path / "out", init))
    for k in after:
        moved = float(np.abs(after[k] - before[k]).max())
        if k.endswith(".lora_a"):
            assert moved == 0.0, k
        else:
            assert abs(moved - lr * ratio) <= 1e-3 * lr * ratio, (k, moved)


# --------------------------------------------------------------------------- dropout

P = 0.3


def dropout_adapter(m, p=P, seed=5):
    """Every default target, B not zero (A gets a gradient), dropout p."""
    from pytrain.models.lora_targets import select_targets
    ad = lora.create(m.runtime, m.config, select_targets(m.config), RANK, ALPHA, seed=seed,
                     dropout=p)
    rng = np.random.default_rng(0)
    ad.set({k: (rng.normal(0, 0.05, v.shape).astype(np.float32) if k.endswith("lora_b") else v)
            for k, v in ad.get().items()})
    return ad


def batch(B=3, T=40):
    from pytrain.step import loss as L
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 480, (B, T))
    seg = np.zeros((B, T), np.int64)
    seg[1, 30:] = -1
    return tokens, seg, L.shift_targets(tokens, rng.random((B, T)) < 0.6, seg)


def test_dropout_masks_drop_at_the_rate_and_scale_the_rest(model):
    """A training graph has one mask per adapted input, each [B·T, n_in]: zeros at rate p
    (within 5 binomial standard deviations over all their elements), the rest 1/(1-p)
    exactly as torch's dropout; independent per tensor; the same for the same place in the
    run, another for another."""
    from pytrain import ggml
    from pytrain.step.graphs import GradGraph
    ad = dropout_adapter(model)
    g = GradGraph(model, ad, 3, 40)
    try:
        shapes = {n: ggml.shape(t) for n, t in g.masks}
    finally:
        g.close()
    assert sorted(shapes) == sorted(ad.names)
    assert all(s[0] == 3 * g.T for s in shapes.values())
    total = zeros = 0
    first = {}
    for n, shape in shapes.items():
        m = first[n] = ad.mask_values(n, shape, (4, 1))
        assert set(np.unique(m)) == {0.0, np.float32(1 / (1 - P))}, n
        total, zeros = total + m.size, zeros + int((m == 0).sum())
        np.testing.assert_array_equal(m, ad.mask_values(n, shape, (4, 1)))
        assert not np.array_equal(m, ad.mask_values(n, shape, (5, 1))), n
        assert not np.array_equal(m, ad.mask_values(n, shape, (4, 2))), n
    sigma = np.sqrt(total * P * (1 - P))
    assert abs(zeros - P * total) <= 5 * sigma, (zeros / total, P)
    same_shape = [n for n in shapes if shapes[n] == shapes[ad.names[0]]]
    assert len(same_shape) > 1 and not np.array_equal(first[same_shape[0]],
                                                      first[same_shape[1]])


def test_the_adapter_sees_the_dropped_input(model):
    """One adapted projection alone: the hook computes (alpha/r)·B·A·(x ⊙ mask), PEFT's
    lora_B(lora_A(dropout(x)))·scaling, against numpy in float64 (float32 rounding of
    two small products)."""
    from pytrain import ggml
    from pytrain.ggml import lib
    name = "blk.1.attn_q.weight"
    ad = lora.create(model.runtime, model.config, [name], RANK, ALPHA, dropout=P, seed=1)
    rng = np.random.default_rng(2)
    vals = {k: rng.normal(0, 0.3, v.shape).astype(np.float32) for k, v in ad.get().items()}
    ad.set(vals)
    n_in, N = vals[name + ".lora_a"].shape[1], 24
    ctx = ggml.Context(n_tensors=16, graph_size=64)
    try:
        x = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, n_in, N)
        lib.ggml_set_input(x)
        with ad.training_masks() as masks:
            y = ad.hook(ctx.ptr, name, x)
        assert len(masks) == 1
        graph = ggml.new_graph_for(ctx.ptr, y, size=64)
        model.runtime.alloc_graph(graph, ctx)
        xs = rng.normal(0, 1, (N, n_in)).astype(np.float32)
        ggml.from_numpy(x, xs)
        ad.fill_masks(masks, (7, 0))
        model.runtime.compute(graph)
        mask = ad.mask_values(name, (N, n_in), (7, 0)).astype(np.float64)
        got = ggml.to_numpy(y).astype(np.float64)
    finally:
        model.runtime.forget_graph()
        ctx.close()
    a, b = (vals[name + s].astype(np.float64) for s in (".lora_a", ".lora_b"))
    want = (xs * mask) @ a.T @ b.T * (ALPHA / RANK)
    assert (mask == 0).any() and not np.allclose(want, (xs @ a.T @ b.T) * (ALPHA / RANK))
    from bounds import ulps
    err = np.abs(got - want).max()
    assert err <= 64 * n_in * ulps(np.abs(want).max(), 1), err


def test_dropout_zero_builds_no_masks(model):
    from pytrain.step.graphs import GradGraph
    g = GradGraph(model, dropout_adapter(model, p=0.0), 3, 40)
    try:
        assert g.masks == []
    finally:
        g.close()


@pytest.mark.slow
def test_layer_recompute_draws_the_same_masks(monkeypatch):
    """recompute = layers runs each layer twice (forward, then again in its backward): the
    masks, drawn by tensor name and place, are the same each time and the same as the one
    graph's, so the step equals the one-graph step within its float32 rounding."""
    import step_rounding
    from pytrain.step import recompute as R
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    try:
        ad = dropout_adapter(m)
        tokens, seg, tgt = batch()
        rounding = step_rounding.measure(m, ad, 3, 40, tokens, seg, tgt)
        r = R.RecomputeGraph(m, ad, 3, 40)
        rec = r.run(tokens, seg, tgt)
        r.close()
        plain = dropout_adapter(m, p=0.0)
        from pytrain.step.graphs import GradGraph
        g = GradGraph(m, plain, 3, 40)
        no_dropout = g.run(tokens, seg, tgt)
        g.close()
    finally:
        m.close()
    step_rounding.assert_step_close(rec, rounding["ref"], rounding)
    assert abs(no_dropout["loss"] - rounding["ref"]["loss"]) > 1e-3     # dropout did act


def test_a_dropout_run_resumes_exactly(tmp_path, capsys):
    """2 steps then resumed to 4 = 4 steps straight, bit for bit: the masks are drawn from
    the step and micro-batch, not from a generator's state; and dropout did change the
    adapter."""
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=4, eval_every=0, grad_accum=2, batch_size=4,
                       formats=["gguf"])
    cfg.write_text(cfg.read_text().replace("alpha = 16.0", "alpha = 16.0\ndropout = 0.2"))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    b = ["--set", f"output.dir={tmp_path / 'b'}"]
    assert main(["train", str(cfg), "--no-progress", *b, "--set", "train.max_steps=2"]) == 0
    assert main(["train", str(cfg), "--no-progress", *b, "--resume"]) == 0
    straight, resumed = (read_lora_gguf(p / "adapter.gguf")[2] for p in (tmp_path / "out",
                                                                         tmp_path / "b"))
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k], err_msg=k)
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={tmp_path / 'c'}",
                 "--set", "lora.dropout=0"]) == 0
    plain = read_lora_gguf(tmp_path / "c" / "adapter.gguf")[2]
    assert any(not np.array_equal(plain[k], straight[k]) for k in plain)


# --------------------------------------------------------------------------- initialisation

@pytest.mark.parametrize("init", ["peft", "gaussian"])
def test_initialisation_draws_as_peft(model, init):
    """lora.init against what PEFT's own modules draw (init_lora_weights=True / "gaussian",
    rank 16, the default targets; tests/fixtures/qwen35/lora_init_golden.json, made by
    scripts/make_lora_init_golden.py): B zero; A's mean and standard deviation equal PEFT's
    within 5 standard errors of the difference of two samples of that size; the uniform's
    bound held and reached.  The two inits' deviations differ by 15%, far beyond that."""
    from pytrain.models.lora_targets import select_targets
    gold = json.loads((FIX / "lora_init_golden.json").read_text())
    ref = gold[init]
    r = gold["rank"]
    ad = lora.create(model.runtime, model.config, select_targets(model.config), r, 2 * r,
                     seed=3, init=init)
    t = ad.get()
    a = np.concatenate([v.reshape(-1) for k, v in sorted(t.items()) if k.endswith("lora_a")])
    assert a.size == ref["n"] and all(not v.any() for k, v in t.items() if k.endswith("lora_b"))
    se = ref["std"] / np.sqrt(a.size)
    assert abs(a.mean() - ref["mean"]) <= 5 * np.sqrt(2) * se
    assert abs(a.std() - ref["std"]) <= 5 * np.sqrt(2) * ref["std"] / np.sqrt(2 * a.size)
    if init == "peft":
        bound = 1 / np.sqrt(ref["n_in"])
        assert ref["max_abs"] <= bound and np.abs(a).max() <= bound
        assert np.abs(a).max() >= 0.99 * bound
    other = gold["gaussian" if init == "peft" else "peft"]["std"]
    assert abs(a.std() - other) > 10 * ref["std"] / np.sqrt(2 * a.size)
