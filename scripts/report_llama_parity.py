"""Write bench_results/llama_parity.md (+ .json): the Llama parity figures the README quotes,
as the tests measured them against their bounds (scripts/report_measured.py over the files
below, one section each).

Why: the tests assert bounds; the README gives the measured errors, and every README figure
must come from a committed file made by a committed command.  The tests record each figure
(the ``measured`` fixture), so a figure here is what the test saw on this machine.

Usage:  python -m scripts.report_llama_parity      (about a minute; needs the llama.cpp
        build and the fetched SmolLM2 for the last two sections, as `make test` does)
"""
from __future__ import annotations

import sys

from scripts import report_measured

SECTIONS = {
    "tests/test_llama_parity.py":
        "Forward (max |Δ log-softmax|) against HF `LlamaForCausalLM` float32 and the float64 "
        "forward of each file's weights; LoRA loss and gradients against PEFT 0.21.2; "
        "llama.cpp running pytrain's Llama adapters.",
    "tests/test_llama_weight_types.py":
        "Each weight type on a tiny Llama: loaded as F32 against float64, kept against the "
        "float64 forward rounding activations as ggml does, the training step kept against "
        "F32, and llama.cpp on the same file.",
    "tests/test_smollm2.py":
        "SmolLM2-135M-Instruct (Q4_1 as published): F32 against float64, and llama.cpp on the "
        "same file within the type's own noise.",
}


def main() -> int:
    return report_measured.sections_main(
        "report_llama_parity", __doc__, "Llama parity: pytrain against HF, float64, PEFT and "
        "llama.cpp", "llama_parity.md", SECTIONS)


if __name__ == "__main__":
    sys.exit(main())
