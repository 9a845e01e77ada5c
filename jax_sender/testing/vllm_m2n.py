"""vLLM 0.33.0's real ``nccl_m2n`` worker engine in tensor-parallel workers
behind one server's real routes, for tests:
``python -m jax_sender.testing.vllm_m2n [TREE] --port P --log F [--gpus 1,2]``.

The routes and their exception handlers are vLLM's own (its RL router and
its serving exception handlers); the engine client fans every weight-transfer RPC
out to one worker process per ``--gpus`` entry, as vLLM's engine core does, and
answers ``/get_world_size`` from the parallel config (TP = the workers).
Each worker runs vLLM's ``M2NWeightTransferEngine`` (metadata group,
agreements, communicator, destination plan, reshards) over NCCL >= 2.30.5
(``$NCCL_LIBRARY``, loaded before torch and nccl4py) into a toy model whose
parameters carry vLLM's own tensor-parallel loaders, so vLLM resolves some
of them "direct" (each worker receives only its shard, straight into the
parameter) and others "fallback" (the whole tensor, then its loader):

==================================  ==========  ================  ===========
parameter                           shape       loader            destination
==================================  ==========  ================  ===========
``layers.0.mlp.up_proj.weight``     (16, 8) bf  column-parallel   shard dim 0
``layers.0.mlp.down_proj.weight``   (8, 16) bf  row-parallel      shard dim 1
``layers.0.self_attn.o_proj.weight`` (8, 8) f32 row-parallel      shard dim 1
``norm.weight``                     (8,) f32    default           replicated
``layers.0.self_attn.q_proj.weight`` (16, 8) f32 wrapped column   fallback (its shard)
``embed_tokens.weight``             (32, 8) bf  wrapped default   fallback (whole)
==================================  ==========  ================  ===========

``/weight_checker`` is vLLM's (``compute_tensor_digests`` with each worker's
``dp0:pp0:pcp0:tp{rank}:`` prefix). Start and finish skip vLLM's layerwise
reload, which needs a real vLLM model. Needs torch, vLLM's tree,
``nccl-extensions`` and ``nccl4py`` on ``PYTHONPATH``, and a GPU per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing
import os
import sys
import threading
import types
from types import SimpleNamespace
from typing import Any

from .vllm_sparse import module_alone, package_alone

TOY = (  # name, shape, dtype, loader
    ("layers.0.mlp.up_proj.weight", (16, 8), "bfloat16", "column"),
    ("layers.0.mlp.down_proj.weight", (8, 16), "bfloat16", "row"),
    ("layers.0.self_attn.o_proj.weight", (8, 8), "float32", "row"),
    ("norm.weight", (8,), "float32", "default"),
    ("layers.0.self_attn.q_proj.weight", (16, 8), "float32", "wrapped column"),
    ("embed_tokens.weight", (32, 8), "bfloat16", "wrapped default"),
)
# Where vLLM resolves each, by name (None: replicated, direct or fallback).
EXPECTED_DESTINATIONS = dict(zip((t[0] for t in TOY),
                                 [(-1, 0), (-1, 1), (-1, 1), None, None, None]))


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


def _load_vllm(tree: str | None, cpu: bool) -> None:
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


def _parallel_config(rank: int, tp: int) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_index=0, world_size=tp, rank=rank,
                           world_size_across_dp=tp, pipeline_parallel_size=1)


def _toy_model(rank: int, tp: int, device: str) -> Any:
    """The table above, on this worker's GPU, each parameter its shard."""
    import torch
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    def owner(cls: type) -> Any:
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.tp_size, layer.tp_rank = tp, rank
        return layer

    model = torch.nn.Module()
    for name, shape, dtype, loader in TOY:
        local = list(shape)
        if "column" in loader:
            local[0] //= tp
        elif loader == "row":
            local[1] //= tp
        param = torch.nn.Parameter(torch.zeros(local, dtype=getattr(torch, dtype),
                                               device=device), requires_grad=False)
        if "column" in loader:
            param.output_dim = 0
            param.weight_loader = owner(ColumnParallelLinear).weight_loader
        elif loader == "row":
            param.input_dim = 1
            param.weight_loader = owner(RowParallelLinear).weight_loader
        else:
            param.weight_loader = _default_weight_loader
        if loader.startswith("wrapped"):  # vLLM cannot see through a wrapper: fallback
            param.weight_loader = functools.partial(param.weight_loader)
        _attach(model, name, param)

    def load_weights(pairs: Any) -> set[str]:
        params = dict(model.named_parameters())
        for name, tensor in pairs:
            params[name].weight_loader(params[name], tensor)
        return set(params)

    model.load_weights = load_weights
    return model


def _default_weight_loader(param: Any, loaded: Any) -> None:
    """vLLM's ``default_weight_loader`` (a shape check, then ``copy_``): its
    module's package pulls in the attention kernels, which need compiled CUDA."""
    assert param.size() == loaded.size(), (
        f"Attempted to load weight ({loaded.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded)


def _attach(model: Any, name: str, param: Any) -> None:
    import torch
    *path, leaf = name.split(".")
    module = model
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)


