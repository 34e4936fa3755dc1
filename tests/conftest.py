import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "native"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from vulkan_support import prepare_environment  # noqa: E402

prepare_environment()      # before anything loads ggml-vulkan (see vulkan_support.py)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def has_gpu() -> bool:
    """A CUDA device (a Vulkan one, lavapipe included, is not what tests/test_gpu.py needs)."""
    from pytrain.ggml.backends import _cuda_device
    return _cuda_device() is not None


@pytest.fixture(scope="module")
def llama_logits_exe():
    """llama.cpp's logits program, or a skip saying how to build it."""
    from llama_cpp_check import built_binary
    exe = built_binary()
    if exe is None:
        pytest.skip("llama.cpp cross-check not built: run `python -m scripts.build_llama_cpp` "
                    "(a few minutes, CPU only; `make test` does it)")
    return exe


# --------------------------------------------------------------------------- measured figures

_MEASURED: list[dict] = []


@pytest.fixture
def measured(request):
    """``measured(check, value, bound)``: a figure a test compared with its bound, printed and,
    with ``PYTRAIN_MEASURED_JSON=FILE``, written at the end of the session (the parity reports
    in bench_results/ are made from these, so they show what the tests saw)."""
    def record(check: str, value: float, bound) -> None:
        print(f"{check}: {value:.3g} (bound {bound})")
        _MEASURED.append(dict(test=request.node.nodeid, check=check, value=float(value),
                              bound=bound if isinstance(bound, (int, float)) else str(bound)))
    return record


def pytest_terminal_summary(terminalreporter):
    """The Vulkan device the Vulkan tests ran on, in every log (CI's shows it is lavapipe)."""
    from vulkan_support import devices_used
    for desc in devices_used():
        terminalreporter.write_line(f"Vulkan tests ran on: {desc}")


def pytest_sessionfinish(session, exitstatus):
    import json
    import os
    out = os.environ.get("PYTRAIN_MEASURED_JSON")
    if out:
        Path(out).write_text(json.dumps(dict(exitstatus=int(exitstatus), measured=_MEASURED),
                                        indent=1) + "\n")
