"""An M2N push's data plane: one NCCL M2N reshard per parameter, each from
this trainer rank's block straight into the workers' shards.

Each reshard reads this process's block of one parameter (``get(k)``,
ready on the sending device) and is enqueued on a stream of its own; the
library reads the block asynchronously, so a block is kept alive until the
event recorded after its reshard is done. At most ``window`` reshards (and
``budget`` bytes of blocks) are in flight: blocks that are transform
outputs or assembled from several devices are temporaries, and that bounds
them. A failure on the trainer's side completes the round from scratch
bytes (``complete``), as the broadcast path does: the workers wait inside
the library for every parameter the round named.

It offers what ``push.Transaction`` asks of a broadcaster (``Broadcasts``),
so an M2N push runs through the same transaction, session, deadlines and
failure handling as a broadcast push.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from nccl_cffi import cuda
from nccl_cffi.m2n import DistTensor
from nccl_cffi.waiting import Check

from ..core.broadcaster import Arena, buffer_pointer

Get = Callable[[int], jax.Array]


@dataclass(frozen=True, kw_only=True)
class ReshardPart:
    """One parameter's reshard as every rank describes it.

    Attributes:
        name: its checkpoint name (for messages).
        src: this rank's source side, its pointer still 0.
        dst: the destination side (pointer 0: a trainer rank receives nothing).
        nbytes: this rank's block, in bytes.
    """

    name: str
    src: DistTensor
    dst: DistTensor
    nbytes: int


class Resharder:
    """The stream, events and scratch bytes of one M2N sender; reused across pushes.

    Args:
        plane: the group's data plane (``uniqueid.m2n.M2NPlane``: a
            communicator and an M2N handle).
        device: the JAX device the blocks are sent from.
        window: reshards in flight at most.
        budget: bytes of blocks in flight at most (one is always allowed).
    """

    def __init__(self, plane: Any, device: jax.Device, *, window: int, budget: int):
        self.plane = plane
        self.ordinal = plane.comm.device
        self.window = max(window, 1)
        self.budget = budget
        self.stream = cuda.Stream(self.ordinal)
        self.arena = Arena(device)
        self._inflight: deque[tuple[cuda.Event, jax.Array | None, int]] = deque()
        self._marks = (cuda.Event(self.ordinal, timing=True), cuda.Event(self.ordinal, timing=True))
        self._launched: list[int] = []
        self.started = 0.0
        self.host_s = 0.0
        self.link_s = 0.0
        self.link_bytes = 0
        plane.idle = self.idle  # the handle is released only once no reshard runs

    def idle(self) -> bool:
        """Whether every reshard enqueued has finished on the GPU."""
        return all(event.done() for event, _, _ in self._inflight)

    def close(self) -> None:
        """Destroy the stream and events and give the scratch bytes back to XLA."""
        for event, _, _ in self._inflight:
            event.close()
        self._inflight.clear()
        for mark in self._marks:
            mark.close()
        self.stream.close()
        self.arena.release()

    def _begin(self) -> None:
        cuda.use_device(self.ordinal)
        self.started, self.host_s, self.link_s, self.link_bytes = 0.0, 0.0, 0.0, 0
        self._launched = []

    def _retire_oldest(self, timeout: float | None, check: Check) -> None:
        event, _, _ = self._inflight.popleft()
        try:
            self.plane.comm.wait_event(event, timeout, "reshard", check)
        finally:
            event.close()

    def _make_room(self, nbytes: int, timeout: float | None, check: Check) -> None:
        while self._inflight and (len(self._inflight) >= self.window or sum(
                n for _, _, n in self._inflight) + nbytes > self.budget):
            self._retire_oldest(timeout, check)

    def _launch(self, part: ReshardPart, ptr: int, keep: jax.Array | None,
                timeout: float | None, check: Check) -> None:
        self.started = self.started or time.perf_counter()
        self.plane.reshard(replace(part.src, ptr=ptr), part.dst, self.stream.handle)
        self._launched.append(part.nbytes)
        if len(self._launched) == 1:
            self._marks[0].record(self.stream)
        self._inflight.append((cuda.Event(self.ordinal).record(self.stream), keep, part.nbytes))
        check()

    def drain(self, timeout: float | None, check: Check) -> None:
        """Wait for every reshard in flight; time the pass on the GPU's clock."""
        if len(self._launched) > 1:
            self._marks[1].record(self.stream)
        while self._inflight:
            self._retire_oldest(timeout, check)
        if len(self._launched) > 1:
            self.plane.comm.wait_event(self._marks[1], timeout, "reshard", check)
            self.link_s = self._marks[0].elapsed_s(self._marks[1])
            self.link_bytes = sum(self._launched[1:])

    def reshards(self, parts: Sequence[ReshardPart], get: Get, *, timeout: float | None,
                 check: Check) -> None:
        """One reshard per part, from this rank's block ``get(k)`` (ready).

        Args:
            parts: the round's parameters, in the order it names them.
            get: part ``k``'s block on the sending device, ready.
            timeout: one wait's deadline.
            check: polled while waiting.
        """
        self._begin()
        for k, part in enumerate(parts):
            self._make_room(part.nbytes, timeout, check)
            t = time.perf_counter()
            block = get(k)
            self.host_s += time.perf_counter() - t
            self._launch(part, buffer_pointer(block), block, timeout, check)
        self.drain(timeout, check)

    def scratch(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                check: Check, fill: Any = None) -> None:
        """Every reshard of ``parts`` from scratch bytes (this rank's part of
        a round whose own blocks could not be made).

        Args:
            parts: the parameters.
            root: unused (every trainer rank sends its own block).
            timeout: one wait's deadline.
            check: polled while waiting.
            fill: unused (scratch bytes are what a reshard takes).
        """
        self._begin()
        self.arena.ensure(max((p.nbytes for p in parts), default=0))
        for part in parts:
            self._make_room(0, timeout, check)
            self._launch(part, self.arena.ptr, None, timeout, check)
        self.drain(timeout, check)

    def complete(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                 check: Check, fill: Any = None) -> None:
        """After a pass failed on the trainer's side, the reshards the workers
        still expect of it, from scratch bytes, once those in flight ended.

        Args:
            parts: the round's parameters.
            root: unused.
            timeout: one wait's deadline.
            check: polled while waiting.
            fill: unused.
        """
        done = len(self._launched)
        self.drain(timeout, check)
        self.scratch(parts[done:], root, timeout=timeout, check=check)


Part = ReshardPart


@dataclass(frozen=True, kw_only=True)
class Reshards:
    """A round's feed: this rank's block of each parameter, resharded."""

    parts: Sequence[ReshardPart]
    get: Get

    def __call__(self, r: Resharder, timeout: float, check: Check) -> None:
        r.reshards(self.parts, self.get, timeout=timeout, check=check)
