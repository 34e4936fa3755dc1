"""`pip wheel .` gives a wheel tagged for what it holds (CPython >= 3.10's limited API, Linux
x86-64), which imports and trains from its own files alone, outside the source tree, under
the most portable ggml-cpu variant (x64: no instruction set beyond x86-64's SSE2), and says
which variant ran."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow   # builds the wheel and trains from it: minutes


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q",
                        "-w", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("pytrain-*.whl")
    return whl


def test_wheel_is_tagged_for_its_platform(wheel):
    assert wheel.name == "pytrain-0.1.0-cp310-abi3-linux_x86_64.whl", wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read("pytrain-0.1.0.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in meta and "Tag: cp310-abi3-linux_x86_64" in meta
    assert "pytrain/_native/_ggml.abi3.so" in names
    assert {"pytrain/_native/lib/libggml-cpu-x64.so", "pytrain/_native/lib/libggml-cpu-haswell.so",
            "pytrain/_native/lib/libggml.so.0", "pytrain/_native/build_info.json",
            "pytrain/assets/default-model.gguf"} <= names


def test_wheel_trains_the_demo_model_under_the_portable_variant(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for so in (site / "pytrain" / "_native").rglob("*.so*"):   # zip keeps no mode bits
        so.chmod(0o755)
    assets = site / "pytrain" / "assets"
    (tmp_path / "cfg.toml").write_text(f"""
[model]
path = "{assets / 'default-model.gguf'}"
device = "cpu"
threads = 2
[data]
train = "{assets / 'demo_train.jsonl'}"
format = "chat"
[lora]
rank = 4
alpha = 8.0
[train]
max_steps = 6
batch_size = 8
lr = 5e-3
eval_every = 0
[output]
dir = "out"
""")
    env = {**os.environ, "PYTRAIN_CPU_VARIANT": "x64", "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import pytrain; print(pytrain.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout
    r = subprocess.run([sys.executable, "-m", "pytrain", "train", "cfg.toml", "--no-progress"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ggml-cpu variant x64 (PYTRAIN_CPU_VARIANT)" in r.stderr + r.stdout
    steps = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s and s.get("split") != "valid"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert (tmp_path / "out" / "adapter.gguf").stat().st_size > 0
    doctor = subprocess.run([sys.executable, "-m", "pytrain", "doctor"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert "cpu variant: x64 (PYTRAIN_CPU_VARIANT" in doctor.stdout, doctor.stdout
