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

import functools
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
        attach(model, name, param)

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
    config = SimpleNamespace(parallel_config=parallel_config(rank, tp),
                             model_config=SimpleNamespace(quantization=None))
    return Engine(WeightTransferConfig(backend="nccl_m2n"), config, torch.device(device),
                  model), model


def worker_calls(rank: int, tp: int, device: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One worker's RPC table (``vllm_workers``): vLLM's M2N engine into the toy model."""
    return rpc_table(*_engine(rank, tp, device), rank, device)


def main() -> None:
    ap = host_parser(__doc__, gpus="1,2")
    args = ap.parse_args()
    gpus = args.gpus.split(",")
    load_vllm(args.tree, cpu=args.cpu)  # the routes: no GPU used in this process
    opts = {"tree": args.tree, "cpu": args.cpu, "plane": args.plane,
            "calls": "jax_sender.testing.vllm_m2n:worker_calls"}
    envs = [dict(os.environ) for _ in gpus] if args.cpu else worker_envs(gpus)
    workers = Workers(len(gpus), opts, envs)
    import uvicorn
    print("READY", flush=True)
    uvicorn.run(app(Client(workers, len(gpus)), args.log), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
