"""A loaded model: runtime, weights, tokenizer and forward graphs, behind a small API.

    model = pytrain.load_model("model.gguf", device="auto", threads=None)
    model.logits(tokens)              # [T] or [B, T] ints -> float32 [T, V] / [B, T, V]
    model.generate(prompt_tokens, max_new_tokens=32)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping
from functools import cached_property

import numpy as np

from pytrain import ggml
from pytrain.errors import PytrainError
from pytrain.ggml import lib
from pytrain.models.model_file import ModelFileError, open_model
from pytrain import models
from pytrain.models import Architecture, precision
from pytrain.data import pad_token_id
from pytrain.data.tokenizer import Tokenizer
from pytrain.formats.gguf_tensors import is_elementwise, open_reader
from pytrain.models.weights import dequantize_targets, load_weights


class TokenIdError(PytrainError, ValueError):
    """A token id outside the model's vocabulary: ggml's GET_ROWS would abort the process
    (``GGML_ASSERT(i01 >= 0 && i01 < ne01)``), so it is refused before any graph runs."""


def check_token_ids(ids: np.ndarray, n_vocab: int, what: str = "input") -> None:
    """Refuse ids outside [0, n_vocab), naming the first one and where it is."""
    ids = np.asarray(ids)
    bad = (ids < 0) | (ids >= n_vocab)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TokenIdError(f"{what}: token id {int(ids[where])} at index {where} is outside the "
                           f"model's vocabulary (ids 0..{n_vocab - 1})")


@dataclass
class Model:
    path: str
    config: object
    metadata: dict
    runtime: ggml.Runtime
    weights: object
    tokenizer: Tokenizer
    arch: Architecture
    compute: str = "compute f32"     # what multiplies the weights (pytrain.models.precision)
    device: str | None = None        # the device the graphs are for (None: the runtime's); a
                                     # shape model measured on the CPU for a GPU names the GPU

    @cached_property
    def graph(self):
        """The architecture's graph builder over these weights (one per model)."""
        g = self.arch.graph(self.config, self.weights.tensors)
        # the CPU's fused recurrence (patch 0020); PYTRAIN_FUSED_RECURRENCE=0 keeps the chunked
        # ops a GPU runs, e.g. to compare a device's bits with the CPU's on the same graph
        g.fused_recurrence = ((self.device or self.runtime.device) == "cpu" and
                              os.environ.get("PYTRAIN_FUSED_RECURRENCE", "1") not in ("", "0"))
        return g

    @property
    def pad_id(self) -> int:
        """The id written at padding positions (the pad token, else EOS); padding is never a
        target, so it only decides what the forward pass reads there."""
        return pad_token_id(self.tokenizer)

    def graph_budget(self, T: int) -> int:
        """Nodes (and tensors) a forward + backward graph of this model may need at length T."""
        return 2048 + self.config.n_layer * self.arch.layer_budget(self.config, T)

    def input_values(self, tokens: np.ndarray, seg: np.ndarray) -> dict:
        """The graph inputs of a batch; every forward and training graph takes its tokens
        from here, so an id outside the vocabulary is refused here."""
        check_token_ids(tokens, self.config.n_vocab, "tokens")
        return self.arch.input_values(self.config, tokens, seg)

    def logits(self, tokens, seg: np.ndarray | None = None, lora=None,
               last_only: bool = False) -> np.ndarray:
        """Log-its of every position ([B, T, V], or [T, V] for one sequence); right padding (or
        packing via ``seg``) is the caller's.  ``last_only``: of position T-1 only ([B, V] or
        [V]), skipping the LM head everywhere else."""
        arr = np.asarray(tokens)
        single = arr.ndim == 1
        arr = np.atleast_2d(arr).astype(np.int64)
        B, T = arr.shape
        Tp = self.arch.padded_length(T)
        if seg is None:
            seg = np.zeros((B, T), np.int64)
        seg = np.atleast_2d(seg)
        pad_tok = self.pad_id
        tok_p = np.full((B, Tp), pad_tok, np.int64)
        tok_p[:, :T] = arr
        seg_p = np.full((B, Tp), -1, np.int64)
        seg_p[:, :T] = seg
        def build(ctx):
            fwd = self.graph.build(ctx, B, Tp, lora, rows=B if last_only else None)
            rows = (T - 1 + Tp * np.arange(B)) if last_only else None   # flat position T-1
            return fwd.logits, fwd.inputs, [], self.input_values(tok_p, seg_p), rows
        out = self._compute(self.graph_budget(Tp), build).reshape(B, -1, self.config.n_vocab)
        out = out[:, 0] if last_only else out[:, :T]
        return out[0] if single else out

    def _compute(self, size: int, build) -> np.ndarray:
        """One forward graph, built, allocated, filled, computed and freed: ``build(ctx)``
        gives (logits, graph inputs, nodes to compute first, input values, head rows or
        None); returns a copy of the logits."""
        ctx = ggml.Context(n_tensors=size, graph_size=size)
        try:
            logits, inputs, first, vals, rows = build(ctx.ptr)
            lib.ggml_set_output(logits)
            gf = ggml.new_graph(ctx, size)
            for t in first:
                lib.ggml_build_forward_expand(gf, t)
            lib.ggml_build_forward_expand(gf, logits)
            self.runtime.alloc_graph(gf, ctx)
            self.arch.set_inputs(inputs, vals)
            if rows is not None:
                ggml.from_numpy(inputs.rows, np.asarray(rows, np.int32))
            self.runtime.compute(gf)
            return ggml.to_numpy(logits).copy()
        finally:
            self.runtime.forget_graph()
            ctx.close()

    def generate(self, prompt_tokens, max_new_tokens: int = 64, temperature: float = 0.0,
                 seed: int = 0, stop_ids=None, lora=None) -> list[int]:
        """Sample up to ``max_new_tokens`` after the prompt, stopping at an end-of-generation
        token.  Architectures with a KV cache (``Architecture.decode_values``: the Llama family
        and Gemma 3) compute
        each new token once; the others recompute the whole prefix each step, which is fine
        for the small models and short answers of evaluation and demos."""
        rng = np.random.default_rng(seed)
        stop = set(self.tokenizer.eog_ids if stop_ids is None else stop_ids)
        toks = list(prompt_tokens)
        out: list[int] = []
        if not toks:
            raise ValueError("generate needs a prompt of at least one token")
        check_token_ids(np.array(toks), self.config.n_vocab, "prompt")
        steps = self._cached_steps(toks, max_new_tokens, lora) \
            if self.arch.decode_values is not None else None
        try:
            for _ in range(max_new_tokens):
                if steps is not None:
                    last = steps.send(None if not out else out[-1]).astype(np.float64)
                else:
                    last = self.logits(np.array(toks), lora=lora, last_only=True).astype(np.float64)
                if temperature <= 0:
                    nxt = int(last.argmax())
                else:
                    p = np.exp((last - last.max()) / temperature)
                    nxt = int(rng.choice(len(p), p=p / p.sum()))
                if nxt in stop:
                    break
                out.append(nxt)
                toks.append(nxt)
        finally:
            if steps is not None:
                steps.close()          # frees the KV cache now, not when collected
        return out

    def _cached_steps(self, prompt: list[int], max_new_tokens: int, lora):
        """A generator of next-token logits with a KV cache: the first ``send(None)`` runs the
        prompt, each later ``send(token)`` runs that one token after everything before it."""
        from pytrain.models.transformer import KVCache
        c = self.config
        cache = KVCache(self.runtime, c.n_layer, c.head_dim, c.n_head_kv,
                        len(prompt) + max_new_tokens)
        n_past, new = 0, list(prompt)

        def build(ctx):
            logits, inp, stores = self.graph.decode(ctx, cache, n_past, len(new), lora)
            return logits, inp, stores, self.arch.decode_values(c, n_past, np.array(new)), \
                [len(new) - 1]
        try:
            while True:
                out = self._compute(self.graph_budget(len(new)), build).reshape(-1)
                n_past += len(new)
                nxt = yield out
                new = [nxt]
        finally:
            cache.close()

    def close(self) -> None:
        self.weights.close()
        self.runtime.close()


