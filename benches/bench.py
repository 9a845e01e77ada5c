"""Weight-push throughput, latency and memory, next to baselines measured in the same run.

    python benches/bench.py [--reps 5] [--quick] [--only dense|servers|sparse|slow|train]
    python benches/bench.py --plot results/bench.json  # redraw the plot elsewhere

GPU 0 is the trainer, GPU 1 the receiver. Rows:

- raw ``ncclBroadcast`` of one pre-allocated 1 GiB buffer through this
  project's binding, 10 back to back per repetition (algbw): the baseline;
- init + warm-up without HTTP: ``uniqueid.handshake`` against vLLM's
  ``PyNcclCommunicator.from_unique_id_bytes`` (both ranks start together);
- ``send`` of the workloads into vLLM 0.33.0's own consumer
  (``.vllm/server.py --nccl``), packed and unpacked, next to vLLM's own torch
  sender (``NCCLTrainerWeightTransferEngine``) pushing the same tensors into
  the same server; a buffer-size sweep; ``many-small``; ``large``;
- with 4 GPUs: a 4-rank raw broadcast, and ``qwen3-8b`` into three servers
  (GPUs 1-3) by one broadcast, against one push per server in turn;
- ``SparseSender.send`` of ``qwen3-8b`` with 1%, 10% and 50% of the elements
  changed into vLLM's own ``sparse_nccl`` engine (``jax_sender.testing.vllm_sparse``),
  next to the dense sends above;
- a push's fixed cost: one 4 KiB tensor, the whole ``send()`` against vLLM's
  torch engine's ``send_weights()`` (both: start, update, finish), the two
  senders taking turns in blocks;
- a slow link (``--only slow``): both ends forced onto NCCL's socket
  transport over loopback, four qwen3-8b layers, a dense push against
  ``SparseSender.send`` at 1% and 10% changed;
- a training loop (``--only train``): a Flax decoder's step on GPU 0
  (forward, backward, SGD, parameters donated) pushing to the server after
  every step: no push, the blocking push, ``send(wait=False)``; a raw
  broadcast of the same bytes launched beside each step (no push thread,
  no HTTP, no snapshot), which is what the broadcast alone costs the step;
  with ``--max-ctas N ...``, again with NCCL's CTAs capped at N on every rank.

Send time: the ``/update_weights`` call (the broadcasts start at once) to
its answer, i.e. every worker holding every tensor, timed inside the thread
that makes it, for both senders; ``broadcast`` is the sender's own
first-launch-to-last-done span.
Each row: median and best of ``--reps`` after one warm-up. Writes
``results/bench.md``, ``results/bench.json`` and, with matplotlib,
``results/bench.png``. Without ``.vllm/`` the sends go to the reference
receiver and the torch rows are left out.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from jax_sender.testing.harness import SHARE_GPUS, gpu_count, gpu_env, run_all  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
IDS = "JAX_SENDER_BENCH_IDS"
OUT = ROOT / "results"


# -- workloads: (name, shape), all bfloat16 ---------------------------------------

def _layer(n: int) -> list[tuple[str, tuple[int, ...]]]:
    h, i, hd, nq, nkv = 4096, 12288, 128, 32, 8
    p = f"model.layers.{n}."
    return [(p + "self_attn.q_proj.weight", (nq * hd, h)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, nq * hd)),
            (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]


def workload(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """``qwen3-8b`` (~16.4 GB), ``many-small`` (20,000 x 32 KiB), ``large`` (~70 GB),
    ``tiny`` (one 4 KiB tensor), ``layers4`` (four qwen3-8b layers, ~1.6 GB)."""
    if name == "qwen3-8b":
        v, h = 151936, 4096
        body = [t for n in range(36) for t in _layer(n)]
        return ([("model.embed_tokens.weight", (v, h))] + body
                + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))])
    if name == "many-small":
        return [(f"model.experts.{i}.w", (16384,)) for i in range(20000)]
    if name == "tiny":  # one 4 KiB tensor: a push's fixed cost
        return [("model.norm.weight", (2048,))]
    if name == "layers4":  # ~1.6 GB: four qwen3-8b layers, for the slow link
        return [t for n in range(4) for t in _layer(n)]
    if name == "large":
        per_layer = sum(math.prod(s) * 2 for _, s in _layer(0))
        return [t for n in range(round(70e9 / per_layer)) for t in _layer(n)]
    raise ValueError(name)


def _vllm_path() -> None:
    sys.path.insert(0, str(ROOT / ".vllm"))
    import shim
    shim.load()


def _emit(obj) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


# -- child roles (one GPU each) -------------------------------------------------

def role_raw(rank: str, world: str, reps: str) -> None:
    import jax.numpy as jnp

    from nccl_cffi import Communicator, cuda
    from uniqueid import UniqueId, warm_up
    comm = Communicator.init_rank(int(world), UniqueId.from_b64(_ids()).raw, int(rank), 0,
                                  blocking=True, timeout=120, then=warm_up)
    buf = jnp.zeros((GiB,), jnp.uint8).block_until_ready()
    stream = cuda.Stream(0)
    times = []
    for _ in range(int(reps) + 2):
        t = time.perf_counter()
        for _ in range(10):
            comm.broadcast(buf, root=0, stream=stream)
        comm.wait(stream, 60)
        times.append((time.perf_counter() - t) / 10)
    _emit(times[2:])
    comm.destroy()


def _at(start: float) -> None:
    time.sleep(max(start - time.time(), 0.0))


def role_init_ours(rank: str, start: str) -> None:
    from uniqueid import UniqueId, handshake
    times = []
    for i, uid in enumerate(_ids()):
        _at(float(start) + 1.0 * i)
        t = time.perf_counter()
        comm = handshake(2, UniqueId.from_b64(uid), int(rank), 0, timeout=60)
        times.append(time.perf_counter() - t)
        comm.destroy()
    _emit(times)


def role_init_vllm(rank: str, start: str) -> None:
    _vllm_path()
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    torch.cuda.set_device(0)
    times = []
    for i, uid in enumerate(_ids()):
        _at(float(start) + 1.0 * i)
        t = time.perf_counter()
        comm = PyNcclCommunicator.from_unique_id_bytes(base64.b64decode(uid), int(rank), 2, 0)
        times.append(time.perf_counter() - t)
        comm.destroy()
    _emit(times)


def _workload_pairs(name: str) -> list:
    import jax
    import jax.numpy as jnp
    spec = workload(name)
    keys = jax.random.split(jax.random.PRNGKey(0), len(spec))
    pairs = [(n, jax.random.normal(k, s, jnp.bfloat16)) for (n, s), k in zip(spec, keys)]
    jax.block_until_ready([a for _, a in pairs])
    return pairs


def _torch_pairs(name: str) -> list:
    """Workload ``name`` as (name, random bfloat16 torch tensor on the GPU) pairs."""
    import torch
    return [(n, torch.randn(s, dtype=torch.bfloat16, device="cuda")) for n, s in workload(name)]


def role_seq(urls: str, jobs: str) -> None:
    """One sender per server, pushing to them one after another (the baseline
    for one broadcast feeding every server)."""
    from jax_sender import WeightSender
    for job in json.loads(jobs):
        pairs = _workload_pairs(job["workload"])
        senders = [WeightSender.connect(u, config=_config(job)) for u in json.loads(urls)]
        transfer, total = [], []
        for _ in range(job["reps"] + 1):
            t = time.perf_counter()
            stats = [s.send(pairs) for s in senders]
            total.append(time.perf_counter() - t)
            transfer.append(sum(x.transfer_s for x in stats))
        for s in senders:
            s.close()
        _emit(dict(job, transfer=transfer[1:], total=total[1:], bytes=stats[0].bytes,
                   tensors=stats[0].tensors))


# A floor's mode, and the mode of the pushes it bounds.
FLOORS = {"prepacked": "packed", "preplaced": "unpacked"}


def _config(job: dict):
    from jax_sender import SendConfig
    return SendConfig(packed=FLOORS.get(job["mode"], job["mode"]) == "packed",
                      buffer_size_bytes=job["buffer"], num_buffers=job["nbuf"])


def _floor_sender(url: str, config):
    """A sender that does no work of its own: packed, each chunk is broadcast
    from one staging buffer as it is, with no copies; unpacked, each tensor
    from that buffer, in its own dtype; the arrays are never read. Its push
    is what vLLM's consumer takes when the sender costs nothing but its
    launches, a floor for any sender; the workers load garbage."""
    import jax

    from jax_sender import WeightSender
    from jax_sender.packer import UINT8, Broadcaster
    from jax_sender.routes import SingleProcess
    from nccl_cffi.dtypes import NCCL_TYPES
    from uniqueid import as_clients

    class Floor(Broadcaster):
        def packed(self, metas, chunks, get, root, *, timeout, check, temporaries=True):
            self._begin()
            self.arena.ensure(max(c.nbytes for c in chunks))
            for c in chunks:
                self._window(self.num_buffers, timeout, check)
                self._launch(self.arena.ptr, c.nbytes, UINT8, root, c.nbytes, [], timeout,
                             check)
            self.drain(timeout, check)

        def unpacked(self, metas, get, root, *, timeout, check):
            self._begin()
            self.arena.ensure(max(m.nbytes for m in metas))
            for m in metas:  # the window of Broadcaster.unpacked
                self._window(max(self.num_buffers, 8), timeout, check)
                self._launch(self.arena.ptr, m.numel, NCCL_TYPES[m.dtype][0], root, m.nbytes,
                             [], timeout, check)
            self.drain(timeout, check)

    dev = jax.devices()[0]
    route = SingleProcess(as_clients(url), dev.local_hardware_id, config)
    return WeightSender(route.form(config.init_timeout_s), route, config=config, device=dev,
                        broadcaster=lambda conn: Floor(conn.comm, dev, config.buffer_size_bytes,
                                                       config.num_buffers))


def role_jax(url: str, jobs: str) -> None:
    """Our sender, one process for every job (a job: workload, mode, buffer
    geometry). ``url``: one server, or a JSON list of servers fed by one broadcast."""
    import jax

    from jax_sender import WeightSender
    dev = jax.devices()[0]
    sender, pairs, current, geometry = None, None, None, None
    servers = json.loads(url) if url.startswith("[") else url
    for job in json.loads(jobs):
        if job["workload"] != current:
            pairs = None  # free the previous workload first
            pairs = _workload_pairs(job["workload"])
            current = job["workload"]
        if (job["mode"], _config(job)) != geometry:  # a new group (and frees the slots)
            if sender is not None:
                sender.close()
            geometry = (job["mode"], _config(job))
            sender = (_floor_sender(servers, geometry[1]) if job["mode"] in FLOORS
                      else WeightSender.connect(servers, config=geometry[1]))
        _emit(dict(job, **_pushes(sender, pairs, job["reps"], dev)))
    sender.close()


def _pushes(sender, pairs: list, reps: int, dev) -> dict:
    """``reps`` timed pushes of ``pairs`` after one warm-up, and their figures."""
    base = dev.memory_stats()["bytes_in_use"]
    stats, wall = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        stats.append(sender.send(pairs))
        wall.append(time.perf_counter() - t)
    stats, wall = stats[1:], wall[1:]
    s = stats[0]
    return dict(transfer=[x.transfer_s for x in stats], update=[x.update_s for x in stats],
                broadcast=[x.broadcast_s for x in stats], total=[x.total_s for x in stats],
                prepare=[x.prepare_s for x in stats], host=[x.host_s for x in stats],
                start=[x.start_s for x in stats], finish=[x.finish_s for x in stats],
                link=[x.link_s for x in stats], link_bytes=s.link_bytes,
                wall=wall, bytes=s.bytes, tensors=s.tensors,
                chunks=s.chunks, largest=max(a.nbytes for _, a in pairs),
                held=dev.memory_stats()["bytes_in_use"] - base,
                # the process-wide peak: meaningful for the first job only
                peak=dev.memory_stats()["peak_bytes_in_use"] - base)


def role_sparse(url: str, fractions: str, reps: str, name: str = "qwen3-8b") -> None:
    """``SparseSender.send`` of workload ``name`` with a fraction of each tensor's elements changed."""
    import jax
    import jax.numpy as jnp

    from jax_sender import SparseSender
    old = _workload_pairs(name)
    keys = jax.random.split(jax.random.PRNGKey(0), len(old))  # the keys behind the values
    sender = SparseSender.connect(url)
    bump = jax.jit(lambda a, k, f: jnp.where(jax.random.uniform(k, a.shape) < f, a + 1, a))
    for f in json.loads(fractions):
        new = None  # free the previous fraction's copy first
        new = [(n, bump(a, k, f)) for (n, a), k in zip(old, keys)]
        stats = [sender.send(new, old) for _ in range(int(reps) + 1)][1:]
        _emit(dict(fraction=f, transfer=[x.transfer_s for x in stats],
                   total=[x.total_s for x in stats], prepare=[x.prepare_s for x in stats],
                   broadcast=[x.broadcast_s for x in stats], host=[x.host_s for x in stats],
                   bytes=stats[0].bytes, dense=sum(a.nbytes for _, a in new),
                   tensors=stats[0].tensors))
    sender.close()


