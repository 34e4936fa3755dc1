"""Gradient accumulators, global-norm clipping and AdamW over the LoRA parameters.

The accumulators are static tensors that every micro-batch graph's backward adds into
(ggml's grad_accs); the step is two small static graphs: the global gradient norm (read on
the host, so a NaN/inf stops the run before any parameter changes) and the update
(clip factor and AdamW hyperparameters are runtime inputs: schedules need no rebuild).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pytrain import ggml
from pytrain.ggml import ffi, lib


class OptimizerState:
    """Per trainable tensor: an F32 gradient accumulator (the step graphs add into it) and the
    two AdamW moments.  The accumulators have a buffer of their own, so that summing them
    across data-parallel ranks is one message (``allreduce_grads``)."""

    def __init__(self, runtime: ggml.Runtime, params: list):
        self.runtime = runtime
        self.params = list(params)
        n = len(self.params)
        self.grad_ctx = ggml.Context(n_tensors=n)
        self.ctx = ggml.Context(n_tensors=2 * n)
        self.grad, self.m, self.v = {}, {}, {}
        for p in self.params:
            nm = ggml.name(p)
            for store, tag, ctx in ((self.grad, "grad", self.grad_ctx), (self.m, "adam_m", self.ctx),
                                    (self.v, "adam_v", self.ctx)):
                t = lib.ggml_dup_tensor(ctx.ptr, p)
                ggml.set_name(t, f"{tag}.{nm}"[:63])
                store[nm] = t
        self.grad_buffer = self.buffer = None
        try:
            self.grad_buffer = runtime.alloc(self.grad_ctx)
            self.buffer = runtime.alloc(self.ctx)
        except BaseException:
            self.close()
            raise
        for b in (self.grad_buffer, self.buffer):
            lib.ggml_backend_buffer_clear(b, 0)

    def allreduce_grads(self, world) -> None:
        """Sum the accumulators across the ranks of ``world``, in one message: over the
        buffer's own memory where it is host memory (the CPU), else through one host copy."""
        if world.size == 1:
            return
        buf = self.grad_buffer
        if lib.ggml_backend_buffer_is_host(buf):
            base = lib.ggml_backend_buffer_get_base(buf)
            size = int(lib.ggml_backend_buffer_get_size(buf)) // 4
            world.allreduce_sum(np.frombuffer(ffi.buffer(ffi.cast("float *", base), size * 4),
                                              dtype=np.float32))
            return
        parts = [(t, int(lib.ggml_nelements(t))) for t in self.grad.values()]
        flat = np.empty(sum(n for _, n in parts), np.float32)
        at = 0
        for t, n in parts:
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(flat[at:at + n]), 0, n * 4)
            at += n
        world.allreduce_sum(flat)
        at = 0
        for t, n in parts:
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(flat[at:at + n]), 0, n * 4)
            at += n

    def close(self) -> None:
        """Free the accumulators and moments (their buffers live until the runtime closes
        otherwise); a second call does nothing."""
        for buf in (self.grad_buffer, self.buffer):
            if buf is not None:
                self.runtime.free(buf)
        self.grad_buffer = self.buffer = None
        self.grad_ctx.close()
        self.ctx.close()

    def zero_grads(self) -> None:
        for t in self.grad.values():
            lib.ggml_backend_tensor_memset(t, 0, 0, lib.ggml_nbytes(t))

    def grads(self) -> dict[str, np.ndarray]:
        return {k: ggml.to_numpy(t).copy() for k, t in self.grad.items()}

    def moments(self) -> dict[str, np.ndarray]:
        out = {}
        for k in self.m:
            out["m." + k] = ggml.to_numpy(self.m[k]).copy()
            out["v." + k] = ggml.to_numpy(self.v[k]).copy()
        return out

    def set_moments(self, values: dict[str, np.ndarray]) -> None:
        for k in self.m:
            ggml.from_numpy(self.m[k], values["m." + k])
            ggml.from_numpy(self.v[k], values["v." + k])


@dataclass
class AdamWSettings:
    """AdamW's hyperparameters and the clipping norm (the step itself is :class:`Optimizer`)."""
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0     # 0 disables clipping
    b_lr_ratio: float = 1.0        # LoRA+: the B matrices' learning rate is lr times this


