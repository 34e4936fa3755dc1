#!/usr/bin/env python3
"""What ggml's Vulkan backend needs to build and to run on a machine without a GPU.

* Building: the shader compiler ``glslc``, the Vulkan loader to link (``libvulkan.so``),
  Vulkan headers new enough for the pinned ggml-vulkan (it uses ``vk::LayerSettingEXT``,
  which Debian bookworm's 1.3.239 headers lack: trixie's 1.4.309 work) and the SPIR-V
  headers' CMake package.
* Running without a GPU: Mesa's software Vulkan driver, lavapipe.  Bookworm's Mesa 22.3
  crashed in ggml's optimizer test (a double free, 5 runs of 5); Mesa 25.0.7 from
  bookworm-backports passed 5 of 5.

On Debian bookworm as root (CI) ``install`` gets them all, each pinned: glslc, the loader and
Mesa's Vulkan drivers installed with apt by name and version (Mesa from bookworm-backports),
and trixie's headers downloaded with ``apt-get download``, checked by sha256 and unpacked
into the cache, never installed.  apt runs with a source list and package lists of its own
in the cache (``Dir::Etc::SourceList``, ``Dir::State::Lists``), derived at run time from the
machine's own bookworm entry (same mirror, same key, another suite): the system's apt
configuration is left as it was, and trixie's packages can never be picked by a later
``apt-get install``.  Elsewhere ``find`` looks for the tools and says, in one line, what is
missing.

Usage: python native/vulkan_tools.py --install | --check | --required MODE
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# installed with apt, by name and version
APT_PACKAGES = {"glslc": "2023.2-1", "libvulkan-dev": "1.3.239.0-1",
                "libvulkan1": "1.3.239.0-1", "mesa-vulkan-drivers": "25.0.7-2~bpo12+1"}
BACKPORTS = "bookworm-backports"     # the suite Mesa comes from (-t: its dependencies too)
CODENAME = "bookworm"                # the release these versions are pinned for

# downloaded and unpacked, never installed: (package, version, suite, sha256 of the .deb)
HEADER_DEBS = [
    ("libvulkan-dev", "1.4.309.0-1", "trixie",
     "8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"),
    ("spirv-headers", "1.6.1+1.4.309.0-1", "trixie",
     "dc18db866d63680351c40ac6b6bece34cb52da64a7799ce1cc4f16f6bff4d064"),
]
HEADERS_VERSION = "1.4.309"
LAVAPIPE_ICD = "lvp_icd*.json"      # lvp_icd.json (Mesa 25), lvp_icd.x86_64.json (22.3)
ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


class ToolError(RuntimeError):
    """A missing or unusable tool, with a one-line message saying what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain"))


def log(msg: str) -> None:
    print(f"[vulkan] {msg}", file=sys.stderr, flush=True)


@dataclass
class VulkanTools:
    glslc: Path
    include_dir: Path            # holds vulkan/vulkan.hpp >= 1.4
    spirv_headers_cmake: Path    # the folder of SPIRV-HeadersConfig.cmake
    library: Path                # libvulkan.so to link

    def cmake_options(self) -> list[str]:
        return ["-DGGML_VULKAN=ON", f"-DVulkan_GLSLC_EXECUTABLE={self.glslc}",
                f"-DVulkan_INCLUDE_DIR={self.include_dir}", f"-DVulkan_LIBRARY={self.library}",
                f"-DSPIRV-Headers_DIR={self.spirv_headers_cmake}"]


def headers_dir() -> Path:
    return cache_dir() / f"vulkan-headers-{HEADERS_VERSION}"


def _header_version(include: Path) -> tuple[int, int, int] | None:
    """VK_HEADER_VERSION_COMPLETE of ``include/vulkan/vulkan_core.h`` (1, 4, 309)."""
    core = include / "vulkan" / "vulkan_core.h"
    if not core.exists() or not (include / "vulkan" / "vulkan.hpp").exists():
        return None
    text = core.read_text(errors="replace")
    patch = re.search(r"#define VK_HEADER_VERSION (\d+)", text)
    full = re.search(r"#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, (\d+), (\d+),",
                     text)
    if not (patch and full):
        return None
    return int(full.group(1)), int(full.group(2)), int(patch.group(1))


def _library() -> Path | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        if (Path(d) / "libvulkan.so").exists():
            return Path(d) / "libvulkan.so"
    sdk = os.environ.get("VULKAN_SDK")
    if sdk and (Path(sdk) / "lib" / "libvulkan.so").exists():
        return Path(sdk) / "lib" / "libvulkan.so"
    return None