def _trainer():
    """A Flax decoder's training step (forward, backward, SGD; the old
    parameters donated), its parameters and a batch: the same in every process."""
    import functools

    import jax
    import jax.numpy as jnp

    from jax_sender.demo.model import Config, Decoder, init_params
    cfg = Config(vocab=32000, hidden=2048, intermediate=5632, layers=8, heads=16, kv_heads=4,
                 head_dim=128)
    model = Decoder(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 513), 0, cfg.vocab)

    def loss(p, t):
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(p, t):
        value, grads = jax.value_and_grad(loss)(p, t)
        return jax.tree_util.tree_map(lambda a, g: (a - 1e-4 * g).astype(a.dtype), p, grads), value

    return init_params(cfg), step, tokens


def _train_loop(params, step, tokens, n: int, push) -> tuple[list[float], list[float], list]:
    """``n + 2`` steps, ``push(params)`` after each; per step (the first two
    dropped): its wall time, the time ``push`` held the trainer, what it returned."""
    walls, blocked, pushes = [], [], []
    for _i in range(n + 2):
        t = time.perf_counter()
        params, value = step(params, tokens)
        value.block_until_ready()
        if push is not None:
            s0 = time.perf_counter()
            pushes.append(push(params))
            blocked.append(time.perf_counter() - s0)
        walls.append(time.perf_counter() - t)
    return params, walls[2:], blocked[2:], pushes[2:]