class Optimizer:
    """The gradient-norm graph and the AdamW update graph over an ``OptimizerState``."""

    def __init__(self, runtime: ggml.Runtime, opt_state: OptimizerState, hp: AdamWSettings):
        self.rt, self.opt_state, self.hp = runtime, opt_state, hp
        n = len(opt_state.params)
        size = 16 * n + 64
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        c = self.ctx.ptr
        # ||g||^2 = sum over tensors of sum(g^2)
        sq = None
        for p in opt_state.params:
            s = lib.ggml_sum(c, lib.ggml_sqr(c, opt_state.grad[ggml.name(p)]))
            sq = s if sq is None else lib.ggml_add(c, sq, s)
        self.sumsq = sq
        lib.ggml_set_output(sq)
        self.norm_graph = ggml.new_graph(self.ctx, size)
        lib.ggml_build_forward_expand(self.norm_graph, sq)
        # update: g' = g * clip; AdamW step in place on the parameter
        self.clip = lib.ggml_new_tensor_1d(c, lib.GGML_TYPE_F32, 1)
        self.adamw_params = lib.ggml_new_tensor_1d(c, lib.GGML_TYPE_F32, 7)
        # LoRA+ (PEFT's create_loraplus_optimizer): the B matrices get their own learning rate
        self.adamw_params_b = lib.ggml_new_tensor_1d(c, lib.GGML_TYPE_F32, 7) \
            if hp.b_lr_ratio != 1.0 else self.adamw_params
        for t in (self.clip, self.adamw_params, self.adamw_params_b):
            lib.ggml_set_input(t)
        self.update_graph = ggml.new_graph(self.ctx, size)
        for p in opt_state.params:
            k = ggml.name(p)
            g = lib.ggml_mul(c, opt_state.grad[k], self.clip)
            hyper = self.adamw_params_b if k.endswith(".lora_b") else self.adamw_params
            lib.ggml_build_forward_expand(
                self.update_graph,
                lib.ggml_opt_step_adamw(c, p, g, opt_state.m[k], opt_state.v[k], hyper))
        # allocated once, beside the scheduler: the step graph stays allocated between steps
        self._kept: list = []
        try:
            for graph in (self.norm_graph, self.update_graph):
                self._kept.append(runtime.alloc_resident(graph))
        except BaseException:
            self.close()
            raise
        self.t = 0

    def close(self) -> None:
        """Free the two kept graphs' buffers and their context; a second call does nothing."""
        for galloc in self._kept:
            self.rt.free_resident(galloc)
        self._kept = []
        self.ctx.close()

    def grad_norm(self) -> float:
        self.rt.compute_resident(self.norm_graph)
        return math.sqrt(max(float(ggml.to_numpy(self.sumsq).reshape(-1)[0]), 0.0)) \
            if np.isfinite(ggml.to_numpy(self.sumsq)).all() else float("nan")

    def step(self, lr: float, grad_norm: float) -> float:
        """Apply one AdamW step with learning rate ``lr``; returns the clip factor used."""
        hp = self.hp
        self.t += 1
        clip = 1.0
        if hp.max_grad_norm > 0 and grad_norm > hp.max_grad_norm:
            clip = hp.max_grad_norm / (grad_norm + 1e-6)
        ggml.from_numpy(self.clip, np.array([clip], np.float32))
        b1h = 1.0 / (1.0 - hp.beta1 ** self.t)
        b2h = 1.0 / (1.0 - hp.beta2 ** self.t)
        for hyper, rate in ((self.adamw_params, lr), (self.adamw_params_b, lr * hp.b_lr_ratio)):
            ggml.from_numpy(hyper, np.array(
                [rate, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, b1h, b2h], np.float32))
        self.rt.compute_resident(self.update_graph)
        return clip


def schedule(kind: str, step: int, total: int, lr: float, warmup: int = 0) -> float:
    """Learning rate at 0-based ``step`` of ``total``: linear warmup, then constant, linear
    decay to 0, or cosine decay to 0."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    span = max(1, total - warmup)
    frac = min(1.0, (step - warmup) / span)
    if kind == "linear":
        return lr * (1.0 - frac)
    if kind == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown schedule {kind!r}: constant, linear or cosine")
