"""The bench's roles on the JAX side: each runs in a child process on one GPU
(see ``procs.py``) and emits its figures as rows (``rows.py``).

Why a process per role: each holds one GPU's XLA pool and NCCL state, and
the ranks of one collective start together; a role's failure ends its
process, never the run. Heavy imports (JAX, the sender) happen inside the
roles, so the entry point starts fast and says "no GPU" in a sentence.
vLLM's torch side is in ``torch_roles.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from procs import emit, given_ids
from rows import PushRow, SeqRow, SparseRow, TrainRow
from workloads import GiB, Job, workload

# Seconds between the rounds of the init roles (each round starts on the wall clock).
INIT_ROUND_S = 1.0


def role_raw(rank: str, world: str, reps: str) -> None:
    """The baseline: ten back-to-back broadcasts of one 1 GiB buffer per
    repetition, two dropped; emits the mean time of one broadcast per repetition."""
    import jax.numpy as jnp

    from nccl_cffi import Communicator, cuda
    from uniqueid import UniqueId, warm_up
    comm = Communicator.init_rank(int(world), UniqueId.from_b64(given_ids()).raw, int(rank), 0,
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
    emit(times[2:])
    comm.destroy()


def at(start: float) -> None:
    """Sleep until the wall-clock instant ``start`` (both ranks of a round start together)."""
    time.sleep(max(start - time.time(), 0.0))


def role_init_ours(rank: str, start: str) -> None:
    """``uniqueid.handshake`` with each given id, one round a second from ``start``."""
    from uniqueid import UniqueId, handshake
    times = []
    for i, uid in enumerate(given_ids()):
        at(float(start) + INIT_ROUND_S * i)
        t = time.perf_counter()
        comm = handshake(2, UniqueId.from_b64(uid), int(rank), 0, timeout=60)
        times.append(time.perf_counter() - t)
        comm.destroy()
    emit(times)


def workload_pairs(name: str) -> list[tuple[str, Any]]:
    """Workload ``name`` as (name, random bfloat16 JAX array) pairs, computed."""
    import jax
    import jax.numpy as jnp
    spec = workload(name)
    keys = jax.random.split(jax.random.PRNGKey(0), len(spec))
    pairs = [(n, jax.random.normal(k, s, jnp.bfloat16)) for (n, s), k in zip(spec, keys)]
    jax.block_until_ready([a for _, a in pairs])
    return pairs


def send_config(job: Job) -> Any:
    """The ``SendConfig`` of ``job``'s geometry (a floor's: of the pushes it bounds)."""
    from jax_sender import SendConfig
    return SendConfig(packed=job.packed, buffer_size_bytes=job.buffer, num_buffers=job.nbuf)


def role_seq(urls: str, jobs: str) -> None:
    """One sender per server, pushing to them one after another (the baseline
    for one broadcast feeding every server)."""
    from jax_sender import WeightSender
    for job in map(Job.from_json, json.loads(jobs)):
        pairs = workload_pairs(job.workload)
        senders = [WeightSender.connect(u, config=send_config(job)) for u in json.loads(urls)]
        transfer, total = [], []
        for _ in range(job.reps + 1):
            t = time.perf_counter()
            stats = [s.send(pairs) for s in senders]
            total.append(time.perf_counter() - t)
            transfer.append(sum(x.transfer_s for x in stats))
        for s in senders:
            s.close()
        emit(SeqRow(job=job, transfer=transfer[1:], total=total[1:], bytes=stats[0].bytes,
                    tensors=stats[0].tensors).to_json())


def role_jax(url: str, jobs: str) -> None:
    """Our sender, one process for every job (a job: workload, mode, buffer
    geometry); a floor's jobs through ``floor.FloorSender``. ``url``: one
    server, or a JSON list of servers fed by one broadcast."""
    import jax
    from floor import FloorSender

    from jax_sender import WeightSender
    dev = jax.devices()[0]
    sender, pairs, current, geometry = None, None, None, None
    servers = json.loads(url) if url.startswith("[") else url
    for job in map(Job.from_json, json.loads(jobs)):
        if job.workload != current:
            pairs = None  # free the previous workload first
            pairs = workload_pairs(job.workload)
            current = job.workload
        if (job.mode, send_config(job)) != geometry:  # a new group (and frees the slots)
            if sender is not None:
                sender.close()
            geometry = (job.mode, send_config(job))
            sender = (FloorSender(servers, geometry[1], dev) if job.floor
                      else WeightSender.connect(servers, config=geometry[1]))
        emit(pushes(sender, pairs, job, dev).to_json())
    sender.close()


def pushes(sender: Any, pairs: list, job: Job, dev: Any) -> PushRow:
    """``job.reps`` timed pushes of ``pairs`` after one warm-up, and their figures.

    Args:
        sender: a ``WeightSender`` or a ``FloorSender`` (``send(pairs)`` gives ``SendStats``).
        pairs: (name, array) per tensor.
        job: what is measured; its row's first fields.
        dev: the JAX device whose memory is read before and after.
    """
    base = dev.memory_stats()["bytes_in_use"]
    stats, wall = [], []
    for _ in range(job.reps + 1):
        t = time.perf_counter()
        stats.append(sender.send(pairs))
        wall.append(time.perf_counter() - t)
    stats, wall = stats[1:], wall[1:]
    s = stats[0]
    return PushRow(job=job, transfer=[x.transfer_s for x in stats],
                   update=[x.update_s for x in stats], broadcast=[x.broadcast_s for x in stats],
                   total=[x.total_s for x in stats], prepare=[x.prepare_s for x in stats],
                   host=[x.host_s for x in stats], start=[x.start_s for x in stats],
                   finish=[x.finish_s for x in stats], link=[x.link_s for x in stats],
                   link_bytes=s.link_bytes, wall=wall, bytes=s.bytes, tensors=s.tensors,
                   chunks=s.chunks, largest=max(a.nbytes for _, a in pairs),
                   held=dev.memory_stats()["bytes_in_use"] - base,
                   # the process-wide peak: meaningful for the first job only
                   peak=dev.memory_stats()["peak_bytes_in_use"] - base)


def role_sparse(url: str, fractions: str, reps: str, name: str = "qwen3-8b") -> None:
    """``SparseSender.send`` of workload ``name`` with a fraction of each tensor's elements changed."""
    import jax
    import jax.numpy as jnp

    from jax_sender import SparseSender
    old = workload_pairs(name)
    keys = jax.random.split(jax.random.PRNGKey(0), len(old))  # the keys behind the values
    sender = SparseSender.connect(url)
    bump = jax.jit(lambda a, k, f: jnp.where(jax.random.uniform(k, a.shape) < f, a + 1, a))
    for f in json.loads(fractions):
        new = None  # free the previous fraction's copy first
        new = [(n, bump(a, k, f)) for (n, a), k in zip(old, keys)]
        stats = [sender.send(new, old) for _ in range(int(reps) + 1)][1:]
        emit(SparseRow(fraction=f, transfer=[x.transfer_s for x in stats],
                       total=[x.total_s for x in stats], prepare=[x.prepare_s for x in stats],
                       broadcast=[x.broadcast_s for x in stats], host=[x.host_s for x in stats],
                       bytes=stats[0].bytes, dense=sum(a.nbytes for _, a in new),
                       tensors=stats[0].tensors).to_json())
    sender.close()


