"""Which kernels torch computes float32 with in this process's environment, and the bits they
give: the probe behind the CPU matrix's reference cells (scripts/test_cpu_matrix.py).

Why: the committed goldens hold float32 values whose rounding depends on the reference's CPU
kernels (MKL's sgemm, oneDNN's convolutions, ATen's own vectorised loops), so a golden made on
one CPU is not bit-equal to one made on another.  The matrix regenerates them under settings
that make torch take other kernel paths on the same machine (``MKL_CBWR``,
``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), and it needs to
know two things per setting: whether it changes any float32 result at all here (a setting that
changes nothing is no test; MKL ignores its ISA switches on a non-Intel CPU, for one), and
which kernels ran, for the record.

Run under the reference interpreter with the environment to probe (torch and numpy only: no
pytrain, no project imports)::

    MKL_CBWR=COMPATIBLE .refenv/bin/python scripts/reference_kernels.py

It prints one line ``REFERENCE_KERNELS {json}`` with

* ``ops``: a hash of the float32 result bits of each operation the reference models are made
  of (matmuls and linears of their shapes, batched matmul, attention, softmax, RMS norm, SiLU,
  the depthwise causal convolution of Qwen3.5's DeltaNet, a backward), inputs from numpy so
  they are the same whatever kernels torch uses;
* ``rng``: a hash of torch's seeded draws (the generators build their models from them: a
  setting that changes them changes the goldens' inputs, not only their rounding);
* ``kernels``: MKL's version and what it dispatched to, its conditional-numerical-
  reproducibility mode, oneDNN's version, ISA and the implementations it ran, ATen's CPU
  capability, torch's BLAS, from ``MKL_VERBOSE`` / ``ONEDNN_VERBOSE`` output this script
  turns on for itself (logging only: it changes no code path).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

MARK = "REFERENCE_KERNELS "


def digest(t) -> str:
    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()[:12]


def op_hashes() -> dict[str, str]:
    """The float32 bits of each operation, on fixed numpy inputs, one thread (as the
    generators run)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    def rn(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    out = {}
    for m, k, n in [(7, 64, 96), (20, 64, 128), (100, 64, 512), (5, 333, 17)]:
        a, b, w, bias = rn(m, k), rn(k, n), rn(n, k), rn(n)
        out[f"matmul {m}x{k}x{n}"] = digest(a @ b)
        out[f"linear {m}x{k}x{n}"] = digest(F.linear(rn(2, m, k), w, bias))
        out[f"bmm {m}x{k}x{n}"] = digest(torch.bmm(rn(4, m, k), rn(4, k, n)))
    q = rn(2, 4, 33, 16)
    out["attention"] = digest(F.scaled_dot_product_attention(q, q, q, is_causal=True))
    out["softmax"] = digest(torch.softmax(rn(64, 512), -1))
    out["log_softmax"] = digest(torch.log_softmax(rn(64, 512), -1))
    out["sum"] = digest(rn(100003).sum())
    out["rms_norm"] = digest(F.rms_norm(rn(64, 333), (333,)))
    out["silu"] = digest(F.silu(rn(10007)))
    out["exp"] = digest(torch.exp(rn(10007)))
    x, w = rn(2, 48, 40).requires_grad_(), rn(48, 1, 4).requires_grad_()
    y = F.conv1d(x, w, groups=48, padding=3)
    (y * rn(*y.shape)).sum().backward()
    out["depthwise conv1d"] = digest(y)
    out["depthwise conv1d backward"] = digest(x.grad) + digest(w.grad)
    x, w = rn(20, 64).requires_grad_(), rn(128, 64).requires_grad_()
    F.linear(x, w).tanh().sum().backward()
    out["linear backward"] = digest(x.grad) + digest(w.grad)
    return out


def rng_hash() -> str:
    import torch
    torch.manual_seed(1234)
    draws = [torch.randn(4099), torch.rand(4099), torch.empty(4099).normal_(0, 0.3),
             torch.empty(4099).uniform_(-1, 1), torch.randn(4099, dtype=torch.float64)]
    return hashlib.sha1(b"".join(d.numpy().tobytes() for d in draws)).hexdigest()[:12]


def parse_verbose(text: str) -> dict:
    """MKL's and oneDNN's own words for what they ran, from their verbose lines."""
    k: dict = {"mkl": "", "mkl_cnr": "", "sgemm_by_mkl": False, "onednn": "", "onednn_isa": "",
               "onednn_impls": []}
    for line in text.splitlines():
        if line.startswith("MKL_VERBOSE") and not k["mkl"] and " for " in line:
            m = re.match(r"MKL_VERBOSE (.*?) Product build \S+ for (.*?)(?:, Lnx|, Win|$)", line)
            if m:
                k["mkl"] = f"{m.group(1)}, {m.group(2).replace('Intel(R) 64 architecture ', '')}"
        elif line.startswith("MKL_VERBOSE SGEMM"):
            k["sgemm_by_mkl"] = True
            m = re.search(r"CNR:(\S+)", line)
            k["mkl_cnr"] = m.group(1) if m else k["mkl_cnr"]
        elif line.startswith(("onednn_verbose", "dnnl_verbose")):
            f = line.split(",")
            if "info" in f and any(x.startswith("oneDNN v") for x in f):
                k["onednn"] = next(x for x in f if x.startswith("oneDNN v")).split()[1]
            elif "info" in f and any(x.startswith("isa:") for x in f):
                k["onednn_isa"] = next(x for x in f if x.startswith("isa:"))[4:]
            elif "exec" in f and "cpu" in f:
                i = f.index("cpu")
                impl = f"{f[i + 1]} {f[i + 2]}"
                if f[i + 1] != "reorder" and impl not in k["onednn_impls"]:
                    k["onednn_impls"].append(impl)
    return k


def child() -> None:
    import torch
    ops = op_hashes()
    cfg = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", cfg)
    print(MARK + json.dumps({
        "ops": ops, "rng": rng_hash(),
        "kernels": {"aten": torch.backends.cpu.get_cpu_capability(),
                    "torch": torch.__version__, "blas": blas.group(1) if blas else "?",
                    "mkldnn": bool(torch.backends.mkldnn.is_available())}}), flush=True)


def main() -> int:
    """Runs the probe in a child with both libraries' verbose output on (they read it when
    they load), and merges what they printed into the child's record."""
    env = {**os.environ, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"}
    r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                       text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(MARK)), None)
    if r.returncode != 0 or line is None:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        return r.returncode or 1
    rec = json.loads(line[len(MARK):])
    rec["kernels"].update(parse_verbose(r.stdout))
    print(MARK + json.dumps(rec))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child()
    else:
        sys.exit(main())