def role_train(url: str, steps: str) -> None:
    """The training step on GPU 0 pushing to the server after every step: no
    push, the blocking push, the asynchronous push, and the asynchronous
    push's snapshot alone (the same copies, no broadcast), which splits what
    it adds to a step into the copy and the broadcast beside the step."""
    import jax

    from jax_sender import LLAMA, WeightSender
    params, step, tokens = _trainer()
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    sender = WeightSender.connect(url, mapping=LLAMA)
    n = int(steps)
    held = []

    def snapshot(p) -> None:
        """What ``send(wait=False)`` dispatches before it returns, and nothing
        else; kept until the next one, as a push in flight keeps its own."""
        metas, sources = sender.prepare(p)
        held[:] = [sender._snapshot(metas, sources, sender._turns_of(metas, sources)[0])]

    pushes = {"none": None, "blocking": lambda p: sender.send(p),
              "async": lambda p: sender.send(p, wait=False), "snapshot": snapshot}
    for mode in ("none", "blocking", "async", "snapshot", "none"):
        params, walls, blocked, out = _train_loop(params, step, tokens, n, pushes[mode])
        stats = ([p.result() for p in out] if mode == "async" else out if mode == "blocking"
                 else [])
        _emit(dict(mode=mode, step=walls, blocked=blocked,
                   transfer=[x.transfer_s for x in stats], bytes=nbytes,
                   tensors=len(jax.tree_util.tree_leaves(params))))
    sender.close()


def role_beside(rank: str, steps: str) -> None:
    """Rank 0: the training loop without a push, then with one raw broadcast
    of the parameters' bytes launched right after every step, so it runs
    beside the next one: no push thread, no HTTP, no snapshot, only what the
    broadcast's SMs and memory traffic cost the step. Rank 1 receives them."""
    import jax
    import jax.numpy as jnp

    from nccl_cffi import Communicator, cuda
    from uniqueid import UniqueId, warm_up
    comm = Communicator.init_rank(2, UniqueId.from_b64(_ids()).raw, int(rank), 0,
                                  blocking=True, timeout=120, then=warm_up)
    stream = cuda.Stream(0)
    n = int(steps)
    params, step, tokens = _trainer()
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    buf = jnp.zeros((nbytes,), jnp.uint8).block_until_ready()
    if rank == "1":
        for _ in range(n + 2):
            comm.broadcast(buf, root=0, stream=stream)
        comm.wait(stream, 120)
        _emit({})
    else:
        params, none, _, _ = _train_loop(params, step, tokens, n, None)
        params, walls, blocked, _ = _train_loop(
            params, step, tokens, n, lambda p: comm.broadcast(buf, root=0, stream=stream))
        comm.wait(stream, 120)
        _emit(dict(mode="beside", step=walls, none=none, blocked=blocked, transfer=[],
                   bytes=nbytes, tensors=len(jax.tree_util.tree_leaves(params))))
    comm.destroy()


def role_train_torch(url: str, steps: str) -> None:
    """The same training loop pushing with vLLM's own torch sender, as a JAX
    trainer that imports torch would: the LLAMA names and transforms in one
    jitted call, the results handed to torch by DLPack (no copy), then the
    engine's blocking ``send_weights()`` (packed, 1 GiB x 2)."""
    import jax

    from jax_sender import LLAMA, named_arrays
    params, step, tokens = _trainer()
    _vllm_path()
    import torch
    torch.cuda.set_device(0)
    names = [(name, path) for name, path, _ in named_arrays(params, LLAMA)]
    transform = jax.jit(lambda xs: [LLAMA.transform(path, x) for (_, path), x in zip(names, xs)])

    def torch_pairs(p) -> list:
        out = jax.block_until_ready(transform([a for _, _, a in named_arrays(p, LLAMA)]))
        return [(name, torch.from_dlpack(x)) for (name, _), x in zip(names, out)]

    engine, client, source = _torch_engine(url, torch_pairs(params), True, GiB, 2)
    assert source.metadata  # read once, from these pairs; the buffers may go now
    source.pairs = []

    def push(p) -> None:
        source.pairs = torch_pairs(p)
        engine.send_weights()
        source.pairs = []  # the trainer may donate these buffers now

    n = int(steps)
    params, walls, blocked, _ = _train_loop(params, step, tokens, n, push)
    engine.shutdown()
    client.http.shutdown_weight_transfer_engine()
    _emit(dict(mode="torch", step=walls, blocked=blocked, transfer=client.spans[-n:],
               bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
               tensors=len(names)))


def _torch_engine(url: str, pairs: list, packed: bool, buffer: int, nbuf: int,
                  client: Any = None):
    """vLLM 0.33.0's own trainer engine (torch) joined to the server at ``url``,
    its source ``pairs`` of (name, torch tensor) (replace ``source.pairs`` to
    push others of the same names, shapes and dtypes), and its HTTP client:
    ``client``, or ours timing its calls."""
    from functools import cached_property

    _vllm_path()
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from jax_sender.testing.harness import free_port
    from uniqueid import VLLMClient

    class Source(WeightSource):
        def __init__(self, pairs):
            self.pairs = pairs

        @cached_property  # vLLM requires it: its engines read it repeatedly
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

        def iter_full(self):
            yield from self.pairs

    class TimedClient:
        """vLLM's client protocol over our HTTP client, timing ``update_weights``."""

        def __init__(self):
            self.http = VLLMClient(url)
            self.spans: list[float] = []
            self.starts: list[float] = []
            self.finishes: list[float] = []

        def init_weight_transfer_engine(self, init_info):
            self.http.init_weight_transfer_engine(init_info)

        def start_weight_update(self):
            t = time.perf_counter()
            self.http.start_weight_update()
            self.starts.append(time.perf_counter() - t)

        def update_weights(self, update_info):
            t = time.perf_counter()
            self.http.update_weights(update_info)
            self.spans.append(time.perf_counter() - t)

        def finish_weight_update(self, weight_version=None):
            t = time.perf_counter()
            self.http.finish_weight_update(weight_version)
            self.finishes.append(time.perf_counter() - t)

    client, source = client or TimedClient(), Source(pairs)
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                            world_size=2, packed=packed, packed_buffer_size_bytes=buffer,
                            packed_num_buffers=nbuf),
        client=client, source=source)
    return engine, client, source