def trainer() -> tuple[Any, Callable, Any]:
    """A Flax decoder's training step (forward, backward, SGD; the old
    parameters donated), its parameters and a batch: the same in every process.

    Returns:
        (parameters, ``step(params, tokens) -> (params, loss)``, tokens).
    """
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


def train_loop(params: Any, step: Callable, tokens: Any, n: int,
               push: Callable[[Any], Any] | None) -> tuple[Any, list[float], list[float], list]:
    """``n + 2`` steps, ``push(params)`` after each (None: no push).

    Returns:
        The last parameters, and per step (the first two dropped): its wall
        time, the time ``push`` held the trainer, what ``push`` returned.
    """
    walls, blocked, out = [], [], []
    for _i in range(n + 2):
        t = time.perf_counter()
        params, value = step(params, tokens)
        value.block_until_ready()
        if push is not None:
            s0 = time.perf_counter()
            out.append(push(params))
            blocked.append(time.perf_counter() - s0)
        walls.append(time.perf_counter() - t)
    return params, walls[2:], blocked[2:], out[2:]


def role_train(url: str, steps: str) -> None:
    """The training step on GPU 0 pushing to the server after every step: no
    push, the blocking push, the asynchronous push, and the asynchronous
    push's snapshot alone (the same copies, no broadcast), which splits what
    it adds to a step into the copy and the broadcast beside the step."""
    import jax

    from jax_sender import LLAMA, WeightSender
    params, step, tokens = trainer()
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    sender = WeightSender.connect(url, mapping=LLAMA)
    n = int(steps)
    held = []

    def snapshot(p) -> None:
        """What ``send(wait=False)`` dispatches before it returns, and nothing
        else; kept until the next one, as a push in flight keeps its own.
        The sender's own private methods: no public name makes the snapshot
        alone, and a copy of their code here would measure something else
        the day they change."""
        metas, sources = sender._descriptions.of(p)
        held[:] = [sender._snapshot(metas, sources, sender._turns_of(metas, sources)[0])]

    modes = {"none": None, "blocking": lambda p: sender.send(p),
             "async": lambda p: sender.send(p, wait=False), "snapshot": snapshot}
    for mode in ("none", "blocking", "async", "snapshot", "none"):
        params, walls, blocked, out = train_loop(params, step, tokens, n, modes[mode])
        stats = ([p.result() for p in out] if mode == "async" else out if mode == "blocking"
                 else [])
        emit(TrainRow(mode=mode, step=walls, blocked=blocked,
                      transfer=[x.transfer_s for x in stats], bytes=nbytes,
                      tensors=len(jax.tree_util.tree_leaves(params))).to_json())
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
    comm = Communicator.init_rank(2, UniqueId.from_b64(given_ids()).raw, int(rank), 0,
                                  blocking=True, timeout=120, then=warm_up)
    stream = cuda.Stream(0)
    n = int(steps)
    params, step, tokens = trainer()
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    buf = jnp.zeros((nbytes,), jnp.uint8).block_until_ready()
    if rank == "1":
        for _ in range(n + 2):
            comm.broadcast(buf, root=0, stream=stream)
        comm.wait(stream, 120)
        emit({})
    else:
        params, none, _, _ = train_loop(params, step, tokens, n, None)
        params, walls, blocked, _ = train_loop(
            params, step, tokens, n, lambda p: comm.broadcast(buf, root=0, stream=stream))
        comm.wait(stream, 120)
        emit(TrainRow(mode="beside", step=walls, none=none, blocked=blocked, transfer=[],
                      bytes=nbytes, tensors=len(jax.tree_util.tree_leaves(params))).to_json())
    comm.destroy()