def _engine(rank: int, tp: int, device: str) -> tuple[Any, Any]:
    import torch
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferEngine

    class Engine(M2NWeightTransferEngine):
        def start_weight_update(self) -> None:  # vLLM runs layerwise reload here
            pass

        def finish_weight_update(self) -> None:
            if device != "cpu":
                torch.cuda.synchronize()

    Engine.__name__ = Engine.__qualname__ = "M2NWeightTransferEngine"
    model = _toy_model(rank, tp, device)
    config = SimpleNamespace(parallel_config=_parallel_config(rank, tp),
                             model_config=SimpleNamespace(quantization=None))
    return Engine(WeightTransferConfig(backend="nccl_m2n"), config, torch.device(device),
                  model), model


def _worker(rank: int, tp: int, opts: dict[str, Any], env: dict[str, str], conn: Any) -> None:
    """A worker process: one vLLM worker's engine, answering RPCs in order."""
    os.environ.update(env)
    if os.environ.get("NCCL_LIBRARY") and not opts["cpu"]:  # before torch and nccl4py load theirs
        ctypes.CDLL(os.environ["NCCL_LIBRARY"], mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    _load_vllm(opts["tree"], opts["cpu"])
    import torch
    device = "cpu" if opts["cpu"] else "cuda:0"
    if not opts["cpu"]:
        torch.cuda.set_device(0)
    if opts["plane"]:  # a stand-in data plane (tests on CPU): MODULE:ARGUMENT
        module, _, argument = opts["plane"].partition(":")
        importlib.import_module(module).install(argument)
    checksum = module_alone("vllm.model_executor.model_loader.weight_checksum")
    compute_tensor_digests, zero_weights = checksum.compute_tensor_digests, checksum.zero_weights
    engine, model = _engine(rank, tp, device)
    prefix = f"dp0:pp0:pcp0:tp{rank}:"

    def update(info: dict) -> None:
        engine.receive_weights(engine.parse_update_info(info))
        if not opts["cpu"]:
            torch.cuda.synchronize()

    calls = {
        "init": lambda info: engine.init_transfer_engine(engine.parse_init_info(info)),
        "start": engine.start_weight_update, "update": update,
        "finish": engine.finish_weight_update, "shutdown": engine.shutdown,
        "checksums": lambda: {prefix + k: v for k, v in compute_tensor_digests(model).items()},
        "reset": lambda: zero_weights(model),
    }
    conn.send(("ready", None))
    while True:
        method, args = conn.recv()
        try:
            conn.send(("ok", calls[method](*args)))
        except Exception as e:  # vLLM wraps a worker's failure as an Exception -> HTTP 500
            conn.send(("err", f"{type(e).__name__}: {e}"))


class _Workers:
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

    def call(self, method: str, *args: Any) -> list[Any]:
        with self.lock:
            for c in self.conns:
                c.send((method, args))
            answers = [c.recv() for c in self.conns]
        errors = [a for status, a in answers if status == "err"]
        if errors:
            raise Exception(f"Call to collective_rpc method failed: {errors[0]}")
        return [a for _, a in answers]


class _Client:
    """vLLM's engine client as the routes call it: the session rules of its
    engine core, each RPC sent to every worker (``_Workers``)."""

    def __init__(self, workers: _Workers, tp: int):
        self.workers = workers
        self.vllm_config = SimpleNamespace(parallel_config=_parallel_config(0, tp))
        self.active, self.version, self.paused = False, "default", False

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await asyncio.to_thread(self.workers.call, method, *args)

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
        try:
            await self._rpc("update", info[0] if isinstance(info, list) else info)
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


def _app(client: Any, log: str) -> Any:
    """vLLM's RL router and exception handlers over ``client``, each request logged."""
    import json
    import time

    from fastapi import FastAPI, Request
    from vllm.entrypoints.rl.online.api_router import router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.state.engine_client = client
    app.state.args = SimpleNamespace(log_error_stack=False)
    init_exception_handler(app)
    app.include_router(router)

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        t0, status = time.time(), 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            with open(log, "a") as f:
                f.write(json.dumps({"t": t0, "path": request.url.path, "status": status}) + "\n")

    return app


def _worker_envs(gpus: list[str]) -> list[dict[str, str]]:
    """Each worker's environment on its GPU (``harness.gpu_env``: with
    ``JAX_SENDER_SHARE_GPUS`` each worker is an NCCL host of its own)."""
    from .harness import gpu_env
    return [gpu_env(g) for g in gpus]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", nargs="?", help="a folder to put first on sys.path: vLLM 0.33.0's "
                    "tree with the shim (see docs/testing.md), when vLLM is not installed")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True, help="file that gets one JSON line per request")
    ap.add_argument("--gpus", default="1,2",
                    help="one GPU per worker (tensor-parallel rank), as harness.gpu_env takes them")
    ap.add_argument("--cpu", action="store_true", help="no GPU: the model on the CPU (with --plane)")
    ap.add_argument("--plane", default="", help="MODULE:ARGUMENT: each worker calls "
                    "MODULE.install(ARGUMENT) first (a stand-in data plane for CPU tests)")
    args = ap.parse_args()
    gpus = args.gpus.split(",")
    _load_vllm(args.tree, cpu=args.cpu)  # the routes: no GPU used in this process
    opts = {"tree": args.tree, "cpu": args.cpu, "plane": args.plane}
    envs = [dict(os.environ) for _ in gpus] if args.cpu else _worker_envs(gpus)
    workers = _Workers(len(gpus), opts, envs)
    import uvicorn
    print("READY", flush=True)
    uvicorn.run(_app(_Client(workers, len(gpus)), args.log), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
