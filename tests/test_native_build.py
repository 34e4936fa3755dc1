"""Bad input to the native build: each failure is one actionable line, a non-zero exit, and
nothing left behind that later looks like a valid build.  The download is replaced by a fake
pip (the real one is exercised by every fresh `make`), so these run in seconds."""
import shutil
import sys
from pathlib import Path

import pytest

import build as native_build  # native/build.py (conftest puts native/ on sys.path)

REAL_CACHE = native_build.cache_dir()  # before any test points PYTRAIN_CACHE elsewhere


def run_main(args, capsys):
    rc = native_build.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [line for line in err if not line.startswith("[native]")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pip(monkeypatch, script: str):
    monkeypatch.setattr(native_build, "_pip_command", lambda: [sys.executable, "-c", script])


def test_failed_download(cache, monkeypatch, capsys):
    fake_pip(monkeypatch, "import sys; print('ERROR: no network', file=sys.stderr); sys.exit(1)")
    rc, err = run_main(["--source-only"], capsys)
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("error: could not download") and "no network" in err[0]
    assert not (cache / "src").exists()


def test_hash_mismatch_refuses_the_file(cache, monkeypatch, capsys):
    name = native_build.ARCHIVE_NAME
    fake_pip(monkeypatch, "import sys, pathlib; d = sys.argv[sys.argv.index('-d') + 1]; "
                          f"pathlib.Path(d, '{name}').write_bytes(b'not the archive')")
    rc, err = run_main(["--source-only"], capsys)
    assert rc == 1 and len(err) == 1 and "sha256 mismatch" in err[0]
    assert not (cache / "dl" / name).exists(), "a file with the wrong hash must not be cached"
    assert not (cache / "src").exists()


def test_cached_archive_with_wrong_hash_is_replaced(cache, monkeypatch, capsys):
    (cache / "dl").mkdir(parents=True)
    (cache / "dl" / native_build.ARCHIVE_NAME).write_bytes(b"corrupt")
    fake_pip(monkeypatch, "import sys; sys.exit(1)")
    rc, err = run_main(["--source-only"], capsys)
    assert rc == 1 and "could not download" in err[0]
    assert not (cache / "dl" / native_build.ARCHIVE_NAME).exists()


def _hide(monkeypatch, *tools):
    real = shutil.which
    monkeypatch.setattr(native_build.shutil, "which",
                        lambda name, *a, **k: None if name in tools else real(name, *a, **k))


def test_missing_cmake(tmp_path, cache, monkeypatch, capsys):
    _hide(monkeypatch, "cmake")
    out = tmp_path / "native_out"
    rc, err = run_main(["--out", str(out)], capsys)
    assert rc == 1 and len(err) == 1 and "missing cmake" in err[0] and "apt-get" in err[0]
    assert not (out / "build_info.json").exists()


def test_missing_compiler(tmp_path, cache, monkeypatch, capsys):
    _hide(monkeypatch, "cc", "gcc", "clang", "c++", "g++", "clang++")
    rc, err = run_main(["--out", str(tmp_path / "o")], capsys)
    assert rc == 1 and "a C compiler" in err[0] and "a C++ compiler" in err[0]


def test_cuda_requested_without_toolkit(tmp_path, cache, monkeypatch, capsys):
    _hide(monkeypatch, "nvcc")
    rc, err = run_main(["--cuda", "--out", str(tmp_path / "o")], capsys)
    assert rc == 1 and len(err) == 1 and "nvcc" in err[0] and "PYTRAIN_CUDA" in err[0]


def test_interrupted_build_is_not_valid(tmp_path, cache, monkeypatch, capsys):
    """A previous complete build, then a rebuild that fails midway: the stamp is gone, so
    nothing later mistakes the half-replaced files for a working build."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "build_info.json").write_text('{"cuda": false, "archive_sha256": "old"}')

    def boom(*a, **k):
        raise native_build.BuildError("cmake build failed (exit 2)")
    monkeypatch.setattr(native_build, "extract_source", lambda: None)
    monkeypatch.setattr(native_build, "cmake_build", boom)
    rc, err = run_main(["--out", str(out)], capsys)
    assert rc == 1 and err == ["error: cmake build failed (exit 2)"]
    assert not (out / "build_info.json").exists()


def test_half_extracted_source_is_redone(cache, monkeypatch):
    """A source tree without the extraction marker (killed mid-extract) is removed and
    extracted again from the verified archive."""
    real_archive = REAL_CACHE / "dl" / native_build.ARCHIVE_NAME
    if not real_archive.exists():
        pytest.fail(f"{real_archive} missing: run `python native/build.py` first")
    (cache / "dl").mkdir(parents=True)
    (cache / "dl" / native_build.ARCHIVE_NAME).symlink_to(real_archive)
    root = native_build.source_root()
    root.mkdir(parents=True)
    (root / "partial-file").write_text("x")
    got = native_build.extract_source()
    assert got == root and not (root / "partial-file").exists()
    assert (root / ".pytrain-extracted").exists()
    assert (native_build.ggml_dir() / "ggml.pc.in").exists()


def test_patches_are_applied_and_recorded():
    import json
    info = json.loads((Path(native_build.PKG_NATIVE) / "build_info.json").read_text())
    assert info["patches"] == [p.name for p in native_build.patches()]
    assert info["patches_sha256"] == native_build.patches_digest()
    ops = native_build.ggml_dir() / "src" / "ggml-cpu" / "ops.cpp"
    assert "pytrain patch" in ops.read_text()


def test_a_patch_that_does_not_apply_is_a_one_line_error(tmp_path, cache, monkeypatch, capsys):
    bad = tmp_path / "patches"
    bad.mkdir()
    (bad / "0001-bad.patch").write_text("--- a/ggml/nope.c\n+++ b/ggml/nope.c\n@@ -1 +1 @@\n-x\n+y\n")
    monkeypatch.setattr(native_build, "PATCH_DIR", bad)
    (cache / "dl").mkdir(parents=True)
    (cache / "dl" / native_build.ARCHIVE_NAME).symlink_to(REAL_CACHE / "dl" / native_build.ARCHIVE_NAME)
    rc, err = run_main(["--source-only"], capsys)
    assert rc == 1 and len(err) == 1 and "0001-bad.patch does not apply" in err[0]
    assert not (native_build.source_root() / ".pytrain-extracted").exists()


def _prefix(tmp_path, **source):
    p = tmp_path / "prefix"
    p.mkdir()
    (p / "options.json").write_text('["-DGGML_NATIVE=OFF"]')
    if source:
        import json
        (p / "source.json").write_text(json.dumps(source))
    return p


def test_a_prebuilt_prefix_from_another_patch_set_is_refused(tmp_path, cache, monkeypatch, capsys):
    """A prefix carried from an older checkout would be stamped as this build: refused, with
    the patch set it was built from."""
    monkeypatch.setattr(native_build, "extract_source", lambda: None)
    old = _prefix(tmp_path, archive_sha256=native_build.ARCHIVE_SHA256,
                  patches_sha256="0" * 64, patches=["0001-a.patch"])
    rc, err = run_main(["--cuda", "--prebuilt", str(old), "--out", str(tmp_path / "o")], capsys)
    assert rc == 1 and len(err) == 1
    assert "another source or patch set (patches: 0001-a.patch)" in err[0], err


def test_a_prebuilt_prefix_without_its_source_record_is_refused(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setattr(native_build, "extract_source", lambda: None)
    rc, err = run_main(["--cuda", "--prebuilt", str(_prefix(tmp_path)), "--out",
                        str(tmp_path / "o")], capsys)
    assert rc == 1 and len(err) == 1 and "not an install prefix made by native/build.py" in err[0]


def test_a_prebuilt_prefix_of_this_source_gives_its_options(tmp_path):
    p = _prefix(tmp_path, archive_sha256=native_build.ARCHIVE_SHA256,
                patches_sha256=native_build.patches_digest())
    assert native_build.check_prebuilt(p) == ["-DGGML_NATIVE=OFF"]


def test_builds_are_portable_unless_native_is_asked_for(monkeypatch):
    """The default build is llama.cpp's portable one: backends as run-time modules and one
    ggml-cpu per x86-64 level.  PYTRAIN_GGML_NATIVE=1 builds one ggml-cpu for this CPU (with
    -march=native: ggml's GGML_NATIVE refuses run-time backends)."""
    monkeypatch.delenv("PYTRAIN_GGML_NATIVE", raising=False)
    opts = native_build.ggml_options(cuda=False)
    assert {"-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DGGML_NATIVE=OFF"} <= set(opts)
    monkeypatch.setenv("PYTRAIN_GGML_NATIVE", "1")
    opts = native_build.ggml_options(cuda=False)
    assert "-DGGML_BACKEND_DL=ON" in opts and "-DCMAKE_CXX_FLAGS=-march=native" in opts
    assert "-DGGML_CPU_ALL_VARIANTS=ON" not in opts


@pytest.mark.parametrize("system,machine", [("Linux", "aarch64"), ("Darwin", "arm64"),
                                            ("Windows", "AMD64")])
def test_unsupported_platforms_are_refused_in_one_line(system, machine, tmp_path, cache,
                                                       monkeypatch, capsys):
    """Nothing is downloaded or compiled first: the pinned OpenBLAS wheel and the CPU
    variants are x86-64 Linux ones, and a later failure would name the wrong cause."""
    import platform
    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    fake_pip(monkeypatch, "import sys; sys.exit('pip must not run')")
    rc, err = run_main(["--out", str(tmp_path / "o")], capsys)
    assert rc == 1 and len(err) == 1, err
    assert err[0] == (f"error: pytrain supports Linux x86-64 only; this is {system} {machine} "
                      f'(see docs/install.md: supported platforms)')
    assert not (cache / "dl").exists() and not (tmp_path / "o" / "build_info.json").exists()


def test_the_build_installs_every_x86_cpu_variant_and_one_abi3_module():
    """What `make build` put in the package: libggml and libggml-base by their sonames, a
    ggml-cpu module per x86-64 level (the portable set llama.cpp's releases ship), and the
    cffi extension for CPython's limited API."""
    import json
    info = json.loads((Path(native_build.PKG_NATIVE) / "build_info.json").read_text())
    if "-DGGML_CPU_ALL_VARIANTS=ON" not in info["options"]:
        pytest.skip("a PYTRAIN_GGML_NATIVE=1 build has one ggml-cpu module")
    assert {"x64", "sse42", "haswell", "skylakex", "icelake", "zen4",
            "sapphirerapids"} <= set(info["cpu_variants"])
    lib = Path(native_build.PKG_NATIVE) / "lib"
    assert (lib / "libggml.so.0").is_file() and (lib / "libggml-base.so.0").is_file()
    assert not any(p.is_symlink() for p in lib.iterdir())
    assert info["module"] == "_ggml.abi3.so"
    assert [p.name for p in Path(native_build.PKG_NATIVE).glob("_ggml*.so")] == ["_ggml.abi3.so"]


def test_finding_pip_does_not_import_it():
    """Importing pip makes setuptools' distutils shim step aside for the rest of the process,
    and cffi then built the extension with the stdlib distutils, which cannot name it for the
    limited API: a fresh clone's first build failed that way (later builds, with the archive
    cached, never asked for pip)."""
    import subprocess
    code = ("import sys; sys.path.insert(0, 'native'); import build; build._pip_command(); "
            "import setuptools, distutils; "        # as cffi's compile imports them
            "print('pip' in sys.modules, 'setuptools' in distutils.__file__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(native_build.__file__).resolve().parent.parent, timeout=60)
    assert r.stdout.split() == ["False", "True"], r.stdout + r.stderr