def load_model(path: str | os.PathLike, device: str = "auto", threads: int | None = None,
               type_policy: str = "auto", device_index: int = 0,
               dequantize: Mapping[int, int] | Callable[..., Mapping[int, int]] | None = None,
               compute_type: str = "f32") -> Model:
    """``device_index``: which CUDA device (modulo their count): a data-parallel rank's
    place on its host, one GPU per rank.  ``dequantize``: file types ``auto`` loads as F32 or
    F16 (``pytrain.models.weights``), or a function of (runtime, the file's tensor index, the
    shapes to load) returning them, called once the device is known (a training run's
    measured choice, ``pytrain.run.type_choice``); under bf16 compute, the quantized types
    loaded as BF16.  ``compute_type``: "f32", or "bf16"
    (CPU: weight matrices as BF16, multiplied on the CPU's bf16 units;
    ``pytrain.models.precision``); ``Model.compute`` says what ran."""
    type_policy = precision.type_policy_for(compute_type, type_policy)
    reader = open_reader(path)
    arch, meta, infos, config = open_model(path, reader)
    tokenizer = Tokenizer.from_metadata(meta)
    tokenizer.source = str(path)
    if tokenizer.vocab_size > config.n_vocab:     # llama.cpp refuses such a file too
        raise ModelFileError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight "
            f"has {config.n_vocab} rows: ids {config.n_vocab}..{tokenizer.vocab_size - 1} "
            f"would have no embedding")
    rt = ggml.Runtime(device, threads=threads, device_index=device_index)
    try:
        compute = precision.check_runtime(compute_type, rt)
        shapes = config.tensor_shapes()
        if callable(dequantize):
            dequantize = dequantize(rt, infos, shapes)
        if dequantize:
            # an adapter's record made under the other compute type (pytrain.load): its F32/F16
            # copies do not apply under bf16, nor its BF16 copies under f32
            ok = dequantize_targets(type_policy)
            dequantize = {k: v for k, v in dequantize.items() if v in ok}
        weights = load_weights(path, rt, shapes, type_policy, reader=reader,
                               dequantize=dequantize)
        if compute_type == "bf16":
            compute = precision.with_matrices(compute, (
                (r.file_type, r.loaded_type) for r in weights.report.values()
                if not is_elementwise(r.name, r.shape)))
    except BaseException:
        rt.close()
        raise
    return Model(str(path), config, meta, rt, weights, tokenizer, models.get(arch), compute)
