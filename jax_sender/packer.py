"""Pipelined broadcast of JAX arrays: packed chunks or one tensor at a time.

Packing is device-to-device async copies into a persistent ring of bytes
taken from XLA's own pool, on a copy stream of its own, while NCCL
broadcasts earlier chunks on another stream. A chunk that is a single
tensor (any tensor larger than the buffer) is broadcast straight from the
JAX buffer, with no copy. At most ``num_buffers`` chunks are in flight; the
ring never hands out bytes that a pending broadcast still reads.

Ordering with JAX: every source array is ``block_until_ready()`` before its
pointer is used (an explicit ready wait, so no cross-stream event from XLA is
needed), and stays referenced until the work that reads it has finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from nccl_cffi import Communicator, cuda

from .plan import Chunk, TensorMeta

Check = Callable[[], None]


def buffer_pointer(array: jax.Array) -> int:
    """Device address of a ready, single-device JAX array."""
    return int(array.unsafe_buffer_pointer())


def overlap(lo: int, hi: int, regions: Sequence[tuple[int, int]]) -> int:
    """Bytes of [lo, hi) inside ``regions``."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in regions)


def place(capacity: int, head: int, nbytes: int, busy: Sequence[tuple[int, int]]) -> int:
    """Where a chunk of ``nbytes`` goes in the ring: right after the previous
    chunk (``head``) if it fits, else at whichever end of the ring overlaps
    the ``busy`` regions (chunks still being broadcast) least.

    Chunks differ in size (each overshoots the buffer by part of its last
    tensor), so always wrapping to 0 can land a chunk on the whole of the one
    being broadcast and serialise the pipeline; the far end usually overlaps
    it by a few tensors at most, and only those wait.
    """
    options = ([head] if head + nbytes <= capacity else []) + [0, capacity - nbytes]
    return min(options, key=lambda s: overlap(s, s + nbytes, busy))


