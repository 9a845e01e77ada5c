"""Several broadcasting trainer processes: vLLM's "Broadcasting ranks".

Multi-host JAX runs one process per host over global arrays. A parameter's
*owners* are the processes holding a shard of it, in ascending process
index; its first owner broadcasts it. The transfer group's trainer ranks are
process 0 plus every first owner, in ascending order, and a process's group
rank is its position there (so workers start at ``rank_offset`` = the
group's size). Each broadcaster sends its own parameters in its own turn,
``src`` = its group rank; process 0 posts that turn's ``/update_weights``;
every other group member receives and discards (it must take part in each
collective); processes outside the group hold no communicator and only run
the gathers of the parameters they co-own, in the broadcaster's order.

The rules are vLLM's, checked identically on every process so every process
raises alike: process 0 is the first owner of whatever it owns (it gathers
only in its own turn), a process owns parameters of one broadcaster only
(each broadcaster sends in its own turn), and the world leaves room for
workers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from nccl_cffi import DEFAULT_INIT_TIMEOUT
from uniqueid import (
    UNIQUE_ID_BYTES,
    Connection,
    InitInfo,
    RendezvousError,
    RendezvousTimeout,
    UniqueId,
    UpdateInfo,
    VLLMClient,
    connect,
    handshake,
    in_background,
)

from .config import SendConfig
from .errors import GatherTimeout
from .plan import Chunk, MetadataError, TensorMeta, check_alignment, plan_chunks, wire_order

# ``share(data, timeout_s)``: process 0 passes bytes, every other process None; all get
# process 0's, or a ``RendezvousTimeout`` after ``timeout_s``.
Share = Callable[[bytes | None, float], bytes]


@dataclass(frozen=True)
class Turn:
    """One broadcaster's turn: its group rank, its process, its parameters (indices)."""

    src: int
    process: int
    params: tuple[int, ...]


@dataclass(frozen=True)
class BroadcastPlan:
    """Who broadcasts what, identical on every process."""

    group: tuple[int, ...]  # process index of each group rank
    turns: tuple[Turn, ...]  # in ascending group rank

    def group_rank(self, process: int) -> int | None:
        return self.group.index(process) if process in self.group else None

    @classmethod
    def single(cls, n: int) -> BroadcastPlan:
        """One process: rank 0 sends all ``n`` tensors."""
        return cls((0,), (Turn(0, 0, tuple(range(n))),))


@dataclass(frozen=True)
class TurnUpdate:
    """One turn as the workers see it: its tensors, the packed chunks cut from
    them alone (a worker cuts per ``/update_weights`` call), and the
    ``update_info`` process 0 posts for it."""

    turn: Turn
    metas: list[TensorMeta]
    chunks: list[Chunk]
    update: UpdateInfo


def turn_updates(plan: BroadcastPlan, metas: Sequence[TensorMeta], buffer_size: int | None,
                 sent: dict[int, list[TensorMeta]]) -> list[TurnUpdate]:
    """Every turn's update, checked before anything is sent. ``buffer_size``:
    packed mode's, None when unpacked; packed turns send their tensors in
    ``wire_order`` (so ``turn.params`` is reordered). ``sent``: per ``src``,
    the metadata the workers hold; an unchanged turn posts empty lists
    (vLLM's reuse, kept per ``src``)."""
    out = []
    for turn in plan.turns:
        params = turn.params
        if buffer_size:
            order = wire_order([metas[i] for i in params], buffer_size)
            turn = replace(turn, params=tuple(params[j] for j in order))
        sub = [metas[i] for i in turn.params]
        chunks = plan_chunks(sub, buffer_size) if buffer_size else []
        check_alignment(sub, chunks)
        update = UpdateInfo(src=turn.src) if sub == sent.get(turn.src) else UpdateInfo(
            names=[m.name for m in sub], dtype_names=[m.dtype for m in sub],
            shapes=[list(m.shape) for m in sub], src=turn.src)
        out.append(TurnUpdate(turn, sub, chunks, update))
    return out


def owners_of(array: Any) -> tuple[int, ...] | None:
    """Processes holding a shard of ``array``, ascending; None for host data
    (every process has it, so process 0 sends it)."""
    if not isinstance(array, jax.Array):
        return None
    return tuple(sorted({d.process_index for d in array.sharding.device_set}))


def broadcast_plan(metas: Sequence[TensorMeta],
                   owners: Sequence[tuple[int, ...] | None]) -> BroadcastPlan:
    """Group and turns from each parameter's owners, validated as vLLM does."""
    slices: dict[int, list[int]] = {}
    for i, o in enumerate(owners):
        slices.setdefault(0 if o is None else o[0], []).append(i)
    for m, o in zip(metas, owners):
        if o is not None and 0 in o[1:]:
            raise MetadataError(
                f"parameter {m.name!r} has owners {list(o)}: process 0 only gathers in its "
                "own turn, so it must be the first owner of every parameter it owns")
    if len(slices) > 1:
        broadcaster_of: dict[int, int] = {}
        for b, idx in sorted(slices.items()):
            for i in idx:
                if owners[i] is None:
                    raise MetadataError(
                        f"parameter {metas[i].name!r} is host data, so every process owns "
                        f"it, but processes {sorted(slices)} broadcast: put every parameter "
                        "on the devices of the processes that own it")
                for r in owners[i]:
                    if broadcaster_of.setdefault(r, b) != b:
                        raise MetadataError(
                            f"process {r} owns parameters broadcast by processes "
                            f"{broadcaster_of[r]} and {b}, but each broadcaster sends in its "
                            "own turn, so every parameter a process owns must share its first "
                            f"owner (first seen: {metas[i].name!r})")
    group = tuple(sorted({0, *slices}))
    return BroadcastPlan(group, tuple(Turn(group.index(b), b, tuple(idx))
                                      for b, idx in sorted(slices.items())))


