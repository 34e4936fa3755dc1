"""One static graph per batch shape: forward with the adapter → masked CE → backward.

Built once and reused for every micro-batch of that shape: only inputs change (tokens,
positions, masks, labels, loss_scale), so no graph is rebuilt per step.
"""
from __future__ import annotations

import numpy as np

from pytrain import ggml, loss as loss_mod
from pytrain.ggml import lib
from pytrain.lora import LoraAdapter
from pytrain.model import Model, graph_budget
from pytrain.models import qwen35


class GradGraph:
    def __init__(self, model: Model, adapter: LoraAdapter, B: int, T: int,
                 keep_logit_grad: bool = False):
        self.model, self.adapter = model, adapter
        self.B, self.T = B, qwen35.padded_length(T)
        size = graph_budget(model.config, self.T)
        self.ctx = ggml.Context(n_tensors=size * 2, graph_size=size * 2, grads=True)
        c = self.ctx.ptr
        self.fwd = model.graph.build(c, B, self.T, adapter.hook)
        V = model.config.n_vocab
        self.ce = loss_mod.build(c, self.fwd.logits, V, self.T * B)
        gf = ggml.new_graph(self.ctx, size * 2, grads=True)
        lib.ggml_build_forward_expand(gf, self.ce.loss)
        self.graph = ggml.build_backward(self.ctx, gf, self.ce.loss)
        self.grads = {}
        for t in adapter.params():
            g = ggml.grad_of(self.graph, t)
            lib.ggml_set_output(g)
            self.grads[ggml.name(t)] = g
        self.logit_grad = None
        if keep_logit_grad:
            g = ggml.grad_of(self.graph, self.fwd.logits)
            g = lib.ggml_cont(c, g) if not lib.ggml_is_contiguous(g) else g
            lib.ggml_build_forward_expand(self.graph, g)
            lib.ggml_set_output(g)
            self.logit_grad = g
        lib.ggml_set_output(self.fwd.logits)

    def pad(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray):
        """Right-pad a [B, T0] batch to the graph's length (padding: seg -1, IGNORE)."""
        B, T0 = tokens.shape
        pad_tok = self.model.tokenizer.pad_id or 0
        tok = np.full((B, self.T), pad_tok, np.int64)
        sg = np.full((B, self.T), -1, np.int64)
        tg = np.full((B, self.T), loss_mod.IGNORE, np.int64)
        tok[:, :T0], sg[:, :T0], tg[:, :T0] = tokens, seg, targets
        return tok, sg, tg

    def run(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
            n_valid_step: int | None = None, buggy: bool = False) -> dict:
        """Compute loss and gradients for one micro-batch; returns numpy results."""
        tok, sg, tg = self.pad(tokens, seg, targets)
        rt = self.model.runtime
        rt.alloc_graph(self.graph)
        qwen35.set_inputs(self.fwd, qwen35.input_values(self.model.config, tok, sg))
        n_valid = loss_mod.set_labels(self.ce, tg, self.model.config.n_vocab,
                                      self.model.tokenizer.pad_id, n_valid_step, buggy)
        ggml.seed_backward(self.graph)
        rt.compute(self.graph)
        out = {"loss": float(ggml.to_numpy(self.ce.loss).reshape(-1)[0]), "n_valid": n_valid,
               "grads": {k: ggml.to_numpy(g).copy() for k, g in self.grads.items()}}
        if self.logit_grad is not None:
            V = self.model.config.n_vocab
            out["logit_grad"] = ggml.to_numpy(self.logit_grad).reshape(self.B, self.T, V).copy()
        return out

    def close(self) -> None:
        lib.ggml_backend_sched_reset(self.model.runtime.sched)
        self.ctx.close()
