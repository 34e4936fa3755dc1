"""Which graph nodes the pinned ggml-cuda runs: ``ggml_backend_cuda_device_supports_op`` of
ggml 0.25.3 (``ggml/src/ggml-cuda/ggml-cuda.cu``), restated for the ops pytrain's graphs use,
plus pytrain's own CUDA patch (``native/patches/0003-cuda-out-prod-dequantized-src0.patch``:
OUT_PROD with a non-F32 src0).

Why a restatement: that function needs a CUDA device to be called at all, and the CPU machines
that build and test pytrain have none.  On a GPU, ``Runtime`` refuses a graph the scheduler
would split onto the CPU (``CPUFallbackError``), which is the real check; this one lets every
machine prove, node by node, that the training graph stays on the GPU.  An op missing here is
reported as unsupported, so a new op cannot slip through unchecked.
"""
from __future__ import annotations

from pytrain import ggml
from pytrain.ggml import ffi, lib

_T = lib  # GGML_TYPE_* constants

# MUL_MAT's src0 types (ggml-cuda.cu, case GGML_OP_MUL_MAT); GET_ROWS's src0 types
_MUL_MAT_TYPES = {getattr(lib, f"GGML_TYPE_{n}") for n in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "Q8_K", "IQ1_M", "IQ1_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS",
    "IQ4_NL", "IQ4_XS", "MXFP4")}
