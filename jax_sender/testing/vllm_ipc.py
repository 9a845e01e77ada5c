"""vLLM 0.33.0's real ``ipc`` worker engine in tensor-parallel workers behind
one server's real routes, for tests and the benchmark:
``python -m jax_sender.testing.vllm_ipc [TREE] --port P --log F [--gpus 0,0]``.

The routes and exception handlers are vLLM's own: its RL router, its dev
``/server_info`` (over a real ``VllmConfig`` naming ``--backend``, and this
process's ``VLLM_*`` environment, so ``VLLM_ALLOW_INSECURE_SERIALIZATION``
is what the server says it is) and its sleep routes (``/sleep``,
``/wake_up``, ``/is_sleeping``). Each worker process (one per ``--gpus``
entry; two on one GPU share it, as tensor-parallel ranks on one device
would) runs vLLM's ``IPCWeightTransferEngine``: the pickle behind vLLM's
flag, the packed importer, ``rebuild_cuda_tensor``, the ref-counter
release, the load. The model stands in for vLLM's layerwise reload: it
holds every tensor it is given (the views into the trainer's memory, when
unpacked) until ``/finish_weight_update``, then keeps a copy of each as a
parameter, which vLLM's ``/weight_checker`` digests. ``--fail-load-after N``
makes a worker's load fail once, at its (N+1)-th tensor.
Start skips vLLM's layerwise reload (it needs a real model); finish keeps
vLLM's own release of the packed mapping. Needs torch and vLLM's tree.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

from .vllm_workers import (
    Client,
    Workers,
    app,
    attach,
    host_parser,
    load_vllm,
    parallel_config,
    rpc_table,
    worker_envs,
)


def _model(device: str, fail_after: int) -> Any:
    """A model that holds what it loads until ``commit`` (finish), then keeps copies."""
    import torch

    model = torch.nn.Module()
    held: list[tuple[str, Any]] = []
    loads = [0]

    def load_weights(pairs: Any) -> set[str]:
        for name, tensor in pairs:
            loads[0] += 1
            if loads[0] == fail_after + 1:  # once: the server takes the next push
                raise RuntimeError(f"loading {name!r} failed (a fault of this test server)")
            held.append((name, tensor))
        return {name for name, _ in held}

    def commit() -> None:
        params = dict(model.named_parameters())
        for name, tensor in held:
            if name in params and params[name].shape == tensor.shape \
                    and params[name].dtype == tensor.dtype:
                params[name].data.copy_(tensor)
            else:
                attach(model, name, torch.nn.Parameter(tensor.detach().to(device, copy=True),
                                                       requires_grad=False))
        held.clear()

    model.load_weights = load_weights
    model.commit = commit
    return model


def worker_calls(rank: int, tp: int, device: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One worker's RPC table (``vllm_workers``): vLLM's IPC engine into the model."""
    import torch
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    model = _model(device, opts["fail_load_after"])

    class Engine(IPCWeightTransferEngine):
        def start_weight_update(self) -> None:  # vLLM runs layerwise reload here
            pass

        def finish_weight_update(self) -> None:  # vLLM finalizes the reload, then releases
            model.commit()
            if device != "cpu":
                torch.cuda.synchronize()
            self._packed_importer.close()

    Engine.__name__ = Engine.__qualname__ = "IPCWeightTransferEngine"
    config = SimpleNamespace(parallel_config=parallel_config(rank, tp), model_config=None)
    engine = Engine(WeightTransferConfig(backend="ipc"), config, torch.device(device), model)
    return rpc_table(engine, model, rank, device)


def _routes(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """vLLM's dev routers this server adds, and the config ``/server_info`` shows."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.entrypoints.serve.dev.server_info.api_router import router as info
    from vllm.entrypoints.serve.dev.sleep.api_router import router as sleep
    config = VllmConfig(device_config=DeviceConfig(device="cpu"),  # this process's: no GPU
                        weight_transfer_config=WeightTransferConfig(backend=args.backend))
    return [info, sleep], config


def main() -> None:
    ap = host_parser(__doc__, gpus="0,0")
    ap.add_argument("--backend", default="ipc", help="the backend /server_info names")
    ap.add_argument("--fail-load-after", type=int, default=-1)
    args = ap.parse_args()
    gpus = args.gpus.split(",")
    load_vllm(args.tree, cpu=args.cpu)
    opts = {"tree": args.tree, "cpu": args.cpu, "plane": args.plane,
            "fail_load_after": args.fail_load_after,
            "calls": "jax_sender.testing.vllm_ipc:worker_calls"}
    envs = [dict(os.environ, CUDA_VISIBLE_DEVICES=g) for g in gpus] if args.cpu \
        else worker_envs(gpus)  # on CPU, the GPU a stand-in plane gives the worker
    workers = Workers(len(gpus), opts, envs)
    routers, config = _routes(args)
    server = app(Client(workers, len(gpus)), args.log, *routers)
    server.state.vllm_config = config
    import uvicorn
    print("READY", flush=True)
    uvicorn.run(server, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