def role_torch(url: str, jobs: str) -> None:
    """vLLM 0.33.0's own trainer engine (torch), same workloads, same server."""
    _vllm_path()
    import torch
    torch.cuda.set_device(0)
    pairs, current = None, None
    for job in json.loads(jobs):
        if job["workload"] != current:
            pairs = None
            torch.cuda.empty_cache()
            pairs = _torch_pairs(job["workload"])
            current = job["workload"]
        _emit(dict(job, **_torch_pushes(url, pairs, job)))


def _torch_pushes(url: str, pairs: list, job: dict, shipped: bool = False) -> dict:
    """vLLM's torch engine joined to the server for ``job``: ``reps`` timed
    ``send_weights()`` after one warm-up, and their figures; then shut down.
    Over our HTTP client, which times each call; ``shipped``: over vLLM's
    own (``HTTPVLLMWeightSyncClient``: ``requests``, a new connection per
    call), as a torch user runs it."""
    shipped_client = None
    if shipped:
        _vllm_path()
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        shipped_client = HTTPVLLMWeightSyncClient(url)
    engine, client, _ = _torch_engine(url, pairs, job["mode"] == "packed", job["buffer"],
                                      job["nbuf"], shipped_client)
    totals = []
    for _ in range(job["reps"] + 1):
        t = time.perf_counter()
        engine.send_weights()
        totals.append(time.perf_counter() - t)
    engine.shutdown()
    (client if shipped else client.http).shutdown_weight_transfer_engine()
    out = dict(total=totals[1:], wall=totals[1:], tensors=len(pairs),
               bytes=sum(t.numel() * t.element_size() for _, t in pairs))
    if not shipped:
        out.update(transfer=client.spans[1:], start=client.starts[1:],
                   finish=client.finishes[1:])
    return out


def role_fixed(url: str, blocks: str, job: str, with_torch: str) -> None:
    """The 4 KiB push (``job``), ours and vLLM's torch engine's taking turns in
    this one process, ``blocks`` blocks each (a new connection per block: the
    server holds one engine at a time). Torch's engine runs twice a block:
    over our HTTP client (the senders' own work compared) and over vLLM's
    (what a torch user pays)."""
    import jax

    from jax_sender import WeightSender
    dev = jax.devices()[0]
    job = json.loads(job)
    pairs = _workload_pairs(job["workload"])
    if with_torch == "1":
        _vllm_path()
        import torch
        torch.cuda.set_device(0)
        tensors = _torch_pairs(job["workload"])
    for _ in range(int(blocks)):
        with WeightSender.connect(url, config=_config(job)) as sender:
            _emit(dict(job, sender="ours", **_pushes(sender, pairs, job["reps"], dev)))
        if with_torch == "1":
            _emit(dict(job, sender="torch", **_torch_pushes(url, tensors, job)))
            _emit(dict(job, sender="shipped", **_torch_pushes(url, tensors, job, True)))


# -- orchestration -------------------------------------------------------------

def _results(out: str, err: str = "") -> list:
    found = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise RuntimeError(f"no result:\n{out[-2000:]}\n{err[-4000:]}")
    return found


def _ids():
    """The unique ids a rank was given: in its environment, never on a command
    line (a failing rank's error shows its arguments, and an id is a credential)."""
    return json.loads(os.environ[IDS])


def _ranks(role: str, n: int, *args: str, ids=None, timeout: float = 300,
           script: str = __file__) -> list:
    """Run ``script``'s ``role`` as ranks 0..n-1 (GPUs 0..n-1) with the unique
    ids ``ids`` (see ``_ids``); each rank's results."""
    procs = [subprocess.Popen([sys.executable, script, role, str(r), *args],
                              env=dict(gpu_env(str(r)), **{IDS: json.dumps(ids)}),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    return [_results(out) for out in run_all(procs, timeout, expect="RESULT ")]


def _one(role: str, *args: str, timeout: float = 580) -> list:
    p = subprocess.run([sys.executable, __file__, role, *args], env=gpu_env("0"),
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-5000:], file=sys.stderr)
    return _results(p.stdout, p.stderr)


def _uid() -> str:
    from uniqueid import UniqueId
    return UniqueId.mint().to_b64()


def _init_latency(reps: int, vllm: bool) -> dict[str, list[float]]:
    """Both ranks start each round at the same wall-clock instant; a round
    takes as long as its slower rank. Round 0 (library load, CUDA context) is
    dropped. Rounds are short, so there are four times ``reps`` of them."""
    reps *= 4
    out = {}
    roles = [("ours", "role_init_ours")] + ([("vllm", "role_init_vllm")] if vllm else [])
    for label, role in roles:
        start = str(time.time() + (25 if label == "vllm" else 10))  # imports first
        ranks = _ranks(role, 2, start, ids=[_uid() for _ in range(reps + 1)],
                       timeout=120 + reps)
        out[label] = [max(a, b) for a, b in zip(ranks[0][0], ranks[1][0])][1:]
    return out


def _job(workload_: str, mode: str, reps: int, buffer: int = GiB, nbuf: int = 2) -> dict:
    return dict(workload=workload_, mode=mode, buffer=buffer, nbuf=nbuf, reps=reps)


SPARSE_FRACTIONS = [0.01, 0.1, 0.5]
SLOW_FRACTIONS = [0.01, 0.1]
# Both ends on NCCL's socket transport over loopback: a slow link between
# trainer and servers, the case sparse updates exist for.
SLOW_LINK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
             "NCCL_SOCKET_IFNAME": "lo"}
STAGES = ("dense", "servers", "sparse", "slow", "train")
FIXED_BLOCKS = 10  # the 4 KiB row: ours and torch's in turns


