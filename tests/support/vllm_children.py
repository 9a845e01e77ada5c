"""Child processes that run torch's and vLLM 0.33.0's own code, in the
interpreter named by ``JAX_SENDER_VLLM_PYTHON`` (torch CPU, vLLM's pure-Python
tree: ``.ci/vllm_venv.sh`` builds one). The test process itself never
imports torch. Tests skip, saying why, when the variable is not set; a
variable that names a broken interpreter fails them."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

VLLM_PYTHON = "JAX_SENDER_VLLM_PYTHON"
HERE = Path(__file__).resolve().parent / "children"  # the scripts it runs


def interpreter() -> str:
    """The children's interpreter, or a skip naming what to set."""
    path = os.environ.get(VLLM_PYTHON)
    if not path:
        pytest.skip(f"{VLLM_PYTHON} is not set: run .ci/vllm_venv.sh and set it to the "
                    ".venv-vllm/bin/python it prints to run torch's and vLLM's own code here")
    assert Path(path).is_file(), f"{VLLM_PYTHON}={path} is not a file"
    return path


class Child:
    """A child process whose stdout is read as JSON lines by a thread, so
    every read has a deadline. It runs ``support/children/SCRIPT`` in
    ``python`` (default: the interpreter of ``JAX_SENDER_VLLM_PYTHON``)."""

    def __init__(self, script: str, *args: object, stdin: bool = False,
                 python: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [python or interpreter(), str(HERE / script), *map(str, args)],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout: float) -> dict:
        """The next JSON line, within ``timeout`` seconds."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer from the child within {timeout} s; "
                                 f"stderr: {''.join(self.stderr)[-2000:]}") from None
        assert line is not None, f"the child ended; stderr: {''.join(self.stderr)[-2000:]}"
        return line

    def call(self, *request: object, timeout: float = 60) -> dict:
        """Send a JSON line to the child's stdin; its answer."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.next(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` until true, failing with ``what`` past ``timeout``."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@contextlib.contextmanager
def vllm_host(module: str, *args: str, log: Path, env: dict[str, str] | None = None,
              start_s: float = 240.0) -> Iterator[str]:
    """``python -m MODULE --port P --log LOG ARGS`` (one of
    ``jax_sender.testing``'s hosts of vLLM's real engines) in the children's
    interpreter, from the repository root with ``tests/`` on its path; its
    URL once it answers, within ``start_s``; killed on the way out."""
    import httpx

    from jax_sender.testing.harness import free_port

    from . import ROOT, on_tests_path
    port = free_port()
    proc = subprocess.Popen(
        [interpreter(), "-m", module, "--port", str(port), "--log", str(log), *args],
        env=on_tests_path(dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + start_s
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                httpx.get(url + "/get_world_size", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < end, f"{module} did not start within {start_s} s"
                time.sleep(0.5)
        yield url
    finally:
        proc.kill()
        proc.wait(30)


def ipc_fabric_host(log: Path, gpus: str, *args: str, pickles: bool = True):
    """``vllm_host`` of vLLM's ``ipc`` engine on CPU, a worker per entry of
    ``gpus`` (stand-in GPU ordinals), the CUDA calls replaced by host shared
    memory on both sides (``support.ipc_fabric``)."""
    return vllm_host("jax_sender.testing.vllm_ipc", "--cpu", "--gpus", gpus,
                     "--plane", "support.ipc_fabric:", *args, log=log,
                     env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1" if pickles else "0"})
