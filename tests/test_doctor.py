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
