import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "native"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def has_gpu() -> bool:
    from pytrain import ggml
    return any(d.kind == "gpu" for d in ggml.devices())


@pytest.fixture(scope="module")
def llama_logits_exe():
    """llama.cpp's logits program, or a skip saying how to build it."""
    from llama_cpp_check import built_binary
    exe = built_binary()
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python scripts/build_llama_cpp.py` "
                    "(a few minutes, CPU only; `make test` does it)")
    return exe