class Arena:
    """Persistent device bytes, allocated through XLA so they count in its pool."""

    def __init__(self, device: jax.Device):
        self.device = device
        self.capacity = 0
        self.ptr = 0
        self._array: jax.Array | None = None

    def ensure(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self._array = None  # free the old block before asking for a larger one
        self._array = jax.device_put(jnp.zeros((capacity,), jnp.uint8), self.device)
        self._array.block_until_ready()
        self.capacity = capacity
        self.ptr = buffer_pointer(self._array)


@dataclass
class _InFlight:
    event: cuda.Event
    region: tuple[int, int] | None
    keep: list[Any] = field(default_factory=list)


class Broadcaster:
    """Owns the streams, events and arena of one sender; reused across sends."""

    def __init__(self, comm: Communicator, device: jax.Device, buffer_size: int,
                 num_buffers: int):
        self.comm = comm
        self.buffer_size = buffer_size
        self.ordinal = comm.device
        self.num_buffers = num_buffers
        self.copy_stream = cuda.Stream(self.ordinal)
        self.nccl_stream = cuda.Stream(self.ordinal)
        self.arena = Arena(device)
        self._free_events: list[cuda.Event] = []
        self._inflight: deque[_InFlight] = deque()
        self._head = 0
        self.started = 0.0  # perf_counter() at this pass's first broadcast launch
        self.host_s = 0.0  # this pass's time in getting and packing tensors (host side)

    def close(self) -> None:
        self._inflight.clear()
        for e in self._free_events:
            e.close()
        self._free_events.clear()
        self.copy_stream.close()
        self.nccl_stream.close()

    # -- events and the in-flight window --------------------------------
    def _event(self, stream: cuda.Stream) -> cuda.Event:
        ev = self._free_events.pop() if self._free_events else cuda.Event(self.ordinal)
        return ev.record(stream)

    def _retire_oldest(self, timeout: float | None, check: Check) -> None:
        f = self._inflight.popleft()
        self.comm.wait_event(f.event, timeout, "broadcast", check)
        self._free_events.append(f.event)

    def drain(self, timeout: float | None, check: Check) -> None:
        while self._inflight:
            self._retire_oldest(timeout, check)
        self._head = 0

    def _busy(self) -> list[tuple[int, int]]:
        return [f.region for f in self._inflight if f.region]

    def _free(self, lo: int, hi: int, timeout: float | None, check: Check) -> None:
        """Retire broadcasts (oldest first, as NCCL finishes them) until none reads [lo, hi)."""
        while overlap(lo, hi, self._busy()):
            self._retire_oldest(timeout, check)

    def _launch(self, ptr: int, count: int, dtype: str, root: int, region, keep,
                timeout: float | None, check: Check) -> None:
        self.started = self.started or time.perf_counter()
        self.comm.broadcast(ptr, count=count, dtype=dtype, root=root,
                            stream=self.nccl_stream, timeout=timeout)
        self._inflight.append(_InFlight(self._event(self.nccl_stream), region, keep))
        check()

    def _timed(self, get: Callable[[int], jax.Array], i: int) -> jax.Array:
        """``get(i)``, its time counted as host time."""
        t = time.perf_counter()
        arr = get(i)
        self.host_s += time.perf_counter() - t
        return arr

    # -- modes ----------------------------------------------------------
    def packed(self, metas: Sequence[TensorMeta], chunks: Sequence[Chunk],
               get: Callable[[int], jax.Array], root: int, *,
               timeout: float | None, check: Check) -> None:
        """Broadcast ``chunks`` of the tensors ``get(i)`` as vLLM's packed consumer expects."""
        self.started, self.host_s = 0.0, 0.0
        multi = [c for c in chunks if not c.single]
        if multi:
            largest = max(metas[i].nbytes for c in multi for i in range(c.start, c.stop))
            total = sum(c.nbytes for c in multi)
            # Every multi-tensor chunk is <= buffer + its last tensor, so it fits.
            self.arena.ensure(min(self.num_buffers * self.buffer_size + largest, total))
        for c in chunks:
            while len(self._inflight) >= self.num_buffers:
                self._retire_oldest(timeout, check)
            if c.single:
                arr = self._timed(get, c.start)
                self._launch(buffer_pointer(arr), c.nbytes, "uint8", root, None, [arr],
                             timeout, check)
                continue
            start = place(self.arena.capacity, self._head, c.nbytes, self._busy())
            self._head = start + c.nbytes
            # Tensors that land on free bytes are copied at once; those on bytes a
            # pending broadcast still reads wait for it, after the others.
            t = time.perf_counter()
            sources, later, busy = [], [], self._busy()  # nothing retires in this loop
            for i, off in zip(range(c.start, c.stop), c.offsets):
                arr = get(i)
                sources.append(arr)
                lo, n = start + off, metas[i].nbytes
                if overlap(lo, lo + n, busy):
                    later.append((lo, n, arr))
                elif n:
                    cuda.copy_async(self.arena.ptr + lo, buffer_pointer(arr), n,
                                    self.copy_stream)
            self.host_s += time.perf_counter() - t
            for lo, n, arr in later:
                self._free(lo, lo + n, timeout, check)
                cuda.copy_async(self.arena.ptr + lo, buffer_pointer(arr), n, self.copy_stream)
            copied = self._event(self.copy_stream)
            self.nccl_stream.wait_event(copied)
            # Enqueue the broadcast first, so NCCL's stream never waits on the host.
            self._launch(self.arena.ptr + start, c.nbytes, "uint8", root,
                         (start, start + c.nbytes), [], timeout, check)
            # The sources may be transform temporaries: free them once copied.
            self.comm.wait_event(copied, timeout, "packing copy", check)
            self._free_events.append(copied)
            del sources
        self.drain(timeout, check)

    def unpacked(self, metas: Sequence[TensorMeta], get: Callable[[int], jax.Array],
                 root: int, *, timeout: float | None, check: Check) -> None:
        """One broadcast per tensor, straight from its JAX buffer, in its own dtype."""
        self.started, self.host_s = 0.0, 0.0
        window = max(self.num_buffers, 8)
        for i, m in enumerate(metas):
            while len(self._inflight) >= window:
                self._retire_oldest(timeout, check)
            arr = self._timed(get, i)
            self._launch(buffer_pointer(arr), m.numel, m.dtype, root, None, [arr],
                         timeout, check)
        self.drain(timeout, check)

    def discard(self, metas: Sequence[TensorMeta], chunks: Sequence[Chunk] | None, root: int,
                *, timeout: float | None, check: Check) -> None:
        """Take part in another trainer rank's turn: receive its chunks (or, with
        ``chunks=None``, its tensors, each in its own dtype) into scratch bytes
        and drop them. Every group member must join each broadcast."""
        self.started, self.host_s = 0.0, 0.0
        parts = ([(c.nbytes, "uint8", c.nbytes) for c in chunks] if chunks is not None
                 else [(m.numel, m.dtype, m.nbytes) for m in metas])
        self.arena.ensure(max((nbytes for _, _, nbytes in parts), default=0))
        for count, dtype, _ in parts:
            while len(self._inflight) >= self.num_buffers:
                self._retire_oldest(timeout, check)
            self._launch(self.arena.ptr, count, dtype, root, None, [], timeout, check)
        self.drain(timeout, check)
