"""A tiny end-to-end check of the ggml autodiff path pytrain trains with: fit a softmax
regression on random data with gradients from ggml's backward graph and plain gradient
descent, printing the cross-entropy as it falls.  `make demo` runs it until the LoRA trainer
lands; it proves the build, the bindings and the backward pass work on this machine."""
import numpy as np

from pytrain import ggml
from pytrain.ggml import lib

N, D, C, STEPS, LR = 64, 16, 5, 60, 0.5

rng = np.random.default_rng(0)
x = rng.normal(size=(N, D)).astype(np.float32)
true_w = rng.normal(size=(C, D)).astype(np.float32)
labels = np.eye(C, dtype=np.float32)[(x @ true_w.T).argmax(1)]

rt = ggml.Runtime("auto")
wctx = ggml.Context(n_tensors=1)
w = lib.ggml_new_tensor_2d(wctx.ptr, lib.GGML_TYPE_F32, D, C)
lib.ggml_set_param(w)
rt.alloc(wctx)
ggml.from_numpy(w, np.zeros((C, D), np.float32))

ctx = ggml.Context(n_tensors=256, graph_size=256, grads=True)
tx = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, D, N)
ty = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, C, N)
lib.ggml_set_input(tx)
lib.ggml_set_input(ty)
loss = lib.ggml_cross_entropy_loss(ctx.ptr, lib.ggml_mul_mat(ctx.ptr, w, tx), ty)
gf = ggml.new_graph(ctx, 256, grads=True)
lib.ggml_build_forward_expand(gf, loss)
gb = ggml.build_backward(ctx, gf, loss)
grad = ggml.grad_of(gb, w)
lib.ggml_set_output(grad)
rt.alloc_graph(gb, ctx)

print(f"softmax regression on {rt.device}: {N} samples, {D} features, {C} classes")
for step in range(STEPS + 1):
    ggml.from_numpy(tx, x)
    ggml.from_numpy(ty, labels)
    ggml.seed_backward(gb)
    rt.compute(gb)
    if step % 10 == 0:
        acc = ((x @ ggml.to_numpy(w).T).argmax(1) == labels.argmax(1)).mean()
        print(f"step {step:3d}  loss {float(ggml.to_numpy(loss)[0]):.4f}  accuracy {acc:.2f}")
    ggml.from_numpy(w, ggml.to_numpy(w) - LR * ggml.to_numpy(grad))
