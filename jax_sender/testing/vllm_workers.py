"""What the tests' hosts of vLLM 0.33.0's real worker engines share
(``vllm_m2n.py``, ``vllm_ipc.py``): vLLM's tree made importable without its
compiled kernels, one worker process per tensor-parallel rank answering
vLLM's collective RPCs in order, an engine client with vLLM's session rules
(a rank-indexed ``update_info`` list gives each worker its own entry, as
vLLM's ``Worker.update_weights`` does), and vLLM's own routes and exception
handlers over it, each request logged.

A host names its engine with ``opts["calls"]``: ``MODULE:FUNCTION``, which
each worker calls as ``FUNCTION(rank, tp, device, opts)`` for its RPC table
(``init``, ``start``, ``update``, ``finish``, ``shutdown``, ``checksums``,
``reset``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing
import os
import sys
import threading
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from .vllm_sparse import package_alone


class _Any:
    """What a stubbed module gives for any name: callable, subscriptable, a base class."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __call__(self, *a: Any, **k: Any) -> _Any:
        return _Any()

    def __getattr__(self, name: str) -> _Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __or__(self, other: Any) -> _Any:
        return _Any()

    __ror__ = __or__

    def __getitem__(self, key: Any) -> _Any:
        return _Any()


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty stand-ins for packages vLLM's import chain names but the
    weight-transfer path never calls (structured-output backends the GPU
    image lacks), so vLLM's real layer and engine modules import."""

    def __init__(self, names: list[str]):
        self.names = set(names)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)

        def attr(name: str) -> _Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

        module.__getattr__ = attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _without_flash_attention() -> None:
    """On CUDA, vLLM's layerwise reload (the fallback path's start and
    finish) imports the attention layers, which import flash attention's
    kernels at module level; the tree leaves them out, and a weight update
    never calls them: a stand-in takes their place where they do not load."""
    name = "vllm.vllm_flash_attn"
    try:
        importlib.import_module(name)
    except ImportError:
        spec = importlib.machinery.ModuleSpec(name, _Stubs([]), is_package=True)
        sys.modules[name] = importlib.util.module_from_spec(spec)


def load_vllm(tree: str | None, cpu: bool) -> None:
    """vLLM's tree importable here: on a GPU machine the tree's shim forces
    vLLM's CUDA platform (the real one needs compiled kernels); packages
    vLLM's import chain names but the weight-transfer path never calls are
    stubbed where missing; and two modules vLLM's router and receive path
    import (the whole engine protocol, an MTP-model check) are stood in for,
    as the tree's ``server.py`` does."""
    import contextlib
    if tree:
        sys.path.insert(0, tree)
    missing = [n for n in ("xgrammar", "llguidance") if importlib.util.find_spec(n) is None]
    sys.meta_path.append(_Stubs(missing))
    if not cpu:
        import shim  # the tree's
        shim.load()
        _without_flash_attention()
    package_alone("vllm.model_executor.model_loader")  # its __init__: every loader
    protocol = types.ModuleType("vllm.engine.protocol")
    protocol.EngineClient = object
    sys.modules.setdefault("vllm.engine.protocol", protocol)
    mtp = types.ModuleType("vllm.model_executor.model_loader.mtp_validation")
    mtp.disable_mtp_completeness_check = contextlib.nullcontext
    sys.modules.setdefault("vllm.model_executor.model_loader.mtp_validation", mtp)


def parallel_config(rank: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_index=0, world_size=tp, rank=rank,
                           world_size_across_dp=tp, pipeline_parallel_size=1)


def attach(model: Any, name: str, param: Any) -> None:
    import torch
    *path, leaf = name.split(".")
    module = model
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)




