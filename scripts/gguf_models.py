"""Tiny qwen35 GGUF files with random weights, for tests that need a model file.

The layout follows llama.cpp's converter: the ``qwen35.*`` keys it writes, its tensor names,
1-D tensors, norms and ``ssm_conv1d`` always F32, every other matrix in the chosen type.  The
default shape is the smallest whose matrix rows are all multiples of 256, so every K-quant
applies: hidden 256, 4 layers (linear, linear, linear, attention), 2/1 heads of 128, FFN 256,
DeltaNet 1 key head / 2 value heads of 128, vocabulary 64 (about 2 M weights, 8 MB in F32).

    from scripts.gguf_models import write_qwen35
    model = write_qwen35(tmp_path / "m.gguf", dtype="q8_0")
    model.values["blk.3.attn_q.weight"]   # float32 values before encoding
    model.raw["blk.3.attn_q.weight"]      # the bytes written, in the tensor's file type

Not a real model: the values are random and the tokenizer keys are placeholders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import gguf

from pytrain import ggml

ARCH = "qwen35"


@dataclass
class TinyQwen35:
    path: Path
    hparams: dict
    values: dict[str, np.ndarray] = field(default_factory=dict)   # float32 before encoding
    types: dict[str, str] = field(default_factory=dict)           # ggml type name per tensor
    raw: dict[str, np.ndarray] = field(default_factory=dict)      # bytes as written


DEFAULTS = dict(n_layer=4, n_embd=256, n_ff=256, n_head=2, n_head_kv=1, head_dim=128,
                n_vocab=64, conv_kernel=4, ssm_state=128, ssm_k_heads=1, ssm_v_heads=2,
                ssm_v_dim=128, full_attention_interval=4, rms_eps=1e-6, rope_base=1e7)


def qwen35_tensor_shapes(hp: dict, recurrent: list[bool], tied: bool = True,
                         n_nextn: int = 0) -> dict[str, tuple[int, ...]]:
    """Numpy-order shapes the converter writes, MTP blocks included (written independently
    of ``Qwen35Config.tensor_shapes`` so the tests compare two derivations)."""
    e, hd, ff = hp["n_embd"], hp["head_dim"], hp["n_ff"]
    key_dim = hp["ssm_k_heads"] * hp["ssm_state"]
    inner = hp["ssm_v_heads"] * hp["ssm_v_dim"]
    s: dict[str, tuple[int, ...]] = {"token_embd.weight": (hp["n_vocab"], e),
                                     "output_norm.weight": (e,)}
    if not tied:
        s["output.weight"] = (hp["n_vocab"], e)
    for i, rec in enumerate(recurrent + [False] * n_nextn):
        p = f"blk.{i}."
        s[p + "attn_norm.weight"] = (e,)
        s[p + "post_attention_norm.weight"] = (e,)
        s[p + "ffn_gate.weight"] = (ff, e)
        s[p + "ffn_up.weight"] = (ff, e)
        s[p + "ffn_down.weight"] = (e, ff)
        if rec:
            s[p + "attn_qkv.weight"] = (2 * key_dim + inner, e)
            s[p + "attn_gate.weight"] = (inner, e)
            s[p + "ssm_conv1d.weight"] = (2 * key_dim + inner, hp["conv_kernel"])
            s[p + "ssm_dt.bias"] = (hp["ssm_v_heads"],)
            s[p + "ssm_a"] = (hp["ssm_v_heads"],)
            s[p + "ssm_beta.weight"] = (hp["ssm_v_heads"], e)
            s[p + "ssm_alpha.weight"] = (hp["ssm_v_heads"], e)
            s[p + "ssm_norm.weight"] = (hp["ssm_v_dim"],)
            s[p + "ssm_out.weight"] = (e, inner)
        else:
            s[p + "attn_q.weight"] = (2 * hp["n_head"] * hd, e)
            s[p + "attn_k.weight"] = (hp["n_head_kv"] * hd, e)
            s[p + "attn_v.weight"] = (hp["n_head_kv"] * hd, e)
            s[p + "attn_output.weight"] = (e, hp["n_head"] * hd)
            s[p + "attn_q_norm.weight"] = (hd,)
            s[p + "attn_k_norm.weight"] = (hd,)
        if i >= len(recurrent):   # MTP block: llama.cpp's nextn tensors on top of a layer
            s[p + "nextn.eh_proj.weight"] = (e, 2 * e)
            s[p + "nextn.enorm.weight"] = (e,)
            s[p + "nextn.hnorm.weight"] = (e,)
            s[p + "nextn.shared_head_norm.weight"] = (e,)
    return s


def file_type_for(name: str, shape: tuple[int, ...], dtype: str) -> str:
    """The converter's rule: 1-D, ``*_norm.weight`` and ``ssm_conv1d`` stay F32; a matrix
    whose rows do not fill whole blocks of the chosen type falls back to F16."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name:
        return "f32"
    if shape[-1] % ggml.lib.ggml_blck_size(ggml.TYPES[dtype]):
        return "f16"
    return dtype


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """``values`` as the bytes of a ggml type (ggml's own quantizers and converters)."""
    return ggml.to_bytes(values, ggml.TYPES[type_name], row_len=values.shape[-1])


