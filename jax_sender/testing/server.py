"""The reference receiver's HTTP front: vLLM's weight-transfer routes, same
paths, bodies, status codes and error shapes, over N worker processes, on
FastAPI and uvicorn like vLLM's own server.

Like vLLM, one API process fans each call out to every worker (one process
per GPU) and answers once all have; a worker's exception becomes HTTP 500
``{"error": {"message": "Call to collective_rpc method failed: ...", ...}}``
and a malformed body HTTP 400. The session rules are vLLM's: update needs a
started session, a failed update drops it, shutdown is refused mid-session.
``--gpus`` lists the physical GPUs, one worker each, and the server says
READY only once every worker holds its GPU; ``--no-workers`` runs none and
only validates requests (for CPU tests).

    python -m jax_sender.testing.server --gpus 1,2 --port 8011
"""

import argparse
import contextlib
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

try:  # the test extra's; main() says so when they are missing
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool
except ImportError as _missing:
    uvicorn = FastAPI = Request = JSONResponse = run_in_threadpool = None
    _MISSING = _missing.name
else:
    _MISSING = ""

from uniqueid.wire import InitInfo, SparseUpdateInfo, UpdateInfo

from .._src.core.tensors.plan import LoadPlan
from .harness import gpu_env

RPC_TIMEOUT = 3600.0
START_TIMEOUT = 300.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def rpc_failed(message: str) -> HTTPError:
    """vLLM's 500 for an error raised inside its workers' RPC."""
    return HTTPError(500, f"Call to collective_rpc method failed: {message}")


def _error_body(status: int, message: str) -> dict[str, Any]:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@dataclass
class Workers:
    """The worker processes and the RPC fan-out to them."""

    conns: list[Connection] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, method: str, *args: Any) -> list[Any]:
        with self.lock:
            for c in self.conns:
                c.send((method, args))
            results, errors = [], []
            for i, c in enumerate(self.conns):
                try:
                    if not c.poll(RPC_TIMEOUT):
                        raise TimeoutError(f"worker {i} did not answer {method} in {RPC_TIMEOUT}s")
                    status, value = c.recv()
                except (EOFError, OSError) as e:
                    errors.append(f"worker {i} died ({type(e).__name__})")
                    continue
                (results if status == "ok" else errors).append(value)
        if errors:
            raise rpc_failed(errors[0])
        return results

    def stop(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_workers(gpus: list[str], fault_args: list[str],
                  timeout: float = START_TIMEOUT) -> Workers:
    """One worker process per GPU; ``fault_args`` go to each (see ``worker.py``).

    A worker that exits, or is not ready within ``timeout``, fails the start
    at once: ``Listener.accept`` has no timeout of its own, so a watcher wakes
    it by connecting itself.
    """
    authkey = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    w = Workers()
    for rank, gpu in enumerate(gpus):
        env = dict(gpu_env(gpu), JVN_AUTHKEY=authkey.hex())
        w.procs.append(subprocess.Popen(
            [sys.executable, "-m", "jax_sender.testing.worker", "--port", str(listener.address[1]),
             "--worker-rank", str(rank), *fault_args], env=env))
    failure: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_watch, args=(w, listener, authkey, timeout, ready, failure),
                     daemon=True).start()
    try:
        _accept_all(w, listener, len(gpus), failure)
        if failure:
            raise RuntimeError(f"{failure[0]}; the worker's output above says why")
    except BaseException:
        ready.set()
        w.stop()
        raise
    finally:
        ready.set()
        listener.close()
    return w