@functools.lru_cache(maxsize=64)
def _replicator(devices: tuple[jax.Device, ...]) -> Callable[[jax.Array], jax.Array]:
    mesh = jax.sharding.Mesh(np.array(devices), ("owners",))
    return jax.jit(lambda x: x, out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))


def gather(array: jax.Array) -> jax.Array:
    """The whole of a parameter sharded over several processes, on one local
    device. A collective among its owners: every owner calls it, in the same
    order. Peak memory: one full copy on each device holding a shard."""
    devices = tuple(sorted(array.sharding.device_set, key=lambda d: d.id))
    return _replicator(devices)(array).addressable_shards[0].data


def ready(array: jax.Array, timeout: float, what: str) -> jax.Array:
    """``array`` once computed; a gather waits on other processes, so it gets a deadline."""
    deadline = time.monotonic() + timeout
    delay = 1e-4
    while not array.is_ready():
        if time.monotonic() > deadline:
            raise GatherTimeout(
                f"{what} did not complete within {timeout}s: another owner of it did not "
                "take part (it failed or is not sending); every owner must send together")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return array


def join_gathers(turns: Sequence[Turn], arrays: Sequence[Any], process: int,
                 timeout: float) -> None:
    """A process outside the transfer group joins the gathers of the parameters
    it co-owns, in their broadcaster's order: the turns as ``turn_updates``
    gives them (a packed turn's parameters in wire order), as the broadcaster
    gathers them."""
    for turn in turns:
        for i in turn.params:
            arr = arrays[i]
            if process in (owners_of(arr) or ()) and not arr.is_fully_addressable:
                ready(gather(arr), timeout, f"the gather of parameter {i} for process "
                                            f"{turn.process}")


def share_from_process_0(data: bytes | None, timeout: float = DEFAULT_INIT_TIMEOUT) -> bytes:
    """The default ``Share``: JAX's own broadcast between processes. Every
    process must call it; one that never does would leave the others in a
    collective with no deadline, so it runs in a daemon thread and the wait
    for it has one."""
    from jax.experimental import multihost_utils

    def broadcast() -> bytes:
        n = np.asarray(multihost_utils.broadcast_one_to_all(np.int64(len(data or b""))))
        buf = np.frombuffer(data, np.uint8) if data else np.zeros(int(n), np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes()

    try:
        return in_background(broadcast, name="share-from-process-0").result(timeout)
    except FutureTimeout:
        raise RendezvousTimeout(
            f"the trainer processes did not all reach connect_group within {timeout}s: "
            "every process must call it (and reconnect) together") from None


@dataclass
class TrainerGroup:
    """This process's place in a multi-process transfer group, and how to form it."""

    plan: BroadcastPlan
    process: int
    device: int
    share: Share
    clients: list[VLLMClient]  # process 0's; empty elsewhere
    config: SendConfig
    metadata: list[list[Any]] | None = None  # the load plan shipped at init
    workers: Sequence[int] | None = None
    init_info: InitInfo | None = None

    @property
    def rank(self) -> int | None:
        return self.plan.group_rank(self.process)

    def form(self, timeout_s: float) -> Connection | None:
        """Process 0 mints a fresh id, shares it with the world size, and forms the
        group with the servers; the other broadcasters join with it; every other
        process gets None. Every process must call this together; every wait
        (the sharing included) ends within ``timeout_s``."""
        n = len(self.plan.group)
        workers = self.workers
        if self.process == 0:
            try:
                if workers is None:
                    workers = [c.get_world_size() for c in self.clients]
                uid = UniqueId.mint()
                world = n + sum(workers)
            except BaseException:
                self.share(bytes(UNIQUE_ID_BYTES + 8), timeout_s)  # world 0: the others raise
                raise
            self.share(uid.raw + world.to_bytes(8, "little"), timeout_s)
        else:
            blob = self.share(None, timeout_s)
            uid = UniqueId(blob[:UNIQUE_ID_BYTES])
            world = int.from_bytes(blob[UNIQUE_ID_BYTES:], "little")
            if not world:
                raise RendezvousError("process 0 could not reach the vLLM servers; see its error")
        c = self.config
        # What the workers are told; raises alike everywhere if no room is left for them.
        self.init_info = InitInfo(nccl_unique_id_b64=uid.to_b64(), rank_offset=n,
                                  world_size=world, packed=c.packed,
                                  packed_buffer_size_bytes=c.buffer_size_bytes,
                                  packed_num_buffers=c.num_buffers)
        if self.process == 0:
            return connect(self.clients, device=self.device, workers=workers, trainer_ranks=n,
                           unique_id=uid, timeout=timeout_s, packed=c.packed,
                           packed_buffer_size_bytes=c.buffer_size_bytes,
                           packed_num_buffers=c.num_buffers,
                           use_load_plan=self.metadata is not None, metadata=self.metadata)
        if self.rank is None:
            return None
        comm = handshake(world, uid, self.rank, self.device, timeout=timeout_s)
        return Connection(comm, [], [self.init_info], self.device, uid)
