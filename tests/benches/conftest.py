"""The bench's modules, loaded by path for the tests of ``tests/benches``.

``benches/`` is no package: its modules are scripts side by side, which
import each other by plain name (``from rows import Run``). So each is
loaded from its file after the modules it imports, under its own name,
and those names leave ``sys.modules`` again once all are loaded (the
modules keep their references to each other).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType, SimpleNamespace

import pytest

BENCHES = pathlib.Path(__file__).resolve().parents[2] / "benches"
# Each after the ones it imports. The roles, the floor and the entry point
# import JAX and the sender and run on GPUs: not loaded here.
IMPORT_ORDER = ("procs", "workloads", "rows", "report", "per_op", "fleet")


def load_benches(names: tuple[str, ...] = IMPORT_ORDER) -> SimpleNamespace:
    """The modules ``names`` of ``benches/``, loaded in that order."""
    loaded: dict[str, ModuleType] = {}
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # the name the later ones import it by
            loaded[name] = module
            spec.loader.exec_module(module)
    finally:
        for name in loaded:
            sys.modules.pop(name, None)
    return SimpleNamespace(**loaded)


@pytest.fixture(scope="session")
def bench() -> SimpleNamespace:
    """``bench.rows``, ``bench.report``, ``bench.workloads``, ``bench.per_op``, ``bench.procs``,
    ``bench.fleet``."""
    return load_benches()