def _watch(w: Workers, listener: Listener, authkey: bytes, timeout: float,
           ready: threading.Event, failure: list[str]) -> None:
    """Until ``ready``: on a worker's exit, or past ``timeout``, say why in
    ``failure`` and wake ``listener.accept`` by connecting to it."""
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        dead = [(i, p.returncode) for i, p in enumerate(w.procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            failure.append(f"worker {dead[0][0]} exited with status {dead[0][1]} before "
                           "it was ready" if dead else
                           f"the workers were not ready within {timeout:.0f}s")
            with contextlib.suppress(OSError, EOFError):
                Client(listener.address, authkey=authkey).close()
            return


def _accept_all(w: Workers, listener: Listener, count: int, failure: list[str]) -> None:
    """Each worker's connection and its ready message, until ``count`` came
    or ``failure`` says why not (a connection the watcher made included)."""
    while len(w.conns) < count and not failure:
        conn = listener.accept()
        while not failure and not conn.poll(0.2):
            pass
        if failure:
            return
        try:
            conn.recv()
        except EOFError:  # it connected, then died
            failure.append(f"worker {len(w.conns)} exited before it was ready")
            return
        w.conns.append(conn)


class State:
    def __init__(self, workers: Workers, backend: str = "nccl"):
        self.workers = workers
        self.backend = backend
        self.active = False
        self.version = "default"
        self.paused = False


def _body(raw: bytes, key: str, required: bool = True) -> Any:
    try:
        data = json.loads(raw) if raw else {}
    except ValueError as e:
        raise HTTPError(400, f"Invalid JSON body: {e}") from e
    if not isinstance(data, dict) or (required and key not in data):
        raise HTTPError(400, f"body must be an object with field {key!r}")
    return data.get(key)


def build_app(state: "State") -> Any:
    """vLLM's weight-transfer routes over ``state``'s workers, one function per
    route, on FastAPI like vLLM's own server. A worker call blocks until
    every worker answered, so it runs in the thread pool."""
    app = FastAPI()

    @app.exception_handler(HTTPError)
    async def error(_: Request, e: HTTPError) -> JSONResponse:
        return JSONResponse(_error_body(e.status, str(e)), status_code=e.status)

    _status_routes(app, state)
    _engine_routes(app, state)
    _update_routes(app, state)
    _checker_route(app, state)
    return app


def _status_routes(app: Any, state: State) -> None:
    """The routes vLLM's API process answers itself: world size, version, pause."""

    @app.get("/get_world_size")
    async def get_world_size() -> dict[str, Any]:
        return {"world_size": len(state.workers.conns)}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": state.version}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": state.paused}

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:
        if mode not in ("abort", "wait", "keep"):
            raise HTTPError(400, f"Input should be 'abort', 'wait' or 'keep', got {mode!r}")
        state.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        state.paused = False
        return {"status": "resumed"}


def _engine_routes(app: Any, state: State) -> None:
    """The transfer engine's init and shutdown, on every worker."""
    w = state.workers

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        info = _body(await request.body(), "init_info")
        if not isinstance(info, dict):
            raise HTTPError(400, "init_info must be an object")
        try:  # vLLM's parse raises inside the worker RPC -> 500
            parsed = InitInfo.from_payload(info)
            if parsed.use_load_plan:
                LoadPlan.from_payload(parsed.metadata)
        except (ValueError, TypeError) as e:
            raise rpc_failed(str(e)) from e
        await run_in_threadpool(w.call, "init", info)
        return {"message": "Weight transfer initialized"}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        if state.active:
            raise rpc_failed("cannot shut down during an active weight update")
        await run_in_threadpool(w.call, "shutdown")
        return {"message": "Weight transfer shut down"}


def _update_routes(app: Any, state: State) -> None:
    """An update session: start, the weights (received by every worker), finish."""

    @app.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        if state.active:
            raise rpc_failed("start_weight_update called while an update is active")
        state.active = True
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        info = _body(await request.body(), "update_info")
        if isinstance(info, list):
            info = info[0] if info else {}
        if not state.active:
            raise rpc_failed("start_weight_update must be called before update_weights.")
        sparse = state.backend == "sparse_nccl"
        try:
            (SparseUpdateInfo if sparse else UpdateInfo).from_payload(info)
            await run_in_threadpool(state.workers.call, "receive_sparse" if sparse else "receive",
                                    info)
        except (ValueError, TypeError) as e:
            state.active = False  # vLLM drops the session without finishing it
            raise rpc_failed(str(e)) from e
        except HTTPError:
            state.active = False
            raise
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        version = _body(await request.body(), "weight_version", required=False)
        if not state.active:
            raise rpc_failed("finish_weight_update called without a matching "
                             "start_weight_update")
        state.active = False
        if version is not None:
            state.version = version
        return {"message": "Weight update finished"}


def _checker_route(app: Any, state: State) -> None:
    """``/weight_checker``: every worker's SHA-256 checksums, a reset, a compare."""

    @app.post("/weight_checker")
    async def weight_checker(request: Request) -> dict[str, Any]:
        raw = await request.body()
        action, baseline = _body(raw, "action"), _body(raw, "baseline", required=False)
        if action not in ("checksum", "reset", "compare"):
            raise HTTPError(400, "action must be 'checksum', 'reset' or 'compare'")
        if action == "reset":
            await run_in_threadpool(state.workers.call, "reset")
            return {"status": "reset"}
        if action == "compare" and baseline is None:
            raise HTTPError(400, "action='compare' requires a 'baseline' object")
        sums: dict[str, str] = {}
        for part in await run_in_threadpool(state.workers.call, "checksums"):
            sums.update(part)
        if action == "checksum":
            return {"checksums": sums}
        bad = sorted(k for k in sums.keys() | baseline.keys() if sums.get(k) != baseline.get(k))
        return {"match": not bad, "mismatches": bad}


def _gpu_list(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise argparse.ArgumentTypeError(
            f"--gpus takes CUDA device numbers separated by commas, e.g. 1 or 1,2; got {text!r}")
    return gpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", type=_gpu_list,
                       help="comma-separated physical GPU ids, one worker each")
    where.add_argument("--no-workers", action="store_true",
                       help="no worker at all: only validate requests (CPU tests)")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--backend", choices=("nccl", "sparse_nccl"), default="nccl",
                    help="like vLLM's --weight-transfer-config backend, fixed at launch")
    ap.add_argument("--fail-load-after", default="-1", help="fault injection, see worker.py")
    ap.add_argument("--load-delay", default="0", help="fault injection, see worker.py")
    ap.add_argument("--refuse-updates", default="0", help="fault injection, see worker.py")
    args = ap.parse_args()
    if _MISSING:
        sys.exit(f"reference server not started: {_MISSING} is missing; "
                 "pip install 'jax-vllm-nccl[test]'")
    try:
        workers = start_workers(args.gpus or [], ["--fail-load-after", args.fail_load_after,
                                   "--load-delay", args.load_delay,
                                       "--refuse-updates", args.refuse_updates])
    except RuntimeError as e:
        sys.exit(f"reference server not started: {e}")
    app = build_app(State(workers, args.backend))
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    print(f"READY http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        workers.stop()


if __name__ == "__main__":
    main()