_GET_ROWS_TYPES = {getattr(lib, f"GGML_TYPE_{n}") for n in (
    "F16", "F32", "BF16", "I32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    "IQ4_XS")}
_UNARY_OK = {getattr(lib, f"GGML_UNARY_OP_{n}") for n in (
    "ABS", "SGN", "NEG", "STEP", "GELU", "SILU", "RELU", "SIGMOID", "HARDSIGMOID", "HARDSWISH",
    "GELU_ERF", "GELU_QUICK", "TANH", "EXP", "EXPM1", "SOFTPLUS", "ELU")}
_ALWAYS = {getattr(lib, f"GGML_OP_{n}") for n in (
    "NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "ADD1", "SQR", "SQRT", "SIN", "COS",
    "CLAMP", "LOG", "CONT", "DUP", "DIAG_MASK_INF", "SOFT_MAX", "ARGMAX", "COUNT_EQUAL",
    "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW", "FILL", "PAD")}


def _f(t) -> int:
    return int(t.type)


def _float(t) -> bool:
    return _f(t) in (_T.GGML_TYPE_F32, _T.GGML_TYPE_F16)


def out_prod_ok(node) -> bool:
    """The pinned kernel takes F32 only (out-prod.cu).  pytrain's patch 0003 adds any 2-D
    contiguous src0 of a type with a CUDA dequantizer (``ggml_get_to_fp32_cuda``)."""
    s0, s1 = node.src[0], node.src[1]
    if _f(node) != _T.GGML_TYPE_F32 or _f(s1) != _T.GGML_TYPE_F32:
        return False
    if _f(s0) == _T.GGML_TYPE_F32:
        return True
    return (_f(s0) in OUT_PROD_SRC0_TYPES and bool(lib.ggml_is_contiguous(s0))
            and s0.ne[2] == 1 and s0.ne[3] == 1 and node.ne[2] == 1 and node.ne[3] == 1)


# ggml_get_to_fp32_cuda's types (convert.cu), which patch 0003 lets OUT_PROD take
OUT_PROD_SRC0_TYPES = {_T.GGML_TYPE_F32} | {getattr(lib, f"GGML_TYPE_{n}") for n in (
    "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    "IQ3_S", "MXFP4")}


def supported(node) -> bool:
    op = int(node.op)
    s0, s1 = node.src[0], node.src[1]
    if op in _ALWAYS:
        return True
    if op == lib.GGML_OP_UNARY:
        return int(lib.ggml_get_unary_op(node)) in _UNARY_OK and bool(lib.ggml_is_contiguous(s0))
    if op == lib.GGML_OP_GLU:
        return bool(lib.ggml_is_contiguous_1(s0))
    if op == lib.GGML_OP_MUL_MAT:
        if s0.nb[0] != lib.ggml_element_size(s0) or s1.nb[0] != lib.ggml_element_size(s1):
            return False
        if _f(s1) == _T.GGML_TYPE_F16 and _f(s0) != _T.GGML_TYPE_F16:
            return False
        return _f(s0) in _MUL_MAT_TYPES
    if op == lib.GGML_OP_OUT_PROD:
        return out_prod_ok(node)
    if op == lib.GGML_OP_GET_ROWS:
        return _f(s0) in _GET_ROWS_TYPES
    if op == lib.GGML_OP_GET_ROWS_BACK:
        return (_f(node) == _T.GGML_TYPE_F32 and _f(s0) == _T.GGML_TYPE_F32
                and node.ne[2] == 1 and node.ne[3] == 1)
    if op == lib.GGML_OP_SET_ROWS:
        return (_f(s0) == _T.GGML_TYPE_F32 and _f(node) in (_T.GGML_TYPE_F32, _T.GGML_TYPE_F16)
                and _f(s1) in (_T.GGML_TYPE_I32, _T.GGML_TYPE_I64))
    if op == lib.GGML_OP_SET:
        return _f(node) == _f(s0) == _f(s1) and _f(node) in (_T.GGML_TYPE_F32, _T.GGML_TYPE_I32)
    if op == lib.GGML_OP_CPY:
        a, b = _f(s0), _f(s1)
        fl = (_T.GGML_TYPE_F32, _T.GGML_TYPE_F16, _T.GGML_TYPE_BF16)
        return (a in fl and b in fl) or (a == b and bool(lib.ggml_is_contiguous(s0))
                                         and bool(lib.ggml_is_contiguous(s1)))
    if op == lib.GGML_OP_REPEAT:
        return _float(s0)
    if op == lib.GGML_OP_REPEAT_BACK:
        return _f(node) == _T.GGML_TYPE_F32 and s0.ne[2] * s0.ne[3] <= (1 << 15)
    if op == lib.GGML_OP_SILU_BACK:
        return bool(lib.ggml_is_contiguous(s0)) and _f(s0) == _T.GGML_TYPE_F32
    if op in (lib.GGML_OP_NORM, lib.GGML_OP_RMS_NORM):
        return bool(lib.ggml_is_contiguous_rows(s0))
    if op == lib.GGML_OP_RMS_NORM_BACK:
        return bool(lib.ggml_is_contiguous(s0))
    if op == lib.GGML_OP_SCALE:
        return _f(s0) in (_T.GGML_TYPE_F32, _T.GGML_TYPE_BF16) and _f(node) == _f(s0)
    if op in (lib.GGML_OP_ADD, lib.GGML_OP_SUB, lib.GGML_OP_MUL, lib.GGML_OP_DIV):
        return _float(s0) and _float(s1) and _float(node)
    if op == lib.GGML_OP_SOFT_MAX_BACK:
        max_bias = ffi.cast("float *", node.op_params)[1]
        return max_bias == 0.0
    if op in (lib.GGML_OP_ROPE, lib.GGML_OP_ROPE_BACK):
        return (s0.nb[0] == lib.ggml_type_size(s0.type)) and bool(lib.ggml_is_contiguous_2(s0))
    if op == lib.GGML_OP_ACC:
        return bool(lib.ggml_is_contiguous(s0)) and bool(lib.ggml_is_contiguous(s1))
    if op == lib.GGML_OP_SUM:
        return bool(lib.ggml_is_contiguous_rows(s0))
    if op in (lib.GGML_OP_SUM_ROWS, lib.GGML_OP_MEAN):
        return (_f(s0) == _T.GGML_TYPE_F32 and _f(node) == _T.GGML_TYPE_F32
                and bool(lib.ggml_is_contiguous_rows(s0)))
    return False          # every other op: unknown here, so reported (DIAG_MASK_ZERO among them)


def unsupported_nodes(graph) -> list[str]:
    """``op(type <- src types) ne`` of every node of ``graph`` ggml-cuda would not run."""
    out = []
    for i in range(lib.ggml_graph_n_nodes(graph)):
        n = lib.ggml_graph_node(graph, i)
        if not supported(n):
            srcs = ",".join(ggml.type_name(n.src[j].type) for j in range(2) if n.src[j] != ffi.NULL)
            out.append(f"{ggml.op_name(n)}({ggml.type_name(n.type)} <- {srcs}) "
                       f"ne {[int(n.ne[k]) for k in range(4)]} '{ggml.name(n)}'")
    return out
