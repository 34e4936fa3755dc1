"""Write bench_results/parity.md (+ .json): the Qwen3.5 parity figures as the tests measured
them against their bounds (scripts/report_measured.py over the files below, one section each).

Why: the README quotes these errors, and every README figure must come from a committed file
made by a committed command; recorded by the tests themselves (the ``measured`` fixture), a
figure here is what the test saw, not a second computation that could drift from it.  The
references are committed .npz files (no torch) and llama.cpp (scripts/llama_logits, built by
scripts/build_llama_cpp.py; its tests skip without it, and their section says so).

    python -m scripts.report_parity                      # -> bench_results/parity.{md,json}
    python -m scripts.report_parity --out /tmp/parity.md
"""
from __future__ import annotations

import sys

from scripts import report_measured

SECTIONS = {
    "tests/test_qwen35_parity.py":
        "Forward: pytrain's log-softmax on the Qwen3.5 fixtures (F32 files; BF16 and Q8_0 "
        "loaded as F32) against the float64 numpy forward over each file's own weights "
        "(<file>.f64.npz, scripts/make_qwen35_f64_golden.py) and against HF transformers "
        "float32 (<model>.npz, scripts/make_qwen35_fixtures.py), max over the 5 golden "
        "sequences; bounds from tests/bounds.py.",
    "tests/test_delta_net.py":
        "The chunked gated delta rule and the causal conv against ggml's fused "
        "GATED_DELTA_NET / SSM_CONV and the float64 token-by-token references.",
    "tests/test_peft_parity.py":
        "LoRA loss and per-tensor gradient errors (max |error| / max |reference|) against HF + "
        "PEFT float32 and float64 (peft_grads.npz, scripts/make_peft_golden.py).",
    "tests/test_llama_cpp_adapter.py":
        "llama.cpp's logits (scripts/llama_logits) against pytrain's, without and with a "
        "rank-4 adapter, the adapter's effect, and the kept weight types (Q8_0, BF16 as F16).",
}


def main() -> int:
    return report_measured.sections_main(
        "report_parity", __doc__, "Qwen3.5 parity: pytrain against float64, HF, PEFT and "
        "llama.cpp", "parity.md", SECTIONS)


if __name__ == "__main__":
    sys.exit(main())