def rpc_table(engine: Any, model: Any, rank: int, device: str) -> dict[str, Callable[..., Any]]:
    """One worker's RPCs over vLLM's weight-transfer ``engine`` and its
    ``model``: the engine's own calls, each update synchronised on a GPU,
    vLLM's digests (under the worker's ``dp0:pp0:pcp0:tp{rank}:`` prefix)
    and its reset of the weights."""
    import torch

    from .vllm_sparse import module_alone
    checksum = module_alone("vllm.model_executor.model_loader.weight_checksum")
    prefix = f"dp0:pp0:pcp0:tp{rank}:"

    def update(info: dict) -> None:
        engine.receive_weights(engine.parse_update_info(info))
        if device != "cpu":
            torch.cuda.synchronize()

    return {
        "init": lambda info: engine.init_transfer_engine(engine.parse_init_info(info)),
        "start": engine.start_weight_update, "update": update,
        "finish": engine.finish_weight_update, "shutdown": engine.shutdown,
        "checksums": lambda: {prefix + k: v
                              for k, v in checksum.compute_tensor_digests(model).items()},
        "reset": lambda: checksum.zero_weights(model),
    }


def _worker(rank: int, tp: int, opts: dict[str, Any], env: dict[str, str], conn: Any) -> None:
    """A worker process: one vLLM worker's engine (``opts["calls"]``),
    answering RPCs in order."""
    os.environ.update(env)
    if os.environ.get("NCCL_LIBRARY") and not opts["cpu"]:  # before torch and nccl4py load theirs
        ctypes.CDLL(os.environ["NCCL_LIBRARY"], mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    load_vllm(opts["tree"], opts["cpu"])
    import torch
    device = "cpu" if opts["cpu"] else "cuda:0"
    if not opts["cpu"]:
        torch.cuda.set_device(0)
    if opts.get("plane"):  # a stand-in data plane (tests on CPU): MODULE:ARGUMENT
        module, _, argument = opts["plane"].partition(":")
        importlib.import_module(module).install(argument)
    module, _, name = opts["calls"].partition(":")
    calls: dict[str, Callable[..., Any]] = getattr(importlib.import_module(module), name)(
        rank, tp, device, opts)
    conn.send(("ready", None))
    while True:
        method, args = conn.recv()
        try:
            conn.send(("ok", calls[method](*args)))
        except Exception as e:  # vLLM wraps a worker's failure as an Exception -> HTTP 500
            conn.send(("err", f"{type(e).__name__}: {e}"))


class Workers:
    """The worker processes, called together (vLLM's collective RPC), one call at a time."""

    def __init__(self, tp: int, opts: dict[str, Any], envs: list[dict[str, str]]):
        ctx = multiprocessing.get_context("spawn")
        self.lock = threading.Lock()
        self.conns = []
        for rank in range(tp):
            mine, theirs = ctx.Pipe()
            ctx.Process(target=_worker, args=(rank, tp, opts, envs[rank], theirs),
                        daemon=True).start()
            self.conns.append(mine)
        for c in self.conns:
            status, _ = c.recv()
            assert status == "ready"

    def idle(self) -> None:
        """Return once no call runs (vLLM's engine-core routes wait behind a busy worker)."""
        with self.lock:
            pass

    def call(self, method: str, *args: Any, each: list[tuple[Any, ...]] | None = None
             ) -> list[Any]:
        """``method(*args)`` on every worker (or ``method(*each[rank])``),
        all at once; their answers, or the first failure as vLLM raises it."""
        with self.lock:
            for rank, c in enumerate(self.conns):
                c.send((method, args if each is None else each[rank]))
            answers = [c.recv() for c in self.conns]
        errors = [a for status, a in answers if status == "err"]
        if errors:
            raise Exception(f"Call to collective_rpc method failed: {errors[0]}")
        return [a for _, a in answers]


class Client:
    """vLLM's engine client as the routes call it: the session rules of its
    engine core, each RPC sent to every worker (``Workers``)."""

    def __init__(self, workers: Workers, tp: int):
        self.workers = workers
        self.vllm_config = SimpleNamespace(parallel_config=parallel_config(0, tp))
        self.active, self.version, self.paused = False, "default", False
        self.sleeping: set[str] = set()  # the memory tags asleep (/sleep, /wake_up)

    async def _rpc(self, method: str, *args: Any, each: list[tuple[Any, ...]] | None = None
                   ) -> list[Any]:
        return await asyncio.to_thread(functools.partial(self.workers.call, method, *args,
                                                         each=each))

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._rpc("init", request.init_info)

    async def shutdown_weight_transfer_engine(self) -> None:
        if self.active:
            raise RuntimeError("cannot shut down during an active weight update")
        await self._rpc("shutdown")

    async def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while an update is active")
        self.active = True
        await self._rpc("start")

    async def update_weights(self, request: Any) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        info = request.update_info
        each = [(info[rank],) for rank in range(len(self.workers.conns))] \
            if isinstance(info, list) else None  # rank-indexed: dp_index * world_size + rank
        try:
            await self._rpc("update", info, each=each)
        except BaseException:
            self.active = False  # vLLM drops the session without finishing it
            raise

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching "
                               "start_weight_update")
        await self._rpc("finish")
        self.active = False
        if weight_version is not None:
            self.version = weight_version

    async def get_weight_version(self) -> str:
        await asyncio.to_thread(self.workers.idle)
        return self.version

    async def is_paused(self) -> bool:
        await asyncio.to_thread(self.workers.idle)
        return self.paused

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method: str, *a: Any, **k: Any) -> None:
        if method == "reset_weights":
            await self._rpc("reset")

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return await self._rpc("checksums")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await asyncio.to_thread(self.workers.idle)
        self.sleeping = {"weights", "kv_cache"} if level else set()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        await asyncio.to_thread(self.workers.idle)
        self.sleeping -= set(tags) if tags else self.sleeping
        return not self.sleeping

    async def is_sleeping(self) -> bool:
        await asyncio.to_thread(self.workers.idle)
        return bool(self.sleeping)


