"""The bench's roles on vLLM's torch side: vLLM 0.33.0's own trainer engine
(``NCCLTrainerWeightTransferEngine``) and communicator, the baselines our
sender is measured against, in child processes (see ``procs.py``).

Why apart from ``roles.py``: these import torch and vLLM's tree (``.vllm/``,
which the parent puts on the child's ``PYTHONPATH``: ``procs.vllm_env``),
and need its ``shim`` loaded before any vLLM import that touches NCCL.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from procs import emit, given_ids
from roles import INIT_ROUND_S, at, pushes, send_config, train_loop, trainer, workload_pairs
from rows import TorchRow, TrainRow
from workloads import GiB, Job, workload


def load_vllm() -> None:
    """Make vLLM's NCCL code usable here (its tree's ``shim``); before any vLLM import."""
    import shim
    shim.load()


def torch_pairs(name: str) -> list[tuple[str, Any]]:
    """Workload ``name`` as (name, random bfloat16 torch tensor on the GPU) pairs."""
    import torch
    return [(n, torch.randn(s, dtype=torch.bfloat16, device="cuda")) for n, s in workload(name)]


def role_init_vllm(rank: str, start: str) -> None:
    """vLLM's ``PyNcclCommunicator.from_unique_id_bytes`` with each given id,
    one round a second from ``start`` (``roles.role_init_ours``'s rounds)."""
    load_vllm()
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    torch.cuda.set_device(0)
    times = []
    for i, uid in enumerate(given_ids()):
        at(float(start) + INIT_ROUND_S * i)
        t = time.perf_counter()
        comm = PyNcclCommunicator.from_unique_id_bytes(base64.b64decode(uid), int(rank), 2, 0)
        times.append(time.perf_counter() - t)
        comm.destroy()
    emit(times)


class TimedClient:
    """vLLM's client protocol over our HTTP client, timing each update call."""

    def __init__(self, url: str):
        from uniqueid import VLLMClient
        self.http = VLLMClient(url)
        self.spans: list[float] = []  # /update_weights
        self.starts: list[float] = []
        self.finishes: list[float] = []

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.http.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        t = time.perf_counter()
        self.http.start_weight_update()
        self.starts.append(time.perf_counter() - t)

    def update_weights(self, update_info: Any) -> None:
        t = time.perf_counter()
        self.http.update_weights(update_info)
        self.spans.append(time.perf_counter() - t)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        t = time.perf_counter()
        self.http.finish_weight_update(weight_version)
        self.finishes.append(time.perf_counter() - t)


def torch_engine(url: str, pairs: list, packed: bool, buffer: int, nbuf: int,
                 client: Any = None) -> tuple[Any, Any, Any]:
    """vLLM 0.33.0's own trainer engine (torch) joined to the server at ``url``.

    Args:
        url: the server.
        pairs: its source, (name, torch tensor) pairs; replace ``source.pairs``
            to push others of the same names, shapes and dtypes.
        packed, buffer, nbuf: its geometry.
        client: vLLM's client protocol to use; default a ``TimedClient``.

    Returns:
        (engine, client, source).
    """
    from functools import cached_property

    load_vllm()
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from jax_sender.testing.harness import free_port

    class Source(WeightSource):
        def __init__(self, pairs):
            self.pairs = pairs

        @cached_property  # vLLM requires it: its engines read it repeatedly
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

        def iter_full(self):
            yield from self.pairs

    client, source = client or TimedClient(url), Source(pairs)
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                            world_size=2, packed=packed, packed_buffer_size_bytes=buffer,
                            packed_num_buffers=nbuf),
        client=client, source=source)
    return engine, client, source


