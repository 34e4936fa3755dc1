"""A training step that keeps one layer's activations at a time: forward layer by layer,
keeping only each layer's input, then backward layer by layer from the top, recomputing that
layer's forward first (activation checkpointing at layer granularity).

Why: one graph for a whole step keeps every activation the backward needs.  At the Qwen3.5-2B
shape that is ~1.45 GiB per DeltaNet layer per 4096 tokens and 34 GiB for batch 4 x 1024
(``scripts/bench_memory.py``), more than HF + PEFT's whole process.  Here the compute buffer
holds one layer's graph, and the LM head and loss run on chunks of the target rows, so the
vocabulary-sized tensors are [V, chunk] instead of [V, rows].  The price is a second forward
of the layers above the first adapter.

The backward of layer l is the gradient of the surrogate Σ layer_l(x_l) ⊙ g_{l+1}, where
g_{l+1} = dL/dx_{l+1} comes from the layer above: its gradients are g_{l+1}ᵀ ∂layer_l/∂θ, the
chain rule, computed by ggml's autodiff on the same ops as the one-graph step.
"""
from __future__ import annotations

import re

import numpy as np

from pytrain import ggml
from pytrain.step import loss as loss_mod
from pytrain.ggml import lib
from pytrain.step.graphs import pad_batch
from pytrain.models.lora import LoraAdapter
from pytrain.models.model import Model
from pytrain.step.optimizer import OptimizerState

_BLOCK = re.compile(r"^blk\.(\d+)\.")
HEAD_CHUNK_BYTES = 256 << 20      # one [V, chunk] F32 tensor of the head and loss at most


def first_adapted_layer(names: list[str]) -> int:
    """The lowest block an adapter touches; only blocks from there up need a backward."""
    layers = []
    for n in names:
        m = _BLOCK.match(n)
        if m is None:
            raise ValueError(f"layer-wise recompute needs adapters inside blocks; {n!r} is not")
        layers.append(int(m.group(1)))
    return min(layers)