def find() -> VulkanTools:
    """The tools on this machine (the cache's unpacked headers first, then ``VULKAN_SDK``,
    then the system's), or a ToolError naming what is missing."""
    glslc = shutil.which("glslc")
    sdk = Path(os.environ["VULKAN_SDK"]) if os.environ.get("VULKAN_SDK") else None
    if glslc is None and sdk is not None and (sdk / "bin" / "glslc").exists():
        glslc = str(sdk / "bin" / "glslc")
    includes = [headers_dir() / "usr" / "include"] + ([sdk / "include"] if sdk else []) + \
        [Path("/usr/include")]
    include = next((i for i in includes if (_header_version(i) or (0,)) >= (1, 4, 0)), None)
    spirv = None
    if include is not None:
        root = include.parent
        for cand in (root / "share" / "cmake" / "SPIRV-Headers",
                     root / "lib" / "cmake" / "SPIRV-Headers"):
            if (cand / "SPIRV-HeadersConfig.cmake").exists():
                spirv = cand
                break
    library = _library()
    missing = []
    if glslc is None:
        missing.append("glslc")
    if library is None:
        missing.append("the Vulkan loader (libvulkan.so)")
    if include is None:
        have = _header_version(Path("/usr/include"))
        missing.append("Vulkan headers >= 1.4" + (f" (the system's are {'.'.join(map(str, have))})"
                                                  if have else ""))
    elif spirv is None:
        missing.append(f"the SPIR-V headers' CMake package beside {include}")
    if missing:
        raise ToolError(f"the Vulkan build needs {', '.join(missing)}: on Debian bookworm run "
                        f"`sudo python3 native/vulkan_tools.py --install`, elsewhere install "
                        f"the Vulkan SDK (set VULKAN_SDK) or your distribution's glslc, "
                        f"libvulkan-dev >= 1.4 and spirv-headers")
    return VulkanTools(Path(glslc), include, spirv, library)


def lavapipe_installed() -> bool:
    """Whether Mesa's software Vulkan driver is registered with the loader."""
    return any(any(Path(d).glob(LAVAPIPE_ICD)) for d in ICD_DIRS)


# --------------------------------------------------------------------------- apt (root, bookworm)

def codename() -> str | None:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return None
    m = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", text, re.M)
    return m.group(1) if m else None


def can_install() -> bool:
    """Root on Debian bookworm with apt: where ``install`` gets the pinned tools itself."""
    return (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None
            and codename() == CODENAME)


@dataclass
class AptSource:
    uris: str
    signed_by: str | None


def parse_sources(texts: list[str]) -> list[tuple[list[str], list[str], str | None]]:
    """(URIs, suites, Signed-By) of every deb entry in deb822 ``.sources`` texts or one-line
    ``.list`` texts."""
    out = []
    for text in texts:
        if re.search(r"^Types:", text, re.M):
            for stanza in re.split(r"\n\s*\n", text):
                f = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line:
                        continue
                    k, v = line.split(":", 1)
                    f[k.strip().lower()] = v.strip()
                if "deb" in f.get("types", "").split() and f.get("enabled", "yes") != "no":
                    out.append((f.get("uris", "").split(), f.get("suites", "").split(),
                                f.get("signed-by")))
        else:
            for line in text.splitlines():
                m = re.match(r"\s*deb\s+(\[([^\]]*)\]\s+)?(\S+)\s+(\S+)", line)
                if m:
                    opts = dict(o.split("=", 1) for o in (m.group(2) or "").split() if "=" in o)
                    out.append(([m.group(3)], [m.group(4)], opts.get("signed-by")))
    return out


def debian_source(texts: list[str]) -> AptSource:
    """The machine's own entry for the release's main suite (``bookworm``): its mirror and
    key serve the other suites too."""
    for uris, suites, key in parse_sources(texts):
        if CODENAME in suites and uris:
            return AptSource(" ".join(uris), key)
    raise ToolError(f"no apt source for Debian {CODENAME} in /etc/apt/sources.list or "
                    f"/etc/apt/sources.list.d: cannot derive {BACKPORTS}")