def role_train_torch(url: str, steps: str) -> None:
    """The same training loop pushing with vLLM's own torch sender, as a JAX
    trainer that imports torch would: the LLAMA names and transforms in one
    jitted call, the results handed to torch by DLPack (no copy), then the
    engine's blocking ``send_weights()`` (packed, 1 GiB x 2)."""
    import jax

    from jax_sender import LLAMA, named_arrays
    params, step, tokens = trainer()
    load_vllm()
    import torch
    torch.cuda.set_device(0)
    names = [(name, path) for name, path, _ in named_arrays(params, LLAMA)]
    transform = jax.jit(lambda xs: [LLAMA.transform(path, x) for (_, path), x in zip(names, xs)])

    def to_torch(p) -> list:
        out = jax.block_until_ready(transform([a for _, _, a in named_arrays(p, LLAMA)]))
        return [(name, torch.from_dlpack(x)) for (name, _), x in zip(names, out)]

    engine, client, source = torch_engine(url, to_torch(params), True, GiB, 2)
    assert source.metadata  # read once, from these pairs; the buffers may go now
    source.pairs = []

    def push(p) -> None:
        source.pairs = to_torch(p)
        engine.send_weights()
        source.pairs = []  # the trainer may donate these buffers now

    n = int(steps)
    params, walls, blocked, _ = train_loop(params, step, tokens, n, push)
    engine.shutdown()
    client.http.shutdown_weight_transfer_engine()
    emit(TrainRow(mode="torch", step=walls, blocked=blocked, transfer=client.spans[-n:],
                  bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
                  tensors=len(names)).to_json())


def role_torch(url: str, jobs: str) -> None:
    """vLLM 0.33.0's own trainer engine (torch), same workloads, same server."""
    load_vllm()
    import torch
    torch.cuda.set_device(0)
    pairs, current = None, None
    for job in map(Job.from_json, json.loads(jobs)):
        if job.workload != current:
            pairs = None
            torch.cuda.empty_cache()
            pairs = torch_pairs(job.workload)
            current = job.workload
        emit(torch_pushes(url, pairs, job).to_json())


def torch_pushes(url: str, pairs: list, job: Job, shipped: bool = False) -> TorchRow:
    """vLLM's torch engine joined to the server for ``job``: ``job.reps`` timed
    ``send_weights()`` after one warm-up, and their figures; then shut down.

    Args:
        url: the server.
        pairs: (name, torch tensor) pairs.
        job: what is measured.
        shipped: over vLLM's own HTTP client (``HTTPVLLMWeightSyncClient``:
            ``requests``, a new connection per call), as a torch user runs it,
            which times no call; else over ours, which times each.
    """
    shipped_client = None
    if shipped:
        load_vllm()
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        shipped_client = HTTPVLLMWeightSyncClient(url)
    engine, client, _ = torch_engine(url, pairs, job.mode == "packed", job.buffer, job.nbuf,
                                     shipped_client)
    totals = []
    for _ in range(job.reps + 1):
        t = time.perf_counter()
        engine.send_weights()
        totals.append(time.perf_counter() - t)
    engine.shutdown()
    (client if shipped else client.http).shutdown_weight_transfer_engine()
    out = TorchRow(job=job, total=totals[1:], wall=totals[1:], tensors=len(pairs),
                   bytes=sum(t.numel() * t.element_size() for _, t in pairs))
    if not shipped:
        out.transfer, out.start, out.finish = client.spans[1:], client.starts[1:], client.finishes[1:]
    return out


def role_fixed(url: str, blocks: str, job: str, with_torch: str) -> None:
    """The 4 KiB push (``job``), ours and vLLM's torch engine's taking turns in
    this one process, ``blocks`` blocks each (a new connection per block: the
    server holds one engine at a time). Torch's engine runs twice a block:
    over our HTTP client (the senders' own work compared) and over vLLM's
    (what a torch user pays). Emits ``{"sender": who, "row": row}`` per block
    and sender (ours, torch, shipped)."""
    import jax

    from jax_sender import WeightSender
    dev = jax.devices()[0]
    fixed = Job.from_json(json.loads(job))
    pairs = workload_pairs(fixed.workload)
    if with_torch == "1":
        load_vllm()
        import torch
        torch.cuda.set_device(0)
        tensors = torch_pairs(fixed.workload)
    for _ in range(int(blocks)):
        with WeightSender.connect(url, config=send_config(fixed)) as sender:
            emit({"sender": "ours", "row": pushes(sender, pairs, fixed, dev).to_json()})
        if with_torch == "1":
            emit({"sender": "torch", "row": torch_pushes(url, tensors, fixed).to_json()})
            emit({"sender": "shipped",
                  "row": torch_pushes(url, tensors, fixed, True).to_json()})