def head_chunk(n_vocab: int, n_rows: int) -> int:
    """Rows per head-and-loss graph: [V, chunk] F32 within HEAD_CHUNK_BYTES, a multiple of 16."""
    fit = max(16, (HEAD_CHUNK_BYTES // (4 * n_vocab)) // 16 * 16)
    return min(fit, -(-n_rows // 16) * 16)


class _Graph:
    """One graph in a context of its own."""

    def __init__(self, size: int, grads: bool = False):
        self.ctx = ggml.Context(n_tensors=size, graph_size=size, grads=grads)
        self.c = self.ctx.ptr
        self.size = size
        self.graph = None
        self.masks: list = []          # its dropout masks (lora.dropout), filled per run

    def close(self) -> None:
        self.ctx.close()


class RecomputeGraph:
    """Same use as ``GradGraph``: ``accumulate`` adds one micro-batch's gradients into the
    shared accumulators and returns its share of the step loss."""

    def __init__(self, model: Model, adapter: LoraAdapter, B: int, T: int,
                 opt_state: OptimizerState | None = None, measure_only: bool = False):
        """``measure_only``: graphs only measured (``pytrain plan``), never run: the layer
        inputs kept between graphs, B·T·n_embd floats per layer, are not allocated."""
        cfg, rt = model.config, model.runtime
        self.model, self.adapter, self.measure_only = model, adapter, measure_only
        self.B, self.T = B, model.arch.padded_length(T)
        self.l0 = first_adapted_layer(adapter.names)
        self.rows = head_chunk(cfg.n_vocab, B * self.T)
        self.params = {ggml.address(p): p for p in adapter.params()}
        self.pctx = self.pbuf = self.ce = None
        self._made: list[_Graph] = []     # every graph context made so far, freed by close
        self.own_state = opt_state is None
        self.opt_state = opt_state or OptimizerState(rt, adapter.params())
        try:
            self._build_inputs()
            size = model.arch.layer_budget(cfg, self.T)
            self._build_forward(size)
            self._build_head()
            self._build_backward(size)
        except BaseException:     # a failed build keeps no buffer (they outlive Python's GC)
            self.close()
            raise

    def _graph(self, size: int, grads: bool = False) -> _Graph:
        gr = _Graph(size, grads)
        self._made.append(gr)
        return gr

    def _build_inputs(self) -> None:
        """Persistent: the batch's inputs (shared by every graph), each layer's input, the
        gradient handed down (two, alternating), d(loss)/d(loss) = 1."""
        cfg, B, T, f32 = self.model.config, self.B, self.T, lib.GGML_TYPE_F32
        L, E, N = cfg.n_layer, cfg.n_embd, B * self.T
        self.pctx = ggml.Context(n_tensors=32 + (L - self.l0 + 1) + 3)
        self.inp = self.model.graph.new_inputs(self.pctx.ptr, B, T)
        self.xs = {l: lib.ggml_new_tensor_2d(self.pctx.ptr, f32, E, N)
                   for l in range(self.l0, L + 1)}
        self.gs = [lib.ggml_new_tensor_2d(self.pctx.ptr, f32, E, N) for _ in range(2)]
        self.seed = lib.ggml_new_tensor_1d(self.pctx.ptr, f32, 1)
        self.pbuf = self.model.runtime.alloc(self.pctx, measure_only=self.measure_only)
        if not self.measure_only:
            ggml.from_numpy(self.seed, np.ones(1, np.float32))

    def _build_forward(self, size: int) -> None:
        """Embedding and the frozen layers below the first adapter, then one graph per layer,
        each writing its output into the next layer's input."""
        g, B, T, L = self.model.graph, self.B, self.T, self.model.config.n_layer
        self.pre = self._graph(size * (self.l0 + 1))
        x = g.embed(self.pre.c, self.inp)
        for il in range(self.l0):
            x = g.layer(self.pre.c, il, x, self.inp, B, T, None)
        self.pre.graph = ggml.new_graph_for(self.pre.c, lib.ggml_cpy(self.pre.c, x, self.xs[self.l0]),
                                            size=self.pre.size)
        self.fwd = []
        for il in range(self.l0, L):
            fg = self._graph(size)
            with self.adapter.training_masks() as fg.masks:
                y = g.layer(fg.c, il, self.xs[il], self.inp, B, T, self.adapter.hook)
            fg.graph = ggml.new_graph_for(fg.c, lib.ggml_cpy(fg.c, y, self.xs[il + 1]), size=size)
            self.fwd.append(fg)

    def _build_head(self) -> None:
        """Head + loss on a chunk of rows: the gradient of x_L accumulated into gs[0]."""
        cfg, g, L = self.model.config, self.model.graph, self.model.config.n_layer
        hg = self._graph(4096, grads=True)
        lib.ggml_set_param(self.xs[L])
        row_mask = loss_mod.new_row_mask(hg.c, self.rows)
        logits = g.head(hg.c, self.xs[L], self.inp, self.B, self.T, self.rows, row_mask)
        self.ce = loss_mod.build(self.model.runtime, hg.c, logits, cfg.n_vocab, self.rows,
                                 row_mask, self.measure_only)
        gf = ggml.new_graph(hg.ctx, 4096, grads=True)
        lib.ggml_build_forward_expand(gf, self.ce.loss)
        hg.graph = ggml.build_backward(hg.ctx, gf, self.ce.loss,
                                       {ggml.address(self.xs[L]): self.gs[0]}, self.seed)
        self.head = hg

    def _build_backward(self, size: int) -> None:
        """Backward of layer l: surrogate Σ y ⊙ g_{l+1}; LoRA gradients into the
        accumulators, x_l's gradient copied into the other buffer."""
        g, B, T, L = self.model.graph, self.B, self.T, self.model.config.n_layer
        self.bwd = {}
        for il in reversed(range(self.l0, L)):
            bg = self._graph(size * 2, grads=True)
            g_in, g_out = self.gs[(L - 1 - il) % 2], self.gs[(L - il) % 2]
            x_in = self.xs[il]
            lib.ggml_set_param(x_in)
            with self.adapter.training_masks() as bg.masks:     # the forward's masks again
                y = g.layer(bg.c, il, x_in, self.inp, B, T, self.adapter.hook)
            surrogate = lib.ggml_sum(bg.c, lib.ggml_mul(bg.c, y, g_in))
            gf = ggml.new_graph(bg.ctx, size * 2, grads=True)
            lib.ggml_build_forward_expand(gf, surrogate)
            accs = {a: self.opt_state.grad[ggml.name(p)] for a, p in self.params.items()}
            bg.graph = ggml.build_backward(bg.ctx, gf, surrogate, accs, self.seed)
            if il > self.l0:           # the lowest adapted layer hands nothing further down
                dx = ggml.grad_of(bg.graph, x_in)
                lib.ggml_build_forward_expand(bg.graph, lib.ggml_cpy(bg.c, dx, g_out))
            self.bwd[il] = bg

    def _run(self, graph_obj: _Graph) -> None:
        rt = self.model.runtime
        rt.alloc_graph(graph_obj.graph, graph_obj.ctx)
        if graph_obj.masks:
            self.adapter.fill_masks(graph_obj.masks, self._dropout_key)
        rt.compute(graph_obj.graph)

    def accumulate(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
                   n_valid_step: int | None = None, buggy: bool = False,
                   dropout_key: tuple[int, ...] = (0, 0)) -> tuple[float, int]:
        self._dropout_key = dropout_key
        if buggy:
            raise ValueError("the bug reproduction trains every row in one graph: use GradGraph")
        cfg, rt = self.model.config, self.model.runtime
        pad = self.model.pad_id
        tok, sg, tg = pad_batch(self.B, self.T, tokens, seg, targets, pad)
        self.model.arch.set_inputs(self.inp, self.model.input_values(tok, sg))
        self._run(self.pre)
        for fg in self.fwd:
            self._run(fg)
        # head and loss over the target rows, a chunk at a time
        g_top = self.gs[0]
        lib.ggml_backend_tensor_memset(g_top, 0, 0, lib.ggml_nbytes(g_top))
        flat = tg.reshape(-1)
        idx = np.nonzero(flat >= 0)[0]
        total, n_valid = 0.0, 0
        n_step = n_valid_step if n_valid_step is not None else int(idx.size)
        for start in range(0, max(idx.size, 1), self.rows):
            part = idx[start:start + self.rows]
            sel = np.zeros(self.rows, np.int32)
            sel[:part.size] = part
            ctg = np.full(self.rows, loss_mod.IGNORE, np.int64)
            ctg[:part.size] = flat[part]
            rt.alloc_graph(self.head.graph, self.head.ctx)
            ggml.from_numpy(self.inp.rows, sel)
            n_valid += self.ce.prepare(ctg, self.model.tokenizer.pad_id, n_step)
            rt.compute(self.head.graph)
            total += float(ggml.to_numpy(self.ce.loss).reshape(-1)[0])
        for il in reversed(range(self.l0, cfg.n_layer)):
            self._run(self.bwd[il])      # writes dL/dx_il over the buffer the layer above read
        return total, n_valid

    def run(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
            n_valid_step: int | None = None) -> dict:
        """Loss and fresh gradients of one micro-batch (zeroes the accumulators first)."""
        self.opt_state.zero_grads()
        loss, n_valid = self.accumulate(tokens, seg, targets, n_valid_step)
        return {"loss": loss, "n_valid": n_valid, "grads": self.opt_state.grads()}

    def graphs(self) -> list:
        return [self.pre.graph, *(f.graph for f in self.fwd), self.head.graph,
                *(b.graph for b in self.bwd.values())]

    def close(self) -> None:
        """Free what the graph made, also after a build that stopped half-way."""
        rt = self.model.runtime
        rt.forget_graph()
        if self.ce is not None:
            self.ce.close()
        for gr in self._made:
            gr.close()
        self._made = []
        if self.pbuf is not None:
            rt.free(self.pbuf)
            self.pbuf = None
        if self.pctx is not None:
            self.pctx.close()
        if self.own_state:
            self.opt_state.close()