def _writer(path, arch: str, name: str, n_blocks: int, hp: dict) -> "gguf.GGUFWriter":
    """A GGUF writer with the keys every decoder's converter writes first."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(n_blocks)
    w.add_context_length(4096)
    w.add_embedding_length(hp["n_embd"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    return w


def write_qwen35(path: str | Path, dtype: str = "f32", *, seed: int = 0, n_nextn: int = 0,
                 tied: bool = True, arch: str = ARCH, recurrent: list[bool] | None = None,
                 drop: tuple[str, ...] = (), shapes: dict[str, tuple[int, ...]] | None = None,
                 extra: dict[str, np.ndarray] | None = None,
                 types: dict[str, str] | None = None,
                 values_fn: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]
                 | None = None, **hparams) -> TinyQwen35:
    """Write a tiny qwen35 GGUF.

    ``dtype``: ggml type name for matrices (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_K``...).
    ``drop``: tensor names to leave out; ``shapes``: per-name shape overrides (numpy order);
    ``extra``: additional float32 tensors; ``types``: per-name type overrides (any ggml type
    name, also integer ones for error tests); ``values_fn(name, shape, rng)``: custom values.
    """
    hp = {**DEFAULTS, **hparams}
    n_layer = hp["n_layer"]
    if recurrent is None:
        recurrent = [(i + 1) % hp["full_attention_interval"] != 0 for i in range(n_layer)]
    want = qwen35_tensor_shapes(hp, recurrent, tied=tied, n_nextn=n_nextn)
    want.update(shapes or {})
    rng = np.random.default_rng(seed)

    w = _writer(path, arch, "tiny-qwen35-test", n_layer + n_nextn, hp)
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_layer_norm_rms_eps(hp["rms_eps"])
    w.add_rope_freq_base(hp["rope_base"])
    w.add_rope_dimension_count(hp["head_dim"] // 4)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(hp["conv_kernel"])
    w.add_ssm_inner_size(hp["ssm_v_heads"] * hp["ssm_v_dim"])
    w.add_ssm_state_size(hp["ssm_state"])
    w.add_ssm_time_step_rank(hp["ssm_v_heads"])
    w.add_ssm_group_count(hp["ssm_k_heads"])
    w.add_full_attention_interval(hp["full_attention_interval"])
    w.add_array(f"{arch}.attention.recurrent_layers", list(recurrent) + [False] * n_nextn)
    if n_nextn:
        w.add_nextn_predict_layers(n_nextn)
    w.add_tokenizer_model("gpt2")           # a placeholder vocabulary the tokenizer accepts
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(["t", "0"] + [f"t{i}" for i in range(hp["n_vocab"] - 2)])
    w.add_token_merges(["t 0"])
    w.add_eos_token_id(hp["n_vocab"] - 1)

    model = TinyQwen35(Path(path), hp)
    _add_tensors(w, model, want, dtype, rng, drop=drop, extra=extra, types=types,
                 values_fn=values_fn)
    _finish(w, model.path)
    return model


def _add_tensors(w, model, want: dict, dtype: str, rng, *, drop=(), extra=None, types=None,
                 values_fn=None) -> None:
    """Random (or given) values for every tensor of ``want`` (name -> numpy shape), encoded in
    its file type, added to the writer and recorded in ``model``."""
    all_values = dict(want)
    for name, extra_v in (extra or {}).items():
        all_values[name] = extra_v
    for name, spec in all_values.items():
        if name in drop:
            continue
        if isinstance(spec, np.ndarray):
            vals = spec.astype(np.float32)
        elif values_fn is not None:
            vals = np.asarray(values_fn(name, spec, rng), dtype=np.float32).reshape(spec)
        elif len(spec) == 1:
            vals = (1.0 + 0.1 * rng.standard_normal(spec)).astype(np.float32)
        else:
            vals = (0.05 * rng.standard_normal(spec)).astype(np.float32)
        tname = (types or {}).get(name) or file_type_for(name, vals.shape, dtype)
        if tname in ("i8", "i16", "i32", "i64", "f64"):
            arr = vals.astype({"i8": np.int8, "i16": np.int16, "i32": np.int32,
                               "i64": np.int64, "f64": np.float64}[tname])
            w.add_tensor(name, arr)
            raw = arr.reshape(-1).view(np.uint8)
        else:
            raw = encode(vals, tname)
            if tname in ("f32", "f16"):
                w.add_tensor(name, raw.view(np.float32 if tname == "f32" else np.float16)
                             .reshape(vals.shape))
            else:
                qtype = gguf.GGMLQuantizationType[tname.upper()]
                w.add_tensor(name, raw.reshape(*vals.shape[:-1], -1), raw_dtype=qtype)
        model.values[name] = vals
        model.types[name] = tname
        model.raw[name] = raw


LLAMA_DEFAULTS = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                      n_vocab=64, rms_eps=1e-5, rope_base=1e4)


def write_llama(path: str | Path, dtype: str = "f32", *, seed: int = 0, tied: bool = True,
                **hparams) -> TinyQwen35:
    """A tiny ``llama`` GGUF with the keys llama.cpp's converter writes (rows of 256 or 512, so
    every K-quant applies), random weights at a visible scale (norms 1 + N(0, 0.1), matrices
    N(0, 1/fan_in), embeddings N(0, 0.15)); matrices in ``dtype``."""
    from pytrain.models.llama_config import LlamaConfig
    hp = {**LLAMA_DEFAULTS, **hparams}
    cfg = LlamaConfig(n_layer=hp["n_layer"], n_embd=hp["n_embd"], n_ff=hp["n_ff"],
                      n_head=hp["n_head"], n_head_kv=hp["n_head_kv"], head_dim=hp["head_dim"],
                      n_vocab=hp["n_vocab"], rms_eps=hp["rms_eps"], tied_embeddings=tied)
    w = _writer(path, "llama", "tiny-llama-test", hp["n_layer"], hp)
    w.add_layer_norm_rms_eps(hp["rms_eps"])
    w.add_rope_freq_base(hp["rope_base"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_tokenizer_model("gpt2")           # a placeholder vocabulary the tokenizer accepts
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([chr(65 + i) for i in range(hp["n_vocab"] - 2)] + ["AB", "CD"])
    w.add_token_merges(["A B", "C D"])
    w.add_eos_token_id(hp["n_vocab"] - 1)

    def values(name, shape, rng):
        if len(shape) == 1:
            return 1.0 + 0.1 * rng.standard_normal(shape)
        if name == "token_embd.weight" or name == "output.weight":
            return 0.15 * rng.standard_normal(shape)
        return rng.standard_normal(shape) / np.sqrt(shape[1])
    model = TinyQwen35(Path(path), hp)
    _add_tensors(w, model, cfg.tensor_shapes(), dtype, np.random.default_rng(seed),
                 values_fn=values)
    _finish(w, model.path)
    return model


def quantized_copy(f32_model: Path, like: Path, out: Path, type_name: str,
                   workers: int = 1) -> Path:
    """``f32_model`` with every tensor that ``like`` stores quantized re-encoded as
    ``type_name`` by ggml's quantizer (other tensors and every key unchanged).

    Why: Q4_0 is the type ggml-cpu repacks on any AVX2 CPU (CPU_REPACK) and puts in AMX tiles
    on Intel AMX CPUs, so a model in it shows on every x86 machine whether llama.cpp was kept
    off its extra buffer types.  ``workers`` threads quantize slabs of rows at once (ggml's
    quantizer runs without the GIL): the 2B-shape benchmark model has 2 billion values."""
    import gguf

    src, ref = gguf.GGUFReader(f32_model), gguf.GGUFReader(like)
    quantized = {t.name for t in ref.tensors
                 if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                          gguf.GGMLQuantizationType.F16,
                                          gguf.GGMLQuantizationType.BF16)}
    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    w = _copy_keys(src, out)
    for t in src.tensors:
        values = np.asarray(t.data).reshape([int(n) for n in reversed(t.shape)])
        if t.name in quantized:
            raw = _encode_rows(values, ggml.TYPES[type_name], workers)
            w.add_tensor(t.name, raw.reshape(values.shape[0], -1), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, values)
    return _finish(w, out)


def _copy_keys(r: "gguf.GGUFReader", out: Path, arch: str | None = None,
               rename=lambda name: name) -> "gguf.GGUFWriter":
    """A writer for ``out`` holding every key of ``r`` under ``rename(name)`` (None drops
    it); ``general.architecture`` is ``arch``, by default ``r``'s."""
    w = gguf.GGUFWriter(out, arch or str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        name = None if f.name.startswith("GGUF.") or f.name == "general.architecture" \
            else rename(f.name)
        if name is None:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    return w


def _copy_tensors(r: "gguf.GGUFReader", w: "gguf.GGUFWriter") -> None:
    """Every tensor of ``r``, bytes and type unchanged."""
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=[int(n) for n in reversed(t.shape)],
                     raw_dtype=t.tensor_type)


