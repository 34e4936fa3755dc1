"""`pytrain doctor` reports what this install was built from and runs on."""
from pytrain import ggml
from pytrain.cli import main


def test_doctor_reports_build_devices_and_cpu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    info = ggml.build_info()
    assert f"ggml {info['ggml_version']} from llama-cpp-python==0.3.36" in out
    assert info["archive_sha256"] in out
    for patch in info["patches"]:                      # every patch the build applied
        assert patch in out
    assert "-DGGML_LLAMAFILE=ON" in out
    cpu = [line for line in out.splitlines() if line.strip().startswith("CPU")]
    assert cpu and "GiB free of" in cpu[0]             # the CPU device, with its memory
    assert "cpu features:" in out and "threads (default):" in out
    assert info["cuda"] == ("backends built: cpu + cuda" in out)
    bf16 = next(line for line in out.splitlines() if line.startswith("bf16 compute:"))
    if info.get("onednn") and ggml.bf16_kernel():       # a BLAS build: oneDNN's kernel named
        assert info["onednn"] in bf16 and f"kernel {ggml.bf16_kernel()}" in bf16
    else:
        assert "unavailable" in bf16


def test_doctor_says_which_vulkan_device_a_vulkan_run_gets(capsys):
    """A build without ggml-vulkan says how to get it; with it, the device ``device =
    "vulkan"`` uses is listed with its memory and named lavapipe (Mesa's CPU driver) or a
    GPU (tests/vulkan_support.py makes lavapipe visible where it is installed)."""
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("vulkan:")]
    if not ggml.build_info().get("vulkan"):
        assert "not built (make build VULKAN=1" in line
        return
    vk = [d for d in ggml.devices() if d.name.startswith("Vulkan")]
    if not vk:
        assert line.startswith("vulkan: built; no device listed")
        return
    assert line.startswith(f'vulkan: device = "vulkan" uses {vk[0].name}, {vk[0].description}')
    assert ("lavapipe" in line) == ggml.is_lavapipe(vk[0].description)
    listed = [x for x in out.splitlines() if x.strip().startswith(vk[0].name)]
    assert listed and "GiB free of" in listed[0]