@contextlib.contextmanager
def _environment(extra: dict[str, str]):
    """``extra`` in this process's environment, which every child inherits."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def need_gpus(n: int) -> None:
    """Exit with one sentence where there are fewer than ``n`` GPUs."""
    found = gpu_count()
    if found < n:
        sys.exit(f"this benchmark needs {n} NVIDIA GPUs and found {found}: run it on a "
                 "machine with them (cuda13 extra installed); nothing was measured")


def run(reps: int, quick: bool, only: str | None = None, max_ctas: Sequence[int] = ()) -> dict:
    """Every stage's figures are saved as soon as they exist."""
    from jax_sender.testing.harness import vllm_available
    need_gpus(2)
    if os.environ.get(SHARE_GPUS):
        sys.exit(f"unset {SHARE_GPUS}: ranks sharing a GPU talk over sockets, so their "
                 "timings mean nothing")
    data: dict = {"reps": reps}
    save = lambda: (OUT / "bench.json").write_text(json.dumps(data, indent=1))  # noqa: E731
    four = gpu_count() >= 4
    if only == "servers" and not four:
        sys.exit("--only servers needs 4 GPUs")
    data["raw"] = _ranks("role_raw", 2, "2", str(reps), ids=_uid())[0][0]
    vllm = vllm_available()
    data["target"] = "vLLM 0.33.0 consumer" if vllm else "reference receiver"
    if only in (None, "dense"):
        _dense(data, reps, quick, vllm, save)
    if only in (None, "servers") and four:
        _servers(data, reps, vllm, save)
    if only in (None, "sparse"):
        with _server("1", vllm, sparse=True) as url:
            data["sparse_target"] = ("vLLM 0.33.0 sparse_nccl engine" if vllm
                                     else "reference receiver, sparse_nccl")
            data["sparse"] = _one("role_sparse", url, json.dumps(SPARSE_FRACTIONS), str(reps))
        save()
    if only in (None, "slow"):
        _stage(data, "slow", lambda: _slow(data, reps, vllm, save))
    if only in (None, "train"):
        def train() -> None:
            with _server("1", vllm) as url:
                data["train"] = _one("role_train", url, "20")
                save()
                if vllm:
                    data["train"] += _one("role_train_torch", url, "20")
            save()
            _stage(data, "beside", lambda: data["train"].extend(
                _ranks("role_beside", 2, "20", ids=_uid(), timeout=300)[0]))
            for n in max_ctas:  # NCCL needs the same cap on every rank: server and trainer
                with _environment({"NCCL_MAX_CTAS": str(n)}), _server("1", vllm) as url:
                    data["train"] += [dict(j, max_ctas=n) for j in _one("role_train", url, "20")]
                save()
        _stage(data, "train", train)
        save()
    save()
    return data


def _stage(data: dict, name: str, run_stage) -> None:
    """Run a stage; its failure is recorded and the others still run."""
    try:
        run_stage()
    except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
        data[f"{name}_error"] = str(e)[-3000:]
        print(f"stage {name} failed: {str(e)[-2000:]}", file=sys.stderr)


def _slow(data: dict, reps: int, vllm: bool, save) -> None:
    """Four qwen3-8b layers over NCCL's socket transport on loopback: a dense
    packed push into the dense engine, against sparse pushes into the sparse one."""
    with _environment(SLOW_LINK):
        data["slow_link"] = " ".join(f"{k}={v}" for k, v in SLOW_LINK.items())
        with _server("1", vllm) as url:
            data["slow_dense"] = _one("role_jax", url,
                                      json.dumps([_job("layers4", "packed", reps)]))
        save()
        with _server("1", vllm, sparse=True) as url:
            data["slow_sparse"] = _one("role_sparse", url, json.dumps(SLOW_FRACTIONS),
                                       str(reps), "layers4")
        save()


def _server(gpu: str, vllm: bool, sparse: bool = False):
    """The receiving server on ``gpu``: vLLM 0.33.0's own when it imports here
    (its log under the results folder), else the reference receiver."""
    from jax_sender.testing.harness import ReferenceServer, VLLMServer
    if not vllm:
        return ReferenceServer([gpu], backend="sparse_nccl" if sparse else "nccl")
    name = f"vllm_{'sparse_' * sparse}server_{gpu}"
    return VLLMServer(gpu, output=OUT / f"{name}.log",
                      requests=pathlib.Path(f"/tmp/bench_{name}.jsonl"), sparse=sparse)


def _servers(data: dict, reps: int, vllm: bool, save) -> None:
    """4 GPUs: a 4-rank raw broadcast, then qwen3-8b into three servers (GPUs
    1-3) by one broadcast, and by one push per server, one after another."""
    data["raw4"] = _ranks("role_raw", 4, "4", str(reps), ids=_uid())[0][0]
    save()
    servers = [_server(g, vllm) for g in "123"]
    job = json.dumps([_job("qwen3-8b", "packed", reps)])
    with contextlib.ExitStack() as stack:
        urls = json.dumps([stack.enter_context(s) for s in servers])
        data["servers_one"] = _one("role_jax", urls, job)
        save()
        data["servers_seq"] = _one("role_seq", urls, job)
        save()


def _dense(data: dict, reps: int, quick: bool, vllm: bool, save) -> None:
    data["init"] = _init_latency(reps, vllm)
    save()
    main = [_job("qwen3-8b", "packed", reps), _job("qwen3-8b", "unpacked", reps)]
    sweep = [] if quick else [
        _job("qwen3-8b", "packed", reps, b * MiB, n)
        for b in (64, 256, 512, 1024, 2048) for n in (1, 2, 3) if (b, n) != (1024, 2)]
    extra = [] if quick else [_job("many-small", "packed", reps), _job("large", "packed", reps)]
    floors = [_job("qwen3-8b", "prepacked", reps), _job("qwen3-8b", "preplaced", reps)] + (
        [] if quick else [_job("many-small", "prepacked", reps)])
    with _server("1", vllm) as url:
        data["ours"] = _one("role_jax", url, json.dumps(main + sweep + extra + floors))
        save()
        if vllm:
            try:
                data["torch"] = _one("role_torch", url, json.dumps(main + extra))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                data["torch_error"] = str(e)[-3000:]  # the table still prints our rows
            save()
        _stage(data, "fixed", lambda: _fixed(data, url, reps, vllm))
        save()


def _fixed(data: dict, url: str, reps: int, vllm: bool) -> None:
    """The 4 KiB push, ours and vLLM's torch engine's in turns, in one process:
    ``FIXED_BLOCKS`` blocks of ``4 x reps`` pushes each (a push takes ~7 ms,
    so the row affords the repetitions). The host drifts by about +-10 %
    from block to block, so many short blocks rather than a few long ones,
    and their medians are kept to show it."""
    job = json.dumps(_job("tiny", "packed", reps * 4))
    runs = _one("role_fixed", url, str(FIXED_BLOCKS), job,
                "1" if vllm and "torch" in data else "0")
    data["fixed_blocks"] = FIXED_BLOCKS
    for who in ("ours", "torch", "shipped"):
        mine = [{k: v for k, v in r.items() if k != "sender"} for r in runs
                if r["sender"] == who]
        if mine:
            if who == "shipped":
                data["fixed_shipped"] = _merged(mine)
            else:
                data[who].append(_merged(mine))
            data.setdefault("fixed_block_medians", {})[who] = [
                statistics.median(r["wall"]) for r in mine]


