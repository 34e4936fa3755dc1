"""What the parity tests of the Llama-family GGUFs (llama, qwen2, qwen3: one graph,
``models/llama.py``) share: the fixture files of scripts/make_llama_fixtures.py, the error
measure against a golden, and pytrain's loss and LoRA gradients on a PEFT golden's batch."""
import functools
from pathlib import Path

import numpy as np

import pytrain
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import loss as L
from pytrain.step.graphs import GradGraph
from step_rounding import measure

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RANK, ALPHA = 4, 8                      # the PEFT goldens' adapter


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def padded_seg(gold) -> np.ndarray:
    """Sample ids of a golden's right-padded rows (-1 = padding)."""
    tokens, lengths = gold["tokens"], gold["lengths"]
    return np.where(np.arange(tokens.shape[1])[None] < lengths[:, None], 0, -1)


def max_error(model, gold, want):
    """max |Δ log-softmax| over the real positions of every golden sequence (one padded batch)."""
    got = log_softmax(model.logits(gold["tokens"], seg=padded_seg(gold)))
    return max(float(np.abs(got[i, :n] - want[i, :n]).max())
               for i, n in enumerate(gold["lengths"]))


def peft_step(gguf: Path, gold: dict, targets: tuple[str, ...]) -> tuple[list[str], dict]:
    """(adapted tensor names, GradGraph output) of pytrain's step on the golden's padded,
    prompt-masked batch with the golden's A and B, in llama.cpp's layout."""
    m = pytrain.load_model(gguf, device="cpu", threads=2)
    try:
        names = select_targets(m.config, targets)
        ad = lora.create(m.runtime, m.config, names, rank=RANK, alpha=ALPHA, seed=0)
        ad.set({k: gold[k] for n in names for k in (n + ".lora_a", n + ".lora_b")})
        tokens, labels = gold["input_ids"], gold["labels"]
        seg = np.where(gold["attention_mask"] > 0, 0, -1)
        tgt = L.shift_targets(tokens, labels != L.IGNORE, seg)
        g = GradGraph(m, ad, B=tokens.shape[0], T=tokens.shape[1])
        try:
            out = g.run(tokens, seg, tgt)
        finally:
            g.close()
        out["own"] = measure(m, ad, tokens.shape[0], tokens.shape[1], tokens, seg, tgt)
        return names, out
    finally:
        m.close()


def assert_step_matches_peft(gold: dict, names: list[str], out: dict, ref: str, measured,
                             label: str) -> None:
    """pytrain's loss and LoRA gradients (``peft_step``) against PEFT's float32 (``ref``
    "f32") or float64 ("f64") values in ``gold``, within ``bounds.reference_bounds`` of PEFT
    float32's own rounding in the golden and pytrain's own measured now (``out["own"]``).
    Gradient errors are per tensor, max |Δ| / max |golden gradient|."""
    from bounds import reference_bounds
    side = ref == "f32"
    exact = float(gold["loss64"])
    bound = reference_bounds(out["own"]["loss"], abs(float(gold["loss"]) - exact), exact)[side]
    want_loss = float(gold["loss" if side else "loss64"])
    measured(f"{label} loss vs PEFT {ref}, |Δ|", abs(out["loss"] - want_loss), bound)
    assert abs(out["loss"] - want_loss) <= bound, (out["loss"], want_loss, bound)
    worst = (0.0, "")
    for n in names:
        for s in (".lora_a", ".lora_b"):
            exact = gold[n + s + ".grad64"].astype(np.float64)
            want = gold[n + s + (".grad" if side else ".grad64")].astype(np.float64)
            got = out["grads"][n + s].astype(np.float64)
            scale = np.abs(exact).max()
            assert scale > 1e-3, (n + s, scale)
            peft = float(np.abs(gold[n + s + ".grad"] - exact).max())
            b = reference_bounds(out["own"]["grads"][n + s], peft, exact)[side] / scale
            err = float(np.abs(got - want).max()) / scale
            worst = max(worst, (err / b, n + s))
            assert err <= b, (n + s, err, b)
    measured(f"{label} LoRA gradients vs PEFT {ref}: worst error / bound ({worst[1]})",
             worst[0], 1.0)


def assert_kv_cache_matches(path: Path, gold) -> None:
    """Generation's cached steps (the prompt, then one token at a time attending to the cached
    keys and values) give the logits the whole sequence gives at those positions, and the same
    greedy continuation as recomputing the prefix (``decode_values=None``)."""
    import dataclasses
    seq = gold["tokens"][4, :40].astype(np.int64)
    m = pytrain.load_model(path, device="cpu", threads=2)
    try:
        full = m.logits(seq)
        steps = m._cached_steps(list(seq[:25]), 15, None)
        got = [steps.send(None)] + [steps.send(int(t)) for t in seq[25:39]]
        steps.close()
        cont = m.generate(seq[:25], 12)
        cached = m.arch
        m.arch = dataclasses.replace(cached, decode_values=None)        # the recompute path
        try:
            again = m.generate(seq[:25], 12)
        finally:
            m.arch = cached
    finally:
        m.close()
    np.testing.assert_allclose(np.array(got), full[24:39], atol=1e-4)
    assert cont == again and len(cont) > 0


def f32_bound(fix: Path, model: str, gold) -> tuple[float, float]:
    """(bound, HF's rounding) for pytrain in float32 against the float64 forward of a file
    of ``model`` (tests/bounds.py, ``reference_bounds``): HF's rounding is HF float32's
    distance from the float64 forward of the F32 file on the same sequences (this network's
    float32 rounding on the machine that made the golden), pytrain's own is measured now by
    perturbation on the same sequences (``own_rounding``), and the bound is F32_SPREAD times
    the larger, at least a few ulps of the log-probabilities.  Against HF float32 itself,
    bound + HF's rounding."""
    from bounds import reference_bounds
    truth = np.load(fix / f"{model}-f32.f64.npz")["logprobs64"]
    real = [(i, int(n)) for i, n in enumerate(gold["lengths"])]
    hf_rounding = max(float(np.abs(gold["logprobs"][i, :n] - truth[i, :n]).max())
                      for i, n in real)
    values = np.concatenate([truth[i, :n].ravel() for i, n in real])
    return reference_bounds(own_rounding(fix, model), hf_rounding, values)[0], hf_rounding


@functools.cache
def own_rounding(fix: Path, model: str) -> float:
    """pytrain's own float32 rounding of ``model``'s log-probabilities on its golden's
    sequences, measured now: the F32 file against its copy with every weight one float32 step
    off (tests/perturbation.py)."""
    from perturbation import logprob_rounding
    gold = np.load(fix / f"{model}.npz")

    def logprobs(m, _):
        got = log_softmax(m.logits(gold["tokens"], seg=padded_seg(gold)))
        return np.concatenate([got[i, :n] for i, n in enumerate(gold["lengths"])])
    return logprob_rounding(fix / f"{model}-f32.gguf", logprobs)
