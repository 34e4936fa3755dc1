"""The GPU machine, rehearsed on this one: what ``scripts/gpu_carry.py`` packs, unpacked into a
copy of the tracked tree and run by ``scripts/gpu_check.sh rehearse`` up to the first step
that needs a GPU, in the conditions of the device tool's machine:

* an empty ``HOME`` and ``PYTRAIN_CACHE``, and no package index (``PIP_NO_INDEX=1``);
* a Python with what that machine's image has (numpy, tokenizers, jinja2, pytest, ...) and
  without what it lacks (cffi, pycparser, gguf, pytrain itself): a virtual environment that
  sees this one's packages but those;
* none of this machine's build folders, in a mount namespace of its own (``unshare -m``):
  the pytrain cache (the source, OpenBLAS, the CMake trees), the checkout's ``pytrain``
  package with its ``_native`` build, and the interpreter's C headers, so that nothing can be
  compiled and no library can be found where only this machine has it.

The carry this test packs is this machine's CPU build (the device's is the same build with
CUDA: ``--build-native``); after unpacking, readelf checks every library needs nothing outside
the package but the system's and CUDA's (``portability_problems``).  The carry of a7f05fe
failed each condition: its prefix linked OpenBLAS by this machine's path, its setup compiled
the cffi module (Python.h) and fell back to ``pip download``."""
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import build as native_build  # native/build.py (conftest puts native/ on sys.path)
from pytrain import ggml

ROOT = Path(__file__).resolve().parent.parent
LACKING = ("cffi", "_cffi_backend", "pycparser", "gguf", "pytrain", "__editable__")
# files this machine's build left, each one that would let the run compile or load what the
# GPU machine lacks: looked for from inside the run's namespace
PROBES = {"Python.h": Path(sysconfig.get_paths()["include"]) / "Python.h",
          "the checkout's native build": ggml.NATIVE_DIR / "build_info.json",
          "the pinned ggml source": native_build.cache_dir() / "src",
          "the checkout's pytrain package": ROOT / "pytrain" / "__init__.py"}

pytestmark = pytest.mark.slow   # packs the GPU carry and rehearses gpu_check.sh: minutes


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


def tracked_tree(dest: Path) -> None:
    """The files the device tool copies (tracked ones), without this machine's build."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def image_python(dest: Path) -> Path:
    """A virtual environment that sees this environment's packages except what the GPU
    machine's image lacks (each one a symlink in a folder a .pth file adds)."""
    venv.EnvBuilder(with_pip=True).create(dest)
    py = dest / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    shown = dest / "image-site"
    shown.mkdir()
    for p in ours.iterdir():
        if not p.name.lower().startswith(LACKING) and p.suffix != ".pth":
            (shown / p.name).symlink_to(p)
    (site / "image.pth").write_text(f"{shown}\n")
    return py


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    if not ggml.NATIVE_DIR.joinpath("build_info.json").exists():
        pytest.fail("no pytrain/_native build to carry (make build)")
    if shutil.which("readelf") is None:
        pytest.fail("readelf (binutils) is needed to check the carried libraries")
    tmp = tmp_path_factory.mktemp("bare")
    tree, home, work, out = (tmp / n for n in ("tree", "home", "work", "out"))
    for d in (tree, home, work, out):
        d.mkdir()
    tracked_tree(tree)
    r = subprocess.run([sys.executable, "-m", "scripts.gpu_carry",
                        "--native", str(ggml.NATIVE_DIR), "--out", str(tree / ".gpu")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    py = image_python(tmp / "venv")
    env = {"HOME": str(home), "PATH": f"{py.parent}:/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull,
           "OUT": str(out), "PYTRAIN_GPU_WORK": str(work), "PYTHON": str(py)}
    cmd = ["bash", str(tree / "scripts" / "gpu_check.sh"), "rehearse"]
    hidden = sorted({Path.home() / ".cache" / "pytrain", native_build.cache_dir(),
                     ROOT / "pytrain", Path(sysconfig.get_paths()["include"])})
    hidden = [h for h in hidden if h.is_dir()]
    namespace = can_unshare()
    if namespace:
        # what the run's own namespace shows, looked at from inside it just before the run
        q = shlex.quote
        looks = "; ".join(f"if [ -e {q(str(f))} ]; then echo {q(n + ': visible')}; "
                          f"else echo {q(n + ': absent')}; fi" for n, f in PROBES.items())
        mounts = "; ".join(f"mount -t tmpfs none '{h}'" for h in hidden)
        cmd = ["unshare", "-m", "--propagation", "private", "bash", "-c",
               f"set -e; {mounts}; ({looks}) > '{out}/probe.txt'; exec \"$@\"", "_", *cmd]
    r = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    return dict(rc=r.returncode, output=r.stdout + r.stderr, tree=tree, work=work, out=out,
                namespace=namespace)


def read(out: Path, name: str) -> str:
    return (out / name).read_text() if (out / name).exists() else ""


def test_gpu_check_reaches_the_first_gpu_step_on_a_bare_machine(rehearsal):
    out = rehearsal["out"]
    steps = read(out, "steps.log")
    assert rehearsal["rc"] == 0, (rehearsal["output"][-3000:], steps,
                                  read(out, "setup.log")[-3000:], read(out, "demo.log")[-3000:])
    assert "stopped before the first step that needs a GPU" in steps
    for name in ("carried wheels", "carried pytrain/_native", "pytrain doctor",
                 "GPU tests collected", "demo config on the CPU"):
        assert f"{name}: exit 0" in steps, (name, steps)
    assert "built here" not in steps            # nothing compiled


def test_every_part_came_from_the_carry(rehearsal):
    tree, work = rehearsal["tree"], rehearsal["work"]
    where = dict(line.split(" ", 1) for line in read(rehearsal["out"], "setup.log").splitlines()
                 if line.split(" ", 1)[0] in ("cffi", "gguf", "pytrain", "native"))
    assert where["cffi"].split()[-1].startswith(str(work / "site")), where
    assert where["gguf"].startswith(str(work / "site")), where
    assert where["pytrain"].startswith(str(tree / "pytrain")), where
    assert where["native"] == f"{tree / 'pytrain' / '_native'} cpu", where
    # the ggml-cpu variants the build has, unpacked, and needing nothing of this machine
    carried = sorted(p.name for p in (tree / "pytrain" / "_native" / "lib").iterdir())
    assert carried == sorted(p.name for p in (ggml.NATIVE_DIR / "lib").iterdir())
    assert native_build.portability_problems(tree / "pytrain" / "_native") == []


def test_the_run_saw_none_of_the_build_folders(rehearsal):
    """Seen from inside the run's mount namespace, none of this machine's build files is
    there (each exists outside it: the probe could fail), and the CPU run still trained."""
    if not rehearsal["namespace"]:
        pytest.skip("unshare -m refused here: no namespace can hide this machine's build "
                    "folders (test_every_part_came_from_the_carry still holds)")
    assert all(f.exists() for f in PROBES.values()), PROBES        # outside: all there
    seen = read(rehearsal["out"], "probe.txt").splitlines()
    assert seen == [f"{n}: absent" for n in PROBES], seen
    demo = rehearsal["work"] / "demo-cpu"
    assert (demo / "metrics.jsonl").exists(), read(rehearsal["out"], "demo.log")[-2000:]
    assert any(demo.rglob("*.gguf")), sorted(p.name for p in demo.iterdir())