def _merged(runs: list[dict]) -> dict:
    """One job's figures from several runs of it: the per-repetition lists
    joined, the rest from the first run."""
    out = dict(runs[0], reps=sum(r["reps"] for r in runs))
    for key, value in runs[0].items():
        if isinstance(value, list):
            out[key] = [x for r in runs for x in r[key]]
    return out


# -- report ----------------------------------------------------------------------

def _row(name: str, nbytes: int, times: list[float], base: float | None, note: str = "") -> str:
    med, best = statistics.median(times), min(times)
    gbps = nbytes / med / 1e9
    ratio = f"{gbps / base:.2f}" if base else ""
    return f"| {name} | {med:.4f} | {best:.4f} | {gbps:.1f} | {ratio} | {note} |"


def report(data: dict) -> str:
    raw = GiB / statistics.median(data["raw"]) / 1e9
    lines = [f"Sender GPU 0, receiver GPU 1; {data['reps']} timed repetitions after one "
             "warm-up.", "",
             "| figure | median s | best s | median GB/s | ratio | notes |",
             "| --- | --- | --- | --- | --- | --- |",
             _row("raw ncclBroadcast 1 GiB, 2 ranks (baseline)", GiB, data["raw"], raw,
                  "10 back-to-back broadcasts per repetition")]
    if "ours" in data:
        lines += _dense_report(data, raw) + _fixed_report(data)
    if "servers_seq" in data:
        lines += _servers_report(data)
    if "sparse" in data:
        lines += _sparse_report(data, raw)
    if "slow_sparse" in data:
        lines += _slow_report(data)
    if "train" in data:
        lines += _train_report(data)
    return "\n".join(lines)


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f}"


def _span(j: dict) -> list[float]:
    """Our ``/update_weights`` calls timed inside their threads, as torch's
    engine is timed; runs that predate it have the push thread's span
    (posting to the answer seen there, two thread handoffs more)."""
    return j.get("update") or j["transfer"]


def _link_gbps(j: dict) -> float:
    """The link's own rate: GPU-timed from the end of the first broadcast to the
    end of the last (the first also waits for the receiver's HTTP call); runs
    that predate it have the host-clock span of all broadcasts."""
    if j.get("link_bytes") and min(j.get("link", [0])) > 0:
        return j["link_bytes"] / statistics.median(j["link"]) / 1e9
    return j["bytes"] / statistics.median(j["broadcast"]) / 1e9


def _fixed_report(data: dict) -> list[str]:
    ours = next((j for j in data["ours"] if j["workload"] == "tiny"), None)
    theirs = next((j for j in data.get("torch", []) if j["workload"] == "tiny"), None)
    if ours is None:
        return []
    turns = (f" Ours and torch's took turns, {data['fixed_blocks']} blocks of "
             f"{ours['reps'] // data['fixed_blocks']} pushes each." if "fixed_blocks" in data
             else "")
    lines = ["", "A push's fixed cost: one 4 KiB tensor, the whole call (start, update, "
             f"finish), median ms.{turns}", "",
             "| sender | median ms | best ms | ratio |", "| --- | --- | --- | --- |",
             f"| ours, `send()` | {_ms(ours['wall'])} | {min(ours['wall']) * 1e3:.2f} | "
             + (f"{statistics.median(ours['wall']) / statistics.median(theirs['wall']):.2f} |"
                if theirs else " |")]
    if theirs:
        lines.append(f"| vLLM's torch engine, `send_weights()` | {_ms(theirs['wall'])} | "
                     f"{min(theirs['wall']) * 1e3:.2f} | 1.00 |")
    shipped = data.get("fixed_shipped")
    if theirs and shipped:
        lines.append("| the same over vLLM's own HTTP client (`HTTPVLLMWeightSyncClient`: "
                     f"a new connection per call) | {_ms(shipped['wall'])} | "
                     f"{min(shipped['wall']) * 1e3:.2f} | "
                     f"{statistics.median(shipped['wall']) / statistics.median(theirs['wall']):.2f} |")
        lines += ["", "Ratio: time / torch's engine over our HTTP client (which the other "
                  "torch rows use too: the senders' own work compared). Ours / torch's "
                  "engine over vLLM's own client, what a torch user runs: "
                  f"{statistics.median(ours['wall']) / statistics.median(shipped['wall']):.2f}."]
    spread = data.get("fixed_block_medians", {})
    if spread:
        names = {"shipped": "torch over vLLM's client"}
        lines += ["", "Block medians, ms (the host's drift from block to block): " + "; ".join(
            f"{names.get(who, who)} {min(m) * 1e3:.2f}-{max(m) * 1e3:.2f}"
            for who, m in spread.items()) + "."]
    if theirs and "start" in ours and "start" in theirs:
        how = ("the `/update_weights` call timed inside its thread" if "update" in ours
               else "posting `/update_weights` to its answer; ours on the push thread")
        lines += ["", f"Its parts, median ms (start and finish are HTTP calls; update: {how}):",
                  "", "| sender | start | update | finish |", "| --- | --- | --- | --- |"]
        lines += [f"| {who} | {_ms(j['start'])} | {_ms(_span(j))} | {_ms(j['finish'])} |"
                  for who, j in (("ours", ours), ("torch", theirs))]
    return lines


def _slow_report(data: dict) -> list[str]:
    dense = data["slow_dense"][0]
    base = statistics.median(dense["transfer"])
    lines = ["", f"Slow link: both ends on NCCL's socket transport (`{data['slow_link']}`), "
             f"four qwen3-8b layers ({dense['bytes'] / 1e9:.2f} GB).", "",
             "| push | wire GB | median s | best s | x faster than dense |",
             "| --- | --- | --- | --- | --- |",
             f"| dense, packed 1 GiB x 2 | {dense['bytes'] / 1e9:.2f} | {base:.3f} | "
             f"{min(dense['transfer']):.3f} | 1.0 |"]
    for j in data["slow_sparse"]:
        med = statistics.median(j["transfer"])
        lines.append(f"| sparse, {j['fraction']:.0%} changed | {j['bytes'] / 1e9:.3f} | "
                     f"{med:.3f} | {min(j['transfer']):.3f} | {base / med:.1f} |")
    return lines