def _finish(w: "gguf.GGUFWriter", out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _encode_rows(values: np.ndarray, ggml_type: int, workers: int) -> np.ndarray:
    """``ggml.to_bytes`` of a matrix, slabs of rows on ``workers`` threads (the same bytes)."""
    rows = values.reshape(-1, values.shape[-1])
    if workers <= 1 or rows.shape[0] < 2 * workers:
        return ggml.to_bytes(values, ggml_type, row_len=values.shape[-1])
    from concurrent.futures import ThreadPoolExecutor
    slabs = np.array_split(rows, workers)
    with ThreadPoolExecutor(workers) as ex:
        parts = list(ex.map(lambda r: ggml.to_bytes(r, ggml_type, row_len=r.shape[-1]), slabs))
    return np.concatenate(parts)


def retyped_copy(src: Path, out: Path, from_type: str, to_type: str) -> Path:
    """``src`` with every ``from_type`` tensor re-encoded as ``to_type`` (keys and every other
    tensor unchanged): e.g. a BF16 model as F16, the type pytrain keeps BF16 weights in on the
    CPU, for llama.cpp to run with the same weights and activation rounding."""
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(src)
    w = _copy_keys(r, out)
    for t in r.tensors:
        if t.tensor_type.name != from_type.upper():
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=[int(n) for n in reversed(t.shape)],
                         raw_dtype=t.tensor_type)
            continue
        values = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
            [int(n) for n in reversed(t.shape)])
        if to_type.lower() in ("f16", "f32"):        # numpy has the dtype: the writer types it
            w.add_tensor(t.name, values.astype(np.float16 if to_type.lower() == "f16"
                                               else np.float32))
            continue
        raw = ggml.to_bytes(values, ggml.TYPES[to_type.lower()], row_len=values.shape[-1])
        w.add_tensor(t.name, raw.reshape(*values.shape[:-1], -1),
                     raw_dtype=gguf.GGMLQuantizationType[to_type.upper()])
    return _finish(w, out)


