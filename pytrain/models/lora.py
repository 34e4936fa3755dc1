"""LoRA adapter tensors and the hook that adds them to the base projections.

For a frozen base W [n_out, n_in] the adapted projection is W·x + (alpha/r)·B·(A·x), with
A [r, n_in] and B [n_out, r] (numpy order).  In ggml ne order these are exactly llama.cpp's
adapter tensors: ``<name>.lora_a`` ne [n_in, r] and ``<name>.lora_b`` ne [r, n_out].  B starts
at zero, so training starts from the base model; A starts like PEFT's default
(Kaiming-uniform with a = sqrt(5): U(-1/sqrt(n_in), 1/sqrt(n_in))).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.models.lora_targets import lora_shapes


@dataclass
class LoraAdapter:
    rank: int                                 # the training rank (the largest, if they differ)
    alpha: float
    names: list[str]                          # adapted base tensors
    a: dict[str, object] = field(default_factory=dict)
    b: dict[str, object] = field(default_factory=dict)
    ctx: object = None
    buffer: object = None
    ranks: dict[str, int] = field(default_factory=dict)   # per pair, as llama.cpp reads them
    rslora: bool = False                      # rank-stabilised: scale alpha/sqrt(r) (PEFT's)
    dropout: float = 0.0                      # PEFT's lora_dropout on the adapter's input
    seed: int = 0                             # of the dropout masks
    _masks: list | None = None                # a training graph being built collects here

    def scale_of(self, name: str) -> float:
        """alpha / r of that pair (llama.cpp scales each pair by its own rank, A's rows), or
        alpha / sqrt(r) for rsLoRA, which keeps the update's size as r grows."""
        r = self.ranks.get(name, self.rank)
        return self.alpha / (math.sqrt(r) if self.rslora else r)

    @property
    def plain_alpha(self) -> float:
        """The alpha of a plain LoRA with these scales (alpha·sqrt(r) for rsLoRA): what an
        adapter GGUF holds, since llama.cpp always scales by alpha/r."""
        return self.alpha * math.sqrt(self.rank) if self.rslora else self.alpha

    def params(self) -> list:
        return [t for n in self.names for t in (self.a[n], self.b[n])]

    def hook(self, ctx, name: str, x):
        """The LoraFn of the architecture graphs: (alpha/r)·B·(A·x) for adapted tensors, else
        None.  In a training graph with dropout (``training_masks``), x is first multiplied
        by a mask input: PEFT's lora_B(lora_A(dropout(x))) · scale."""
        if name not in self.a:
            return None
        if self._masks is not None and self.dropout > 0:
            mask = lib.ggml_dup_tensor(ctx, x)                       # like x: [n_in, N]
            ggml.set_name(mask, f"dropout.{name}"[:63])
            lib.ggml_set_input(mask)
            self._masks.append((name, mask))
            x = lib.ggml_mul(ctx, x, mask)
        ax = lib.ggml_mul_mat(ctx, self.a[name], x)                   # [r, N]
        return lib.ggml_scale(ctx, lib.ggml_mul_mat(ctx, self.b[name], ax), self.scale_of(name))

    @contextlib.contextmanager
    def training_masks(self) -> Iterator[list]:
        """While a training graph is built: the dropout masks its hooks make, (name, tensor)
        pairs to fill (``fill_masks``) after each allocation of that graph, before it runs.
        Graphs built outside (evaluation, generation) have no dropout."""
        masks: list = []
        self._masks = masks
        try:
            yield masks
        finally:
            self._masks = None

    def fill_masks(self, masks: list, key: tuple[int, ...]) -> None:
        """Dropout masks drawn from (seed, ``key``, the tensor's index): ``key`` is the
        micro-batch's place in the run (optimizer step, micro-batch of the step), so a resumed
        run, more ranks, or a layer recomputed in the backward draw the same masks.  Kept
        elements are 1/(1-p), as torch's dropout scales them."""
        for name, t in masks:
            ggml.from_numpy(t, self.mask_values(name, ggml.shape(t), key))

    def mask_values(self, name: str, shape: tuple[int, ...], key: tuple[int, ...]
                    ) -> np.ndarray:
        """The dropout mask of tensor ``name``'s input at place ``key`` (``fill_masks``)."""
        p = self.dropout
        rng = np.random.default_rng([self.seed, *key, self.names.index(name)])
        keep = rng.random(shape, dtype=np.float32) >= np.float32(p)
        return keep.astype(np.float32) * np.float32(1.0 / (1.0 - p))

    def get(self) -> dict[str, np.ndarray]:
        out = {}
        for n in self.names:
            out[n + ".lora_a"] = ggml.to_numpy(self.a[n]).copy()
            out[n + ".lora_b"] = ggml.to_numpy(self.b[n]).copy()
        return out

    def set(self, values: dict[str, np.ndarray]) -> None:
        for n in self.names:
            ggml.from_numpy(self.a[n], values[n + ".lora_a"])
            ggml.from_numpy(self.b[n], values[n + ".lora_b"])

    def drift(self) -> float:
        """Σ over adapters of ‖B·A‖_F · alpha/r, the drift seed 000 tracks (at every step:
        from r x r products, ``product_sq_norm``)."""
        total = 0.0
        for n in self.names:
            a, b = ggml.to_numpy(self.a[n]), ggml.to_numpy(self.b[n])
            total += math.sqrt(product_sq_norm(a, b)) * self.scale_of(n)
        return total


def product_sq_norm(a: np.ndarray, b: np.ndarray) -> float:
    """‖B·A‖²_F for A [r, n_in] and B [n_out, r], in float64, as tr((BᵀB)(AAᵀ)).

    Why: the dense B·A is n_out x n_in (a 2048 x 6144 projection: 100 MB of float64 and
    r·n_out·n_in multiplications per pair, at every step); BᵀB and AAᵀ are r x r.  Both are
    symmetric, so the trace is the sum of their elementwise product; it is >= 0 exactly, and
    a rounded negative (B·A ~ 0) is taken as 0."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return max(float(np.sum((b64.T @ b64) * (a64 @ a64.T))), 0.0)


def create(runtime: ggml.Runtime, config, names: list[str], rank: int | dict[str, int],
           alpha: float, seed: int = 0, init: str = "peft", rslora: bool = False,
           dropout: float = 0.0) -> LoraAdapter:
    """Allocate A and B (F32, trainable) for each target on the runtime's primary backend.
    ``rank``: one for every target, or per target (an adapter file read for eval/generate).
    ``init``: "peft" (A Kaiming-uniform) or "gaussian" (A ~ N(0, 1/r), PEFT's gaussian).
    ``rslora``: scale alpha/sqrt(r) (one rank for every target).  ``dropout``: PEFT's
    lora_dropout in training graphs (masks seeded by ``seed``)."""
    if rslora and isinstance(rank, dict):
        raise ValueError("rsLoRA needs one rank for every target")
    if init not in ("peft", "gaussian"):
        raise ValueError(f"lora init must be 'peft' or 'gaussian', got {init!r}")
    shapes = lora_shapes(config, names, rank)
    ranks = {n: shapes[n][0][0] for n in names}
    ad = LoraAdapter(max(ranks.values(), default=0) if isinstance(rank, dict) else rank,
                     float(alpha), list(names), ranks=ranks, rslora=rslora,
                     dropout=float(dropout), seed=seed)
    ad.ctx = ggml.Context(n_tensors=2 * len(names))
    for n in names:
        (a_shape, b_shape) = shapes[n]
        for which, shp, store in (("lora_a", a_shape, ad.a), ("lora_b", b_shape, ad.b)):
            t = lib.ggml_new_tensor(ad.ctx.ptr, lib.GGML_TYPE_F32, len(shp),
                                    ffi.new("int64_t[]", list(reversed(shp))))
            ggml.set_name(t, f"{n}.{which}")
            lib.ggml_set_param(t)
            store[n] = t
    ad.buffer = runtime.alloc(ad.ctx)
    rng = np.random.default_rng(seed)
    for n in names:
        a_shape, b_shape = shapes[n]
        if init == "peft":
            bound = 1.0 / np.sqrt(a_shape[1])
            a = rng.uniform(-bound, bound, a_shape)
        else:
            a = rng.normal(0.0, 1.0 / a_shape[0], a_shape)
        ggml.from_numpy(ad.a[n], a.astype(np.float32))
        ggml.from_numpy(ad.b[n], np.zeros(b_shape, np.float32))
    return ad