def _train_report(data: dict) -> list[str]:
    rows = {}
    for j in data["train"]:
        if "max_ctas" not in j:
            rows.setdefault(j["mode"], j)  # the first "none" (before any push)
    none = statistics.median(rows["none"]["step"])
    lines = ["", f"Training loop: a Flax decoder ({rows['none']['bytes'] / 1e9:.2f} GB of bf16 "
             f"parameters, {rows['none']['tensors']} tensors) trains on GPU 0 and pushes to "
             f"{data['target']} on GPU 1 after every step; medians over "
             f"{len(rows['none']['step'])} steps.", "",
             "| push | step ms | added to a step ms | trainer blocked ms | push's transfer ms |",
             "| --- | --- | --- | --- | --- |"]
    labels = (("none", "none"), ("blocking", "blocking `send()`"),
              ("torch", "vLLM's torch sender, blocking `send_weights()`"),
              ("async", "`send(wait=False)`"),
              ("snapshot", "its snapshot alone (the same copies, no broadcast)"))
    for mode, label in labels:
        j = rows.get(mode)
        if j is None:
            continue
        step = statistics.median(j["step"])
        lines.append(f"| {label} | {step * 1e3:.2f} | {(step - none) * 1e3:.2f} | "
                     + (f"{_ms(j['blocked'])} | " if j["blocked"] else "0 | ")
                     + (f"{_ms(j['transfer'])} |" if j["transfer"] else "|"))
    add = lambda m: statistics.median(rows[m]["step"]) - none  # noqa: E731
    if "blocking" in rows and "async" in rows:
        lines += ["", f"The asynchronous push adds {add('async') / add('blocking'):.2f} x what "
                  "the blocking push adds to a step"
                  + (f", {add('async') / add('torch'):.2f} x what vLLM's torch sender adds."
                     if "torch" in rows else ".")]
    if "async" in rows and "snapshot" in rows:
        lines += [f"Of the {add('async') * 1e3:.2f} ms it adds, its snapshot (dispatch and "
                  f"copy) is {add('snapshot') * 1e3:.2f} ms; the other "
                  f"{(add('async') - add('snapshot')) * 1e3:.2f} ms is the push running beside "
                  "the training step: its broadcast on the GPU, its thread on the host."]
    if "async" in rows:
        lines += [f"Its extra device memory is its snapshot, one copy of the pushed bytes on "
                  f"the trainer's GPU ({rows['async']['bytes'] / 1e9:.2f} GB), kept for the "
                  "next asynchronous push."]
    if "beside" in rows:
        j = rows["beside"]
        alone, beside = statistics.median(j["none"]), statistics.median(j["step"])
        lines += [f"A raw broadcast of the same {j['bytes'] / 1e9:.2f} GB launched beside each "
                  "step (no push thread, no HTTP, no snapshot; another process receives it on "
                  f"GPU 1): the step takes {beside * 1e3:.2f} ms against {alone * 1e3:.2f} ms "
                  f"without it, +{(beside - alone) * 1e3:.2f} ms: the broadcast's own cost to "
                  "the step."]
    return lines + _capped_report(data, add("blocking") if "blocking" in rows else None)


