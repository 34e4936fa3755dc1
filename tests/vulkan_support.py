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
lavapipe compiles it to machine code with LLVM then, which takes seconds (up to minutes for
the largest matmul variants) on these 2-core machines.  ``GALLIVM_PERF=nopt`` (Mesa's switch:
no LLVM optimization passes) makes that several times faster; the tiny test models run as
fast either way.  Mesa keeps what it compiled in its on-disk shader cache, so a test process
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
    os.environ.setdefault("GALLIVM_PERF", "nopt")


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


def devices_used() -> list[str]:
    return list(_used)
