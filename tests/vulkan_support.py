"""The Vulkan device the Vulkan tests run on: a GPU where there is one, else Mesa's lavapipe
(a Vulkan driver that runs on the CPU, the one every CI machine has once `make test` installed
it).  ggml-vulkan lists CPU devices only when asked (``GGML_VK_VISIBLE_DEVICES``), and reads
that once, when the module is loaded (by the first test that asks for it, `pytrain doctor`'s
among them), so conftest.py asks for lavapipe at the start of the session when it is installed
and nothing else chose (``prepare_environment``).  Nothing else changes for the other tests:
a Vulkan device is used only by ``device = "vulkan"``.

A missing device skips the tests with the reason, except under ``make test`` on a machine
where it installs lavapipe (``PYTRAIN_REQUIRE_VULKAN=1``): there a skip would hide a broken
install, so it fails instead.

Pipelines: ggml-vulkan compiles each shader variant the first time a graph needs it, and
lavapipe compiles it to machine code with LLVM then, which takes seconds on these 2-core
machines (patches 0013-0015 removed the variants that took minutes).  Mesa's optimisation
passes stay on: without them (``GALLIVM_PERF=nopt``) Qwen3.5's first step from an empty
shader cache took 82 s instead of 93 s, and every later step 2.4 times as long (1.4 s
instead of 0.6 s at batch 2 x 46), which the 30-step runs pay many times over.  Mesa keeps
what it compiled in its on-disk shader cache, so a test process
after the first finds most pipelines there."""
from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("PYTRAIN_REQUIRE_VULKAN", "") not in ("", "0")
_used: list[str] = []       # the device descriptions the tests ran on, for the CI log


def prepare_environment() -> None:
    """Without importing pytrain (conftest runs this before any test's imports)."""
    from vulkan_tools import lavapipe_installed       # native/, on sys.path (conftest)
    if "GGML_VK_VISIBLE_DEVICES" not in os.environ and lavapipe_installed():
        os.environ["GGML_VK_VISIBLE_DEVICES"] = "0"


def vulkan_device() -> str:
    """The description of the Vulkan device ``device = "vulkan"`` gets here; skips (or fails
    under PYTRAIN_REQUIRE_VULKAN) with the reason when there is none."""
    from pytrain import ggml
    prepare_environment()
    reason = None
    if not ggml.vulkan_built():
        reason = ("this build has no Vulkan backend (`make build VULKAN=1`, or `make test` on "
                  "Debian bookworm as root, installs its tools and builds it)")
    elif not ggml.load_vulkan() or not [d for d in ggml.devices() if d.name.startswith("Vulkan")]:
        reason = ("ggml-vulkan lists no device (no GPU driver; Mesa's lavapipe: apt-get "
                  "install mesa-vulkan-drivers)")
    if reason:
        if REQUIRED:
            pytest.fail(f"PYTRAIN_REQUIRE_VULKAN=1 but {reason}")
        pytest.skip(reason)
    desc = next(d.description for d in ggml.devices() if d.name.startswith("Vulkan"))
    if desc not in _used:
        _used.append(desc)
    return desc


def rounds_matmuls_to_f16(desc: str) -> bool:
    """Whether the device's matmuls round their operands to F16: a GPU with F16 arithmetic,
    not lavapipe (a CPU device gets ggml-vulkan's F32 shaders: patch 0016), and not where
    ``GGML_VK_DISABLE_F16`` turns them off."""
    from pytrain import ggml
    return not ggml.is_lavapipe(desc) and "GGML_VK_DISABLE_F16" not in os.environ


def devices_used() -> list[str]:
    return list(_used)