def _capped_report(data: dict, blocking: float | None) -> list[str]:
    """The training loop again with NCCL's CTAs (SMs) capped on every rank:
    a slower broadcast that leaves more of the GPU to the training step."""
    caps: dict[int, dict] = {}
    for j in data["train"]:
        if "max_ctas" in j:
            caps.setdefault(j["max_ctas"], {}).setdefault(j["mode"], j)
    if not caps:
        return []
    lines = ["", "The same loop with `NCCL_MAX_CTAS` set for the server and the trainer alike "
             "(NCCL needs the same cap on every rank), ms:", "",
             "| NCCL_MAX_CTAS | step, no push | blocking adds | `send(wait=False)` adds | "
             "it blocks the trainer | async / blocking, same cap | async / uncapped blocking |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, rows in sorted(caps.items()):
        med = lambda m, k="step", rows=rows: statistics.median(rows[m][k])  # noqa: E731
        none = med("none")
        block, wait = med("blocking") - none, med("async") - none
        lines.append(f"| {n} | {none * 1e3:.2f} | {block * 1e3:.2f} | {wait * 1e3:.2f} | "
                     f"{med('async', 'blocked') * 1e3:.2f} | {wait / block:.2f} | "
                     + (f"{wait / blocking:.2f} |" if blocking else "|"))
    return lines


def _servers_report(data: dict) -> list[str]:
    raw4 = GiB / statistics.median(data["raw4"]) / 1e9
    one, seq = data["servers_one"][0], data["servers_seq"][0]
    ratio = statistics.median(seq["transfer"]) / statistics.median(one["transfer"])
    return ["", f"Three servers (GPUs 1-3, {data['target']}), qwen3-8b packed, 1 GiB x 2.", "",
            "| figure | median s | best s | median GB/s | ratio | notes |",
            "| --- | --- | --- | --- | --- | --- |",
            _row("raw ncclBroadcast 1 GiB, 4 ranks (baseline)", GiB, data["raw4"], raw4,
                 "10 back-to-back broadcasts per repetition"),
            _row("one broadcast -> 3 servers (1 -> 3 receivers)", one["bytes"],
                 one["transfer"], raw4, "ratio to 4-rank raw"),
            _row("  one push per server, one after another", seq["bytes"], seq["transfer"],
                 raw4, f"GB/s per server's copy; {ratio:.2f} x the one broadcast's time")]


def _sparse_report(data: dict, raw: float) -> list[str]:
    dense = next((j for j in data.get("ours", []) if (j["workload"], j["mode"], j["buffer"],
                  j["nbuf"]) == ("qwen3-8b", "packed", GiB, 2)), None)
    lines = ["", f"Sparse: `SparseSender.send` of qwen3-8b into {data['sparse_target']}. Baselines "
             "of the same run: the dense bytes at the raw broadcast's speed"
             + (", and the packed dense send above" if dense else "") + ".", "",
             "| changed | wire GB | dense GB | wire / dense | median s | best s | "
             "with counting s | dense at raw s | time / dense at raw |"
             + (" dense send s |" if dense else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
             + (" --- |" if dense else "")]
    for j in data["sparse"]:
        med = statistics.median(j["transfer"])
        at_raw = j["dense"] / raw / 1e9
        lines.append(
            f"| {j['fraction']:.0%} | {j['bytes'] / 1e9:.2f} | {j['dense'] / 1e9:.2f} | "
            f"{j['bytes'] / j['dense']:.2f} | {med:.3f} | {min(j['transfer']):.3f} | "
            f"{statistics.median(j['total']):.3f} | {at_raw:.3f} | {med / at_raw:.1f} |"
            + (f" {statistics.median(dense['transfer']):.3f} |" if dense else ""))
    split = [j for j in data["sparse"] if "host" in j]
    if split:
        lines += ["", "Where a sparse push's time goes (medians): the sender building "
                  "patches (host, waits included), the broadcasts' span, and the rest of "
                  "`/update_weights` (vLLM's loader after the last broadcast).", ""]
        lines += [f"- {j['fraction']:.0%}: patches {statistics.median(j['host']):.3f} s, "
                  f"broadcasts {statistics.median(j['broadcast']):.3f} s of "
                  f"{statistics.median(j['transfer']):.3f} s" for j in split]
    return lines


def _dense_report(data: dict, raw: float) -> list[str]:
    target = data["target"]
    lines = ["", f"Receiver: {target}.", "",
             "| figure | median s | best s | median GB/s | ratio | notes |",
             "| --- | --- | --- | --- | --- | --- |"]
    torch_rows = {(j["workload"], j["mode"]): j for j in data.get("torch", [])}
    floors = {(j["workload"], FLOORS[j["mode"]]): j for j in data["ours"] if j["mode"] in FLOORS}
    for j in data["ours"]:
        default = (j["buffer"], j["nbuf"]) == (GiB, 2)
        if ((j["workload"] == "qwen3-8b" and not default) or j["workload"] == "tiny"
                or j["mode"] in FLOORS):
            continue  # in the sweep table, the fixed-cost one, or under its push
        label = f"{j['mode']} send {j['workload']} -> {target}"
        note = (f"{j['tensors']} tensors, {j['chunks']} "
                f"{'chunks' if j['mode'] == 'packed' else 'broadcasts'}; "
                f"broadcasts alone {_link_gbps(j):.1f} GB/s ({_link_gbps(j) / raw:.3f} x raw)")
        if j["workload"] == "many-small":
            per = lambda k, j=j: statistics.median(j[k]) / j["tensors"] * 1e6  # noqa: E731
            note += (f"; per tensor: {per('transfer'):.1f} us in all, of which the sender's "
                     f"host {per('host'):.1f} us; prepare {per('prepare'):.1f} us")
        if j is data["ours"][0]:
            # num_buffers slots, each at most the buffer plus the last tensor of a
            # chunk (a tensor larger than the buffer is sent from its own memory)
            fits = [math.prod(s) * 2 for _, s in workload(j["workload"])]
            bound = j["nbuf"] * (j["buffer"] + max(n for n in fits if n <= j["buffer"]))
            note += (f"; sender peak extra {j['peak'] / GiB:.2f} GiB "
                     f"(bound {bound / GiB:.2f} GiB)")
        lines.append(_row(label, j["bytes"], _span(j), raw, note + "; ratio to raw"))
        t = torch_rows.get((j["workload"], j["mode"]))
        if t:
            ours = j["bytes"] / statistics.median(_span(j)) / 1e9
            theirs = t["bytes"] / statistics.median(t["transfer"]) / 1e9
            note = f"ratio to raw; ours / torch = {ours / theirs:.2f}"
            if "wall" in j and "wall" in t:  # the whole call a user waits for
                mine, other = statistics.median(j["wall"]), statistics.median(t["wall"])
                note += (f"; whole call (start to finish), median: ours {mine * 1e3:.1f} ms, "
                         f"torch {other * 1e3:.1f} ms, ours / torch = {other / mine:.2f}")
            lines.append(_row("  vLLM's torch sender, same", t["bytes"], t["transfer"], raw,
                              note))
        f = floors.get((j["workload"], j["mode"]))
        if f:
            floor = statistics.median(_span(f))
            note = f"time / floor: ours {statistics.median(_span(j)) / floor:.2f}"
            if t:
                note += f", torch {statistics.median(t['transfer']) / floor:.2f}"
            what = ("chunks already packed" if j["mode"] == "packed"
                    else "each tensor from one buffer")
            lines.append(_row(f"  floor: {what}, no sender work", f["bytes"],
                              _span(f), raw, note + "; ratio to raw"))
    init = data["init"]
    lines += ["", "| init + warm-up, 2 ranks, no HTTP | median ms | best ms | ratio |",
              "| --- | --- | --- | --- |"]
    for label, times in init.items():
        ratio = (f"{statistics.median(times) / statistics.median(init['vllm']):.2f}"
                 if "vllm" in init else "")
        name = ("uniqueid.handshake" if label == "ours"
                else "vLLM PyNcclCommunicator.from_unique_id_bytes")
        lines.append(f"| {name} | {statistics.median(times) * 1e3:.1f} | "
                     f"{min(times) * 1e3:.1f} | {ratio} |")
    sweep = [j for j in data["ours"] if j["workload"] == "qwen3-8b" and j["mode"] == "packed"]
    if len(sweep) > 1:
        lines += ["", "| buffer | buffers | median GB/s | best GB/s | x raw | sender extra GiB |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for j in sorted(sweep, key=lambda j: (j["buffer"], j["nbuf"])):
            med = j["bytes"] / statistics.median(_span(j)) / 1e9
            best = j["bytes"] / min(_span(j)) / 1e9
            lines.append(f"| {j['buffer'] // MiB} MiB | {j['nbuf']} | {med:.1f} | {best:.1f} | "
                         f"{med / raw:.2f} | {j['held'] / GiB:.2f} |")
    return lines


def plot(data: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    raw = GiB / statistics.median(data["raw"]) / 1e9
    sweep = [j for j in data["ours"] if j["workload"] == "qwen3-8b" and j["mode"] == "packed"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n in sorted({j["nbuf"] for j in sweep}):
        pts = sorted((j["buffer"] / MiB, j["bytes"] / statistics.median(_span(j)) / 1e9)
                     for j in sweep if j["nbuf"] == n)
        ax.plot(*zip(*pts), marker="o", label=f"packed, {n} buffer{'s' * (n > 1)}")
    for j in data["ours"]:
        if j["workload"] == "qwen3-8b" and j["mode"] == "unpacked":
            ax.axhline(j["bytes"] / statistics.median(_span(j)) / 1e9, color="gray",
                       ls="--", label="unpacked")
    ax.axhline(raw, color="black", ls=":", label="raw 1 GiB broadcast")
    ax.set(xscale="log", xlabel="packed buffer size (MiB)", ylabel="GB/s (median)",
           title=f"qwen3-8b send -> {data['target']}, 2 x H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="no sweep, no many-small, no large")
    ap.add_argument("--only", choices=STAGES,
                    help="the raw baseline and this stage only (servers: 4 GPUs)")
    ap.add_argument("--max-ctas", type=int, nargs="*", default=[], metavar="N",
                    help="train stage: also run the loop with NCCL_MAX_CTAS=N on every rank")
    ap.add_argument("--plot", metavar="JSON", help="only redraw table and plot from a run's JSON")
    ap.add_argument("--out", default=str(OUT), help="results folder (default: results/)")
    args = ap.parse_args()
    OUT = pathlib.Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.plot:
        data = json.loads(pathlib.Path(args.plot).read_text())
    else:
        data = run(args.reps, args.quick, args.only, args.max_ctas)
    table = report(data)
    (OUT / "bench.md").write_text(table + "\n")
    print(table)
    if "ours" not in data:
        print("plot: none (no dense sends in this run)")
    else:
        print("plot:", OUT / "bench.png" if plot(data, OUT / "bench.png")
              else "matplotlib not installed; redraw with --plot results/bench.json")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("role_"):
        globals()[sys.argv[1]](*sys.argv[2:])
    else:
        main()
