"""Builds the pinned ggml and its cffi module before the package's files are collected, so
`pip install .` gives a working install on a machine with cmake and a C/C++ compiler, and
`pip wheel .` a wheel that says what it holds."""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


class BuildNative(build_py):
    def run(self):
        if subprocess.call([sys.executable, str(ROOT / "native" / "build.py")]) != 0:
            raise SystemExit("error: building the native ggml library failed (see above)")
        super().run()


class BinaryDistribution(Distribution):
    """The package holds compiled libraries (built by native/build.py, not by setuptools), so
    it is installed into platlib and its wheel is platform-specific."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """The wheel holds compiled libraries for one OS and CPU architecture (Linux x86-64: every
    x86-64 CPU level, chosen at run time) and a cffi extension built for CPython's limited
    API, so its tag is ``cp310-abi3-linux_x86_64``, never ``py3-none-any``.  It is not a
    manylinux wheel: it links the build machine's libstdc++, libgomp and glibc."""

    def finalize_options(self):
        self.py_limited_api = "cp310"
        super().finalize_options()


setup(distclass=BinaryDistribution,
      cmdclass={"build_py": BuildNative, "bdist_wheel": PlatformWheel})
