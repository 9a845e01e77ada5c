"""Start a receiving server as a child process, and stop it: the reference
receiver (``server.py``), or vLLM 0.33.0's own (``.vllm/``, see the README).

Each server and its workers run in a process group of their own, killed
whole on exit, so a failed test, benchmark or demo never leaves a receiver
behind holding a GPU.
"""

from __future__ import annotations

import errno
import os
import pathlib
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

# The folder that holds the ``jax_sender`` package: children run from it, so
# ``python -m jax_sender...`` finds it in a source checkout as in an install.
_HOME = pathlib.Path(__file__).resolve().parents[2]
# vLLM 0.33.0's receiving code, when a test or the bench has it (see docs/testing.md).
VLLM_TREE = pathlib.Path(os.environ.get("JAX_SENDER_VLLM_TREE") or pathlib.Path.cwd() / ".vllm")
SHARE_GPUS = "JAX_SENDER_SHARE_GPUS"


def child_env() -> dict[str, str]:
    """The environment of a child process: NVLS off unless set (see the
    README), output unbuffered so a dying child's last lines are kept."""
    return dict(os.environ, PYTHONUNBUFFERED="1",
                NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))


def gpu_count() -> int:
    """CUDA devices visible here, counted in a child process so this one
    never initialises CUDA; 0 where there is no driver."""
    code = "from nccl_cffi.cuda import device_count; print(device_count())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, cwd=_HOME)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def gpu_env(gpu: str | int) -> dict[str, str]:
    """``child_env()`` for a child process on GPU ``gpu``.

    With ``JAX_SENDER_SHARE_GPUS=n``, GPU ``g`` runs on the ``g % n``-th GPU
    this process sees (``CUDA_VISIBLE_DEVICES``, when set) and counts as a host
    of its own to NCCL (its own ``NCCL_HOSTID``, socket transport on
    loopback), and JAX allocates on demand instead of taking 75% of the GPU
    up front. NCCL refuses two ranks on one device of one host; this is how
    the 4-rank tests run on 2 GPUs and the demo on one. Correct, not fast:
    never use it for timings.
    """
    env = dict(child_env(), CUDA_VISIBLE_DEVICES=str(gpu))
    share = int(os.environ.get(SHARE_GPUS) or 0)
    if share:
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        slot = int(gpu) % share
        env.update(CUDA_VISIBLE_DEVICES=visible[slot] if slot < len(visible) else str(slot),
                   NCCL_NET="Socket",
                   NCCL_HOSTID=f"{socket.gethostname()}-gpu{gpu}", NCCL_SOCKET_IFNAME="lo",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return env


def free_port() -> int:
    """A TCP port free on every interface right now, for a server that a
    child process will bind later (JAX's coordinator, a vLLM server).

    Picked below the kernel's ephemeral range, so that no ``bind(port=0)`` and
    no outgoing connection's source port can take it in between: a JAX peer
    retrying its connect to the coordinator could otherwise get the very port
    the coordinator is about to bind, which then fails ("Failed to add port to
    server") and leaves the peer waiting out its timeout. Probed on the IPv6
    wildcard where there is one, as JAX's coordinator binds ``[::]:port``.
    """
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(max(1024, low - 12288), low), 64) if low > 2048 else []
    for port in candidates + [0]:
        if (bound := _bind_and_release(port)) is not None:
            return bound
    raise OSError("no free TCP port")


def _bind_and_release(port: int) -> int | None:
    """Bind ``port`` (0: any) on the dual-stack IPv6 wildcard, or on
    127.0.0.1 where the host has no IPv6; the port bound, or None if taken."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.1")):
        try:
            s = socket.socket(family)
        except OSError:
            continue  # no IPv6 support at all
        with s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 turned off
                return None
            return s.getsockname()[1]
    return None


def run_all(procs: Sequence[subprocess.Popen], timeout: float, expect: str = "OK") -> list[str]:
    """Wait for ``procs`` (text pipes) together; each must exit 0 and print
    ``expect``. Their outputs. The first to fail, or ``timeout``, kills them all at
    once (a peer left waiting would only hit its own deadline later), and the
    error carries every process's output: the cause is often in the peer."""
    outs = [("", "")] * len(procs)

    def drain(i: int) -> None:
        outs[i] = procs[i].communicate()

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for r in readers:
        r.start()
    why = _first_failure(procs, timeout)
    for p in procs:
        p.kill()
    for r in readers:
        r.join(30)
    if why or any(p.returncode != 0 or expect not in out for p, (out, _) in zip(procs, outs)):
        raise RuntimeError(f"{why or f'a process did not print {expect}'}:\n" + "\n".join(
            f"{p.args} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
            for p, (out, err) in zip(procs, outs)))
    return [out for out, _ in outs]


