"""The release, in one place: pyproject.toml reads it, ``pytrain doctor`` prints it."""
__version__ = "0.1.0"