def perturbed_copy(src: Path, out: Path, seed: int = 0) -> Path:
    """``src`` with every element of every F32 tensor moved one float32 step up or down at
    random: the same model off by one unit of float32 rounding in each weight, whose logits
    show how much this network amplifies float32 rounding (tests/bounds.py)."""
    import gguf
    r = gguf.GGUFReader(src)
    w = _copy_keys(r, out)
    rng = np.random.default_rng(seed)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type.name == "F32":
            up = rng.integers(0, 2, data.shape).astype(bool)
            data = np.where(up, np.nextafter(data, np.float32(np.inf)),
                            np.nextafter(data, np.float32(-np.inf))).astype(np.float32)
        w.add_tensor(t.name, data, raw_shape=[int(n) for n in reversed(t.shape)],
                     raw_dtype=t.tensor_type)
    return _finish(w, out)


def renamed_arch_copy(src: Path, out: Path, arch: str) -> Path:
    """``src`` with ``general.architecture`` and every ``<old arch>.*`` key renamed to
    ``arch``: the same tensors under another architecture name."""
    r = gguf.GGUFReader(src)
    old = str(r.fields["general.architecture"].contents())
    w = _copy_keys(r, out, arch, lambda name: arch + name[len(old):]
                   if name.startswith(old + ".") else name)
    _copy_tensors(r, w)
    return _finish(w, out)


def with_keys(src: Path, out: Path, keys: dict) -> Path:
    """``src`` with metadata ``keys`` added or replaced (values as Python str/int/float, or
    lists of them; floats are written as F32, ints as U32, list ints as I32), every tensor
    unchanged."""
    r = gguf.GGUFReader(src)
    w = _copy_keys(r, out, rename=lambda name: None if name in keys else name)

    def vtype(v, in_list=False):
        return (gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.FLOAT32
                if isinstance(v, float) else gguf.GGUFValueType.INT32 if in_list
                else gguf.GGUFValueType.UINT32)
    for k, v in keys.items():
        if isinstance(v, list):
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=vtype(v[0], True))
        else:
            w.add_key_value(k, v, vtype(v))
    _copy_tensors(r, w)
    return _finish(w, out)
