"""Support code for the tests: the in-memory link, loopback HTTP servers,
and the rank processes of the GPU and multi-process tests (run as
``python -m support.NAME`` with ``child``)."""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def child(module: str, *args: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run ``support.<module>`` in a child process
    (from the repository root, where ``.vllm/`` is looked for): the tests
    folder goes on its ``PYTHONPATH``, so it finds ``support``."""
    path = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", f"support.{module}", *args], dict(env, PYTHONPATH=path)
