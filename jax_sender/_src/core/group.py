"""Several trainer processes: forming their transfer group, and the
gathers of parameters sharded across them.

Multi-host JAX runs one process per host over global arrays. Who
broadcasts what is planned in ``turns.py``; here, the group is formed
(process 0 mints the id and shares it with the world size through JAX, the
other broadcasters join as group ranks 1..), and a parameter sharded over
several processes is gathered on its first owner, every owner taking part
in the same order. Processes outside the group hold no communicator and
only run the gathers of the parameters they co-own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from nccl_cffi import DEFAULT_INIT_TIMEOUT, Deadline, await_future, in_background, poll_until
from nccl_cffi.waiting import no_check
from uniqueid import (
    NCCL_JOIN,
    UNIQUE_ID_BYTES,
    Connection,
    InitInfo,
    Joiner,
    RendezvousError,
    RendezvousTimeout,
    UniqueId,
    VLLMClient,
    connect,
    world_sizes,
)

from .config import SendConfig
from .errors import GatherTimeout
from .turns import BroadcastPlan, Turn, owners_of

# ``share(data, timeout_s)``: process 0 passes bytes, every other process None; all get
# process 0's, or a ``RendezvousTimeout`` after ``timeout_s``.
Share = Callable[[bytes | None, float], bytes]


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
    poll_until(array.is_ready, timeout, on_timeout=lambda: GatherTimeout(
        f"{what} did not complete within {timeout}s: another owner of it did not take part "
        "(it failed or is not sending); every owner must send together"))
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

    shared = in_background(broadcast, name="share-from-process-0")
    if not await_future(shared, time.monotonic() + timeout):
        raise RendezvousTimeout(
            f"the trainer processes did not all reach connect_group within {timeout}s: "
            "every process must call it (and reconnect) together")
    return shared.result()


@dataclass(kw_only=True)
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
    joiner: Joiner = NCCL_JOIN
    init_info: InitInfo | None = None

    @property
    def rank(self) -> int | None:
        return self.plan.group_rank(self.process)

    def form(self, timeout_s: float) -> Connection | None:
        """Process 0 mints a fresh id, shares it with the world size, and forms the
        group with the servers; the other broadcasters join with it; every other
        process gets None. Every process must call this together; the whole
        call (the sharing included) ends within ``timeout_s``. Each broadcaster
        checks it can join before the id is shared, so no server is told to
        wait for a process that then cannot come."""
        deadline = Deadline(timeout_s)
        n = len(self.plan.group)
        if self.process == 0:
            try:
                self.joiner.preflight(self.device)
                workers = world_sizes(self.clients, self.workers, deadline)
                uid = self.joiner.mint()
            except BaseException:
                self.share(bytes(UNIQUE_ID_BYTES + 8), deadline.left())  # world 0: the others raise
                raise
            world = n + sum(workers)
            self.share(uid.raw + world.to_bytes(8, "little"), deadline.left())
        else:
            if self.rank is not None:
                self.joiner.preflight(self.device)
            blob = self.share(None, deadline.left())
            uid = UniqueId(blob[:UNIQUE_ID_BYTES])
            world = int.from_bytes(blob[UNIQUE_ID_BYTES:], "little")
            if not world:
                raise RendezvousError("process 0 could not reach the vLLM servers; see its error")
        # What the workers are told; raises alike everywhere if no room is left for them.
        self.init_info = InitInfo(nccl_unique_id_b64=uid.to_b64(), rank_offset=n,
                                  world_size=world, **self.config.wire())
        if self.process == 0:
            return connect(self.clients, device=self.device, workers=workers, trainer_ranks=n,
                           unique_id=uid, timeout=deadline.left(), joiner=self.joiner,
                           use_load_plan=self.metadata is not None, metadata=self.metadata,
                           **self.config.wire())
        if self.rank is None:
            return None
        comm = self.joiner.join(world, uid, self.rank, self.device, timeout=deadline.left(),
                                check=no_check)
        return Connection(comm, [], [self.init_info], self.device, uid)