def app(client: Any, log: str, *routers: Any) -> Any:
    """vLLM's RL router, ``routers`` and vLLM's exception handlers over
    ``client``, each request logged."""
    import json
    import time

    from fastapi import FastAPI, Request
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.state.engine_client = client
    app.state.args = SimpleNamespace(log_error_stack=False)
    init_exception_handler(app)
    for r in (router, *routers):
        app.include_router(r)

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        t0, status = time.time(), 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            with open(log, "a") as f:
                f.write(json.dumps({"t": t0, "path": request.url.path,
                                    "query": request.url.query, "status": status}) + "\n")

    return app


def host_parser(doc: str, gpus: str) -> argparse.ArgumentParser:
    """The command line every host takes: vLLM's tree, ``--port``, ``--log``,
    ``--gpus`` (default ``gpus``), ``--cpu`` and ``--plane``; a host adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("tree", nargs="?", help="a folder to put first on sys.path: vLLM 0.33.0's "
                    "tree with the shim (see docs/testing.md), when vLLM is not installed")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True, help="file that gets one JSON line per request")
    ap.add_argument("--gpus", default=gpus,
                    help="one GPU per worker (tensor-parallel rank), as harness.gpu_env takes them")
    ap.add_argument("--cpu", action="store_true", help="no GPU: the model on the CPU (with --plane)")
    ap.add_argument("--plane", default="", help="MODULE:ARGUMENT: each worker calls "
                    "MODULE.install(ARGUMENT) first (a stand-in for the GPU's data plane, for "
                    "CPU tests)")
    return ap


def worker_envs(gpus: list[str]) -> list[dict[str, str]]:
    """Each worker's environment on its GPU (``harness.gpu_env``: with
    ``JAX_SENDER_SHARE_GPUS`` each worker is an NCCL host of its own)."""
    from .harness import gpu_env
    return [gpu_env(g) for g in gpus]