def _first_failure(procs: Sequence[subprocess.Popen], timeout: float) -> str:
    """Wait until every process exited (""), one failed, or ``timeout`` passed
    (why, in words)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            return "a process failed"
        if time.monotonic() > deadline:
            return f"not done within {timeout:.0f}s"
        time.sleep(0.1)
    return ""


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads, and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class ReferenceServer:
    """``with ReferenceServer(gpus=["1"]) as url: ...``"""

    def __init__(self, gpus: Sequence[str | int] = (), *, fail_load_after: int = -1,
                 load_delay: float = 0.0, refuse_updates: int = 0, backend: str = "nccl",
                 start_timeout: float = 300.0):
        self.gpus = [str(g) for g in gpus]
        self.backend = backend
        self.fault_args = ["--fail-load-after", str(fail_load_after), "--load-delay",
                           str(load_delay), "--refuse-updates", str(refuse_updates)]
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        gpus = ["--gpus", ",".join(self.gpus)] if self.gpus else ["--no-workers"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jax_sender.testing.server", *gpus,
             "--backend", self.backend, *self.fault_args],
            stdout=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"reference server exited with {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("READY "):
                    self.url = line.split()[1]
                    return self.url
        self.stop()
        raise TimeoutError(f"reference server not ready within {self.start_timeout}s")

    def kill_workers(self) -> None:
        """Fault injection: SIGKILL only the worker processes; the server stays up."""
        if self.proc is None:
            return
        for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:  # the parent is the server
                os.kill(int(stat.parent.name), signal.SIGKILL)

    def kill_worker_group(self) -> None:
        """Fault injection: kill the server and its workers at once (SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        _kill_group(self.proc)
        self.proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_available(tree: pathlib.Path = VLLM_TREE) -> bool:
    """Whether vLLM 0.33.0's tree in ``tree`` imports here (it needs torch)."""
    code = f"import sys; sys.path.insert(0, {str(tree)!r}); import shim, fastapi, vllm"
    return tree.is_dir() and subprocess.run(
        [sys.executable, "-c", code], cwd=tree.parent, capture_output=True,
        timeout=120).returncode == 0


class VLLMServer:
    """``with VLLMServer("1", output=..., requests=...) as url: ...``: vLLM's
    weight-sync routes over its real NCCL engine (``.vllm/server.py --nccl``)
    on one GPU; with ``sparse=True``, over its ``sparse_nccl`` engine
    (``vllm_sparse.py``); with ``m2n=True``, over its ``nccl_m2n`` engine in
    one tensor-parallel worker per GPU of ``gpu`` ("1,2": ``vllm_m2n.py``);
    with ``ipc=True``, over its ``ipc`` engine likewise ("0,0": two workers
    on one GPU; ``vllm_ipc.py``, ``args`` added to its command line).
    ``output`` gets its stdout and stderr, ``requests`` one JSON line per
    request; ``env`` adds to the server's environment."""

    def __init__(self, gpu: str, *, output: pathlib.Path, requests: pathlib.Path,
                 sparse: bool = False, m2n: bool = False, ipc: bool = False,
                 tree: pathlib.Path = VLLM_TREE, start_timeout: float = 180.0,
                 env: dict[str, str] | None = None, args: Sequence[str] = ()):
        self.gpu, self.output, self.requests = gpu, output, requests
        self.extra_env, self.ipc, self.args = env or {}, ipc, list(args)
        self.sparse, self.m2n, self.tree, self.start_timeout = sparse, m2n, tree, start_timeout
        self.proc: subprocess.Popen | None = None

    def _command(self) -> list[str]:
        if self.ipc:
            return [sys.executable, "-m", "jax_sender.testing.vllm_ipc", str(self.tree),
                    "--gpus", self.gpu, *self.args]
        if self.m2n:  # one tensor-parallel worker per GPU in ``gpu`` ("1,2")
            return [sys.executable, "-m", "jax_sender.testing.vllm_m2n", str(self.tree),
                    "--gpus", self.gpu]
        if self.sparse:
            return [sys.executable, "-m", "jax_sender.testing.vllm_sparse", str(self.tree)]
        return [sys.executable, str(self.tree / "server.py"), "--nccl"]

    def __enter__(self) -> str:
        import httpx
        port = free_port()
        env = {**(child_env() if self.m2n or self.ipc else gpu_env(self.gpu)),
               **self.extra_env}
        cmd = self._command()
        with open(self.output, "w") as out:
            self.proc = subprocess.Popen(
                cmd + ["--port", str(port), "--log", str(self.requests)], env=env,
                cwd=_HOME,
                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"vLLM server exited; see {self.output}")
            try:
                httpx.get(url + "/get_world_size", timeout=2)
                return url
            except httpx.HTTPError:
                time.sleep(1)
        self.__exit__()
        raise TimeoutError(f"vLLM server not ready within {self.start_timeout}s; "
                           f"see {self.output}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None
