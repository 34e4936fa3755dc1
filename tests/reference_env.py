"""The reference interpreter (torch, transformers, PEFT from scripts/requirements-reference.txt)
that the script smoke tests run the benchmarks' HF side and the fixture generators under.

Where it is: ``PYTRAIN_REF_PYTHON``, else ``.refenv/bin/python`` in the checkout (what
``make refenv`` creates), else ``/opt/refenv/bin/python``.  Absent, the tests that need it skip
on a user's machine; ``make test`` creates it and sets ``PYTRAIN_REQUIRE_REF=1``, under which a
missing interpreter is a failure, so CI never skips them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = (REPO / ".refenv" / "bin" / "python", Path("/opt/refenv/bin/python"))


def find() -> Path | None:
    env = os.environ.get("PYTRAIN_REF_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    return next((p for p in CANDIDATES if p.exists()), None)


def require() -> str:
    """The reference interpreter's path, or a skip (a failure under ``PYTRAIN_REQUIRE_REF=1``)."""
    p = find()
    if p is not None:
        return str(p)
    where = os.environ.get("PYTRAIN_REF_PYTHON") or " or ".join(map(str, CANDIDATES))
    msg = (f"no reference interpreter at {where}: `make refenv` creates .refenv/ from "
           f"scripts/requirements-reference.txt")
    if os.environ.get("PYTRAIN_REQUIRE_REF") == "1":
        pytest.fail(msg + " (PYTRAIN_REQUIRE_REF=1: make test must provide it)", pytrace=False)
    pytest.skip(msg)