def _system_sources() -> list[str]:
    files = [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*"))
    return [f.read_text(errors="replace") for f in files
            if f.is_file() and f.suffix in (".list", ".sources")]


class Apt:
    """apt-get with a source list and package lists of its own (under the cache)."""

    def __init__(self, name: str, suites: list[str]):
        src = debian_source(_system_sources())
        self.root = cache_dir() / "apt" / name
        (self.root / "lists" / "partial").mkdir(parents=True, exist_ok=True)
        (self.root / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        stanza = (f"Types: deb\nURIs: {src.uris}\nSuites: {' '.join(suites)}\nComponents: main\n"
                  + (f"Signed-By: {src.signed_by}\n" if src.signed_by else ""))
        (self.root / "pytrain.sources").write_text(stanza)
        self.opts = ["-o", f"Dir::Etc::SourceList={self.root / 'pytrain.sources'}",
                     "-o", f"Dir::Etc::SourceParts={self.root / 'no-parts'}",
                     "-o", f"Dir::State::Lists={self.root / 'lists'}",
                     "-o", f"Dir::Cache::Archives={self.root / 'archives'}",
                     "-o", "APT::Sandbox::User=root"]
        self.updated = False

    def run(self, args: list[str], what: str, cwd: Path | None = None) -> None:
        if not self.updated and args[0] != "update":
            self.run(["update"], "apt-get update")
            self.updated = True
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        r = subprocess.run(["apt-get", "-q", *self.opts, *args], capture_output=True, text=True,
                           env=env, cwd=cwd)
        if r.returncode != 0:
            last = [l for l in (r.stdout + r.stderr).strip().splitlines() if l.startswith("E:")]
            raise ToolError(f"{what} failed ({(last or ['exit %d' % r.returncode])[-1]})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def installed_version(package: str) -> str | None:
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", package],
                       capture_output=True, text=True)
    parts = r.stdout.split()
    return parts[-1] if r.returncode == 0 and "installed" in parts[:3] else None


def install_packages() -> None:
    todo = {p: v for p, v in APT_PACKAGES.items() if installed_version(p) != v}
    if not todo:
        return
    log(f"installing {', '.join(f'{p}={v}' for p, v in todo.items())} with apt")
    apt = Apt("bookworm", [CODENAME, f"{CODENAME}-updates", BACKPORTS])
    apt.run(["install", "-y", "--no-install-recommends", "-t", BACKPORTS,
             *(f"{p}={v}" for p, v in todo.items())], "apt-get install")


def unpack_headers() -> Path:
    """trixie's Vulkan and SPIR-V headers, verified and unpacked into the cache (a marker,
    written last, names what is there)."""
    dest = headers_dir()
    want = " ".join(f"{p}={v}:{h}" for p, v, _, h in HEADER_DEBS)
    marker = dest / ".pytrain-unpacked"
    if marker.exists() and marker.read_text() == want:
        return dest
    apt = Apt("trixie", sorted({s for _, _, s, _ in HEADER_DEBS}))
    dl = apt.root / "download"
    shutil.rmtree(dl, ignore_errors=True)
    dl.mkdir()
    log(f"downloading {', '.join(f'{p}={v}' for p, v, _, _ in HEADER_DEBS)} (unpacked, "
        f"not installed)")
    apt.run(["download", *(f"{p}={v}" for p, v, _, _ in HEADER_DEBS)], "apt-get download", cwd=dl)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p, v, _, sha in HEADER_DEBS:
        debs = list(dl.glob(f"{p}_*.deb"))
        if len(debs) != 1:
            raise ToolError(f"apt-get download gave no {p}_*.deb")
        got = _sha256(debs[0])
        if got != sha:
            raise ToolError(f"sha256 mismatch for {debs[0].name}: got {got}, pinned {sha}; "
                            f"refusing to use it")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tmp)], check=True)
    (tmp / ".pytrain-unpacked").write_text(want)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def install() -> VulkanTools:
    """Everything above, on root + bookworm; elsewhere only the check."""
    if can_install():
        install_packages()
        unpack_headers()
    return find()


def required(mode: str) -> bool:
    """Whether the Vulkan tests must run (``PYTRAIN_REQUIRE_VULKAN``) for a build asked as
    ``mode``: always for 1, where ``install`` can get the tools for auto, never for 0."""
    return mode == "1" or (mode == "auto" and can_install())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--install", action="store_true",
                   help="install the pinned tools where possible (root, Debian bookworm)")
    g.add_argument("--check", action="store_true", help="say whether the build tools are here")
    g.add_argument("--required", metavar="MODE",
                   help="print 1 if the Vulkan tests must run for PYTRAIN_VULKAN=MODE, else 0")
    g.add_argument("--if-wanted", metavar="MODE",
                   help="--install for MODE 1 or auto (a failure is an error for 1, and for "
                        "auto where this machine can install), nothing for 0")
    a = ap.parse_args(argv)
    if a.required is not None:
        print(1 if required(a.required) else 0)
        return 0
    try:
        if a.if_wanted is not None:
            if a.if_wanted == "0":
                return 0
            try:
                t = install()
            except ToolError as e:
                if required(a.if_wanted):
                    raise
                log(f"no Vulkan backend: {e}")
                return 0
        else:
            t = install() if a.install else find()
        log(f"glslc {t.glslc}, headers {t.include_dir}, loader {t.library}; lavapipe "
            f"{'installed' if lavapipe_installed() else 'not installed'}")
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
