"""The Vulkan build's tools (native/vulkan_tools.py): a missing tool is one line saying what to
do, ``auto`` builds without Vulkan instead of failing, and the apt sources the installer uses
are derived from the machine's own Debian entry, in files of its own.  No apt, no network:
these run in well under a second."""
import pytest
import vulkan_tools  # native/vulkan_tools.py (conftest puts native/ on sys.path)

import build as native_build  # native/build.py

MIRROR = "http://mirror.invalid/debian"     # a made-up mirror: nothing is fetched


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    """A machine without glslc and with only bookworm's (too old) headers, or none."""
    monkeypatch.setenv("PYTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    real = vulkan_tools.shutil.which
    monkeypatch.setattr(vulkan_tools.shutil, "which",
                        lambda name, *a, **k: None if name == "glslc" else real(name, *a, **k))


def test_vulkan_requested_without_its_tools_is_one_line(no_tools, tmp_path, capsys):
    rc = native_build.main(["--vulkan", "1", "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("[native]")]
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("error: the Vulkan build needs glslc")
    assert "Vulkan headers >= 1.4" in err[0]
    assert "native/vulkan_tools.py --install" in err[0] and "VULKAN_SDK" in err[0]
    assert not (tmp_path / "o" / "build_info.json").exists()


def test_auto_builds_without_vulkan_when_its_tools_are_missing(no_tools, capsys):
    assert native_build.vulkan_wanted("auto") is False
    assert "building without Vulkan: the Vulkan build needs glslc" in capsys.readouterr().err
    assert native_build.vulkan_wanted("0") is False
    with pytest.raises(native_build.BuildError, match="expected 0, 1 or auto"):
        native_build.vulkan_wanted("yes")


def test_the_vulkan_options_name_the_tools_found(tmp_path):
    t = vulkan_tools.VulkanTools(tmp_path / "glslc", tmp_path / "inc", tmp_path / "spirv",
                                 tmp_path / "libvulkan.so")
    opts = t.cmake_options()
    assert opts[0] == "-DGGML_VULKAN=ON"
    assert f"-DVulkan_GLSLC_EXECUTABLE={tmp_path / 'glslc'}" in opts
    assert f"-DVulkan_INCLUDE_DIR={tmp_path / 'inc'}" in opts


def test_headers_are_recognised_by_their_version(tmp_path):
    inc = tmp_path / "include"
    (inc / "vulkan").mkdir(parents=True)
    (inc / "vulkan" / "vulkan.hpp").write_text("")
    (inc / "vulkan" / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n"
        "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n")
    assert vulkan_tools._header_version(inc) == (1, 4, 309)
    (inc / "vulkan" / "vulkan.hpp").unlink()            # the C++ headers are what ggml needs
    assert vulkan_tools._header_version(inc) is None


@pytest.mark.parametrize("text", [
    f"Types: deb\nURIs: {MIRROR}\nSuites: bookworm bookworm-updates\nComponents: main\n"
    f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
    f"Types: deb\nURIs: {MIRROR}-security\nSuites: bookworm-security\nComponents: main\n"
    f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n",
    f"# one-line format\ndeb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
    f"{MIRROR} bookworm main\ndeb {MIRROR}-security bookworm-security main\n"])
def test_apt_sources_are_derived_from_the_machines_own_entry(text, tmp_path, monkeypatch):
    """Both source formats Debian uses: the bookworm entry's mirror and key serve the other
    suites, written to a source list in the cache (the system's apt files are not touched)."""
    monkeypatch.setenv("PYTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(vulkan_tools, "_system_sources", lambda: [text])
    src = vulkan_tools.debian_source([text])
    assert src.uris == MIRROR
    assert src.signed_by == "/usr/share/keyrings/debian-archive-keyring.gpg"
    apt = vulkan_tools.Apt("trixie", ["trixie"])
    stanza = (apt.root / "pytrain.sources").read_text()
    assert f"URIs: {MIRROR}\nSuites: trixie\n" in stanza and "Signed-By: /usr/share" in stanza
    assert apt.root.is_relative_to(tmp_path / "cache")
    assert f"Dir::Etc::SourceList={apt.root / 'pytrain.sources'}" in apt.opts


def test_no_debian_entry_is_one_line():
    with pytest.raises(vulkan_tools.ToolError, match="no apt source for Debian bookworm"):
        vulkan_tools.debian_source([f"deb {MIRROR} jammy main\n"])


def test_tests_must_run_where_make_test_installs_lavapipe(monkeypatch):
    monkeypatch.setattr(vulkan_tools, "can_install", lambda: True)
    assert vulkan_tools.required("auto") and vulkan_tools.required("1")
    assert not vulkan_tools.required("0")
    monkeypatch.setattr(vulkan_tools, "can_install", lambda: False)
    assert not vulkan_tools.required("auto") and vulkan_tools.required("1")


def test_the_build_record_names_the_backends_built():
    """`pytrain doctor` and the wheel's metadata read build_info.json: it must say Vulkan
    where libggml-vulkan.so was built (``make build VULKAN=1`` recorded a CPU-only build:
    pip's install step ran native/build.py again without PYTRAIN_VULKAN)."""
    from pytrain import ggml
    info = ggml.build_info()
    assert bool(info.get("vulkan")) == ggml.vulkan_built(), info.get("options")
    assert ("-DGGML_VULKAN=ON" in info.get("options", [])) == ggml.vulkan_built()
