"""Support code for the tests: servers and the in-memory link
(``servers/``), code run in child processes (``children/``: the rank
processes of the GPU and multi-process tests, run as
``python -m support.children.NAME`` with ``child``), stand-ins for the CUDA
driver and libnccl, and helpers."""

from __future__ import annotations

import os
import pathlib
import socket
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def on_tests_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository and the tests folder first on its
    ``PYTHONPATH``: a child process started with it imports this checkout's
    packages and ``support``, from any working directory."""
    path = os.pathsep.join(p for p in (str(ROOT), str(TESTS), env.get("PYTHONPATH", "")) if p)
    return dict(env, PYTHONPATH=path)


def child(module: str, *args: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run ``support.<module>`` (a dotted path
    under ``support``, e.g. ``children.gpu_scenarios``) in a child process
    (from the repository root, where ``.vllm/`` is looked for), with
    ``on_tests_path(env)``."""
    return [sys.executable, "-m", f"support.{module}", *args], on_tests_path(env)


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closed ``sock`` (EOF or a reset) within ``timeout``;
    what it sent before is read and dropped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def nothing_listens(host: str, port: int) -> bool:
    """Whether a connection to ``host:port`` is refused (a listener that is
    closing may still reset one: not yet)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass
    return False
