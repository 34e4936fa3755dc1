"""Builds the pinned ggml and its cffi module before the package's files are collected, so
`pip install .` gives a working install on a machine with cmake and a C/C++ compiler."""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildNative(build_py):
    def run(self):
        if subprocess.call([sys.executable, str(ROOT / "native" / "build.py")]) != 0:
            raise SystemExit("error: building the native ggml library failed (see above)")
        super().run()


setup(cmdclass={"build_py": BuildNative})
