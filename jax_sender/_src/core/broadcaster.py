"""Pipelined broadcast of JAX arrays: packed chunks or one tensor at a time.

Packing is device-to-device async copies into staging *slots* taken from
XLA's own pool, on a copy stream of its own, while NCCL broadcasts earlier
chunks on another stream. There are ``num_buffers`` slots, each the size of
the largest multi-tensor chunk, used in turn: chunk *k* goes to slot
*k mod n*, and its copies wait, on the GPU, for the broadcast that last read
that slot. The host never waits on a broadcast in the middle of a chunk, and
no chunk ever lands on bytes still being sent (a ring of uneven chunks made
the host wait in most chunks of a large push). A chunk that is a
single tensor (any tensor larger than the buffer) is broadcast straight from
the JAX buffer, with no copy. At most ``num_buffers`` broadcasts are in
flight. Extra device memory: ``num_buffers`` x the largest multi-tensor
chunk (each at most the buffer size plus its last tensor), as vLLM's own
packed sender allocates. Chunks that XLA packs itself (``packing.py``) are
broadcast from XLA's output instead (``produced``), within the same bound:
XLA writes each into a buffer whose broadcast is done, kept from push to
push.

Ordering with JAX: every source array is ready before its pointer is used
(the caller's ``get`` waits for it), and stays referenced until the work
that reads it has finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from nccl_cffi import NCCL_TYPES, Communicator, cuda, poll_until
from nccl_cffi.waiting import Check

from .tensors.plan import Chunk, TensorMeta

# One broadcast as the workers expect it: (element count, ncclDataType_t, bytes).
Part = tuple[int, int, int]
# The array a completed round sends for its part k (see ``Broadcaster.complete``).
Fill = Callable[[int], jax.Array]
Get = Callable[[int], jax.Array]
Make = Callable[[int, "jax.Array | None"], jax.Array]  # chunk k, a buffer it may write into
UINT8 = NCCL_TYPES["uint8"][0]


def buffer_pointer(array: jax.Array) -> int:
    """Device address of a ready, single-device JAX array."""
    return int(array.unsafe_buffer_pointer())


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

    def release(self) -> None:
        self._array, self.capacity, self.ptr = None, 0, 0


@dataclass
class _InFlight:
    event: cuda.Event
    keep: list[Any] = field(default_factory=list)
    spare: jax.Array | None = None  # a buffer ``produced`` may write into once this is done


class Broadcaster:
    """Owns the streams, events and slots of one sender; reused across sends.

    ``temporaries``: the arrays ``get`` returns may be transform outputs or
    gathered copies that nothing else holds; they are then kept only until
    copied, which bounds their memory to one chunk.
    """

    def __init__(self, comm: Communicator, device: jax.Device, buffer_size: int,
                 num_buffers: int):
        self.comm = comm
        self.buffer_size = buffer_size
        self.ordinal = comm.device
        self.num_buffers = num_buffers
        self.copy_stream = cuda.Stream(self.ordinal)
        self.nccl_stream = cuda.Stream(self.ordinal)
        self.arena = Arena(device)
        self._pool: list[cuda.Event] = []
        self._inflight: deque[_InFlight] = deque()
        self._spares: list[jax.Array] = []  # ``produced``'s chunk buffers, their broadcasts done
        self._slot_free: list[cuda.Event] = []  # per slot: after the broadcast that read it
        self._slot_used: list[bool] = []
        self.started = 0.0  # perf_counter() at this pass's first broadcast launch
        self.host_s = 0.0  # this pass's host time getting and packing tensors
        # The link's own time (GPU clock), from the end of the first broadcast of
        # a pass to the end of its last, and the bytes sent in it: the first
        # broadcast also waits for the receivers to join (their HTTP call).
        self._marks = (cuda.Event(self.ordinal, timing=True),
                       cuda.Event(self.ordinal, timing=True))
        self._launched: list[int] = []
        self.link_s = 0.0
        self.link_bytes = 0

    def close(self) -> None:
        """Destroy every event and stream and give the slots back to XLA."""
        for e in [f.event for f in self._inflight] + self._pool + self._slot_free + list(self._marks):
            e.close()
        self._inflight.clear()
        self._pool.clear()
        self._slot_free.clear()
        self._slot_used.clear()
        self._spares.clear()
        self.copy_stream.close()
        self.nccl_stream.close()
        self.arena.release()

    # -- events and the in-flight window --------------------------------
    def _record(self, stream: cuda.Stream) -> cuda.Event:
        ev = self._pool.pop() if self._pool else cuda.Event(self.ordinal)
        return ev.record(stream)

    def _retire_oldest(self, timeout: float | None, check: Check) -> None:
        f = self._inflight.popleft()
        self.comm.wait_event(f.event, timeout, "broadcast", check)
        self._pool.append(f.event)
        if f.spare is not None:
            self._spares = [f.spare, *self._spares][:self.num_buffers]

    def _window(self, size: int, timeout: float | None, check: Check) -> None:
        while len(self._inflight) >= size:
            self._retire_oldest(timeout, check)

    def drain(self, timeout: float | None, check: Check) -> None:
        if len(self._launched) > 1:
            self._marks[1].record(self.nccl_stream)
        while self._inflight:
            self._retire_oldest(timeout, check)
        if len(self._launched) > 1:  # recorded after the last broadcast's own event
            self.comm.wait_event(self._marks[1], timeout, "broadcast", check)
            self.link_s = self._marks[0].elapsed_s(self._marks[1])
            self.link_bytes = sum(self._launched[1:])

    @property
    def launched(self) -> int:
        """Broadcasts launched in the current pass."""
        return len(self._launched)

    def _begin(self) -> None:
        cuda.use_device(self.ordinal)  # NCCL and the copies run on this thread's device
        self.started, self.host_s, self.link_s, self.link_bytes = 0.0, 0.0, 0.0, 0
        self._launched = []

    def _launch(self, ptr: int, count: int, nccl_dtype: int, root: int, nbytes: int,
                keep: list[Any], timeout: float | None, check: Check,
                spare: jax.Array | None = None) -> None:
        self.started = self.started or time.perf_counter()
        self.comm.launch_broadcast(ptr, count, nccl_dtype, root, self.nccl_stream.handle,
                                   timeout)
        self._launched.append(nbytes)
        if len(self._launched) == 1:
            self._marks[0].record(self.nccl_stream)
        self._inflight.append(_InFlight(self._record(self.nccl_stream), keep, spare))
        check()

    def _slots(self, count: int, size: int) -> None:
        self.arena.ensure(count * size)
        while len(self._slot_free) < count:
            self._slot_free.append(cuda.Event(self.ordinal))
            self._slot_used.append(False)

    # -- modes ----------------------------------------------------------
    def packed(self, metas: Sequence[TensorMeta], chunks: Sequence[Chunk], get: Get,
               root: int, *, timeout: float | None, check: Check,
               temporaries: bool = True) -> None:
        """Broadcast ``chunks`` of the tensors ``get(i)`` as vLLM's packed consumer expects."""
        self._begin()
        multi = [c for c in chunks if not c.single]
        slot = max((c.nbytes for c in multi), default=0)
        nslots = min(self.num_buffers, len(multi))
        self._slots(nslots, slot)
        k = 0
        for c in chunks:
            self._window(self.num_buffers, timeout, check)
            t = time.perf_counter()
            if c.single:
                arr = get(c.start)
                self.host_s += time.perf_counter() - t
                self._launch(buffer_pointer(arr), c.nbytes, UINT8, root, c.nbytes, [arr],
                             timeout, check)
                continue
            s, k = k % nslots, k + 1
            base = self.arena.ptr + s * slot
            if self._slot_used[s]:  # on the GPU: after the broadcast that last read it
                self.copy_stream.wait_event(self._slot_free[s])
            sources = []
            for i, off in zip(range(c.start, c.stop), c.offsets):
                arr = get(i)
                if metas[i].nbytes:
                    cuda.copy_async(base + off, buffer_pointer(arr), metas[i].nbytes,
                                    self.copy_stream)
                sources.append(arr)
            self.host_s += time.perf_counter() - t
            copied = self._record(self.copy_stream)
            self.nccl_stream.wait_event(copied)
            self._launch(base, c.nbytes, UINT8, root, c.nbytes, [] if temporaries else sources,
                         timeout, check)
            self._slot_free[s].record(self.nccl_stream)
            self._slot_used[s] = True
            if temporaries:  # free them once copied (they may be all nothing else holds)
                self.comm.wait_event(copied, timeout, "packing copy", check)
            self._pool.append(copied)
            del sources
        self.drain(timeout, check)

    def produced(self, chunks: Sequence[Chunk], make: Make, root: int, *,
                 timeout: float | None, check: Check, reuse: bool = False) -> None:
        """Broadcast chunks whose bytes XLA writes (``packing.py``): ``make(k,
        spare)`` returns chunk ``k`` dispatched, not waited for.

        Chunks are made ahead of their broadcast while fewer than
        ``num_buffers`` are alive (made, in flight, or spare), so XLA packs
        the next chunk while NCCL sends this one, and the extra memory stays
        within the slots' bound. The host waits once per chunk, for XLA's
        result. With ``reuse``, each chunk of several tensors becomes, once
        its broadcast is done, a ``spare``: handed to ``make`` for a later
        chunk of the same size (or the next push's), which writes into it
        in place instead of allocating. Without, ``spare`` is always None.
        """
        self._begin()
        ahead = _Ahead(self, chunks, make)
        for c in chunks:
            arr = ahead.next(timeout, check)
            t = time.perf_counter()
            poll_until(arr.is_ready, timeout, check=check, on_timeout=lambda: TimeoutError(
                f"XLA did not finish packing a chunk within {timeout}s"))
            self.host_s += time.perf_counter() - t
            self._launch(buffer_pointer(arr), c.nbytes, UINT8, root, c.nbytes, [arr], timeout,
                         check, arr if reuse and not c.single else None)
        self.drain(timeout, check)

    def unpacked(self, metas: Sequence[TensorMeta], get: Get, root: int, *,
                 timeout: float | None, check: Check) -> None:
        """One broadcast per tensor, straight from its JAX buffer, in its own dtype."""
        self._begin()
        window = max(self.num_buffers, 8)
        for i, m in enumerate(metas):
            self._window(window, timeout, check)
            t = time.perf_counter()
            arr = get(i)
            self.host_s += time.perf_counter() - t
            self._launch(buffer_pointer(arr), m.numel, NCCL_TYPES[m.dtype][0], root, m.nbytes,
                         [arr], timeout, check)
        self.drain(timeout, check)

    def scratch(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                check: Check, fill: Fill | None = None) -> None:
        """Broadcasts of ``parts`` from (or, off the root, into) scratch bytes,
        or from ``fill(k)`` where it gives an array for part ``k``.

        Off the root: take part in another trainer rank's turn and drop what
        arrives (every group member must join each broadcast). On the root:
        send bytes that carry no weights, which completes a round the
        workers were told to expect after the trainer failed to produce its
        bytes (see ``complete``)."""
        self._begin()
        self.arena.ensure(max((nbytes for _, _, nbytes in parts), default=0))
        for k, (count, code, nbytes) in enumerate(parts):
            self._window(self.num_buffers, timeout, check)
            arr = None if fill is None else fill(k).block_until_ready()
            ptr = self.arena.ptr if arr is None else buffer_pointer(arr)
            self._launch(ptr, count, code, root, nbytes, [] if arr is None else [arr], timeout,
                         check)
        self.drain(timeout, check)

    def complete(self, parts: Sequence[Part], root: int, *, timeout: float | None,
                 check: Check, fill: Fill | None = None) -> None:
        """After a pass over ``parts`` failed on the trainer's side (a
        transform raised, XLA failed or overran its deadline), send what the
        workers still expect of it: the broadcasts not launched yet, from
        scratch bytes (or ``fill(k)`` for part ``k``, where the workers'
        loader needs more than bytes). First every broadcast and copy in
        flight ends (the scratch bytes may be reallocated, and nothing may be
        freed under a copy or a broadcast), each wait with ``timeout``."""
        done = len(self._launched)
        copies = self._record(self.copy_stream)
        try:
            self.comm.wait_event(copies, timeout, "packing copy", check)
        finally:
            self._pool.append(copies)
        self.drain(timeout, check)
        self.scratch(parts[done:], root, timeout=timeout, check=check,
                     fill=None if fill is None else lambda k: fill(done + k))


class _Ahead:
    """The chunks ``Broadcaster.produced`` makes ahead of their broadcasts:
    while fewer than ``num_buffers`` buffers are alive (made, in flight, or
    spare), or a spare of the right size is at hand."""

    def __init__(self, b: Broadcaster, chunks: Sequence[Chunk], make: Make):
        self.b, self.chunks, self.make = b, chunks, make
        self.ahead: deque[jax.Array] = deque()
        self.made = 0

    def next(self, timeout: float | None, check: Check) -> jax.Array:
        """The next chunk to broadcast (dispatched), after making what may be
        made; with nothing made, room is made first."""
        while True:
            if self._can_make():
                spare = self._spare_for(self.made)
                self.b._spares = [a for a in self.b._spares if a is not spare]
                self.ahead.append(self.make(self.made, spare))
                self.made += 1
            elif self.ahead:
                return self.ahead.popleft()
            else:
                self._free_one(timeout, check)

    def _spare_for(self, k: int) -> jax.Array | None:
        c = self.chunks[k]
        return None if c.single else next(
            (a for a in self.b._spares if a.nbytes == c.nbytes), None)

    def _can_make(self) -> bool:
        alive = len(self.ahead) + len(self.b._inflight) + len(self.b._spares)
        return self.made < len(self.chunks) and (alive < self.b.num_buffers
                                                 or self._spare_for(self.made) is not None)

    def _free_one(self, timeout: float | None, check: Check) -> None:
        """Make room for one buffer: drop a spare no chunk left needs, else
        wait for the oldest broadcast, else drop the spare needed last."""
        b = self.b
        needed = [c.nbytes for c in self.chunks[self.made:] if not c.single]
        useless = [a for a in b._spares if a.nbytes not in needed]
        if useless or not b._inflight:
            drop = useless[0] if useless else max(b._spares, key=lambda a: needed.index(a.nbytes))
            b._spares = [a for a in b._spares if a is not drop]
        else:
            b._retire_oldest(timeout, check)


def parts_of(metas: Sequence[TensorMeta], chunks: Sequence[Chunk] | None) -> list[Part]:
    """The broadcasts a worker expects for ``metas``: one ``uint8`` broadcast
    per packed chunk, or (``chunks`` None) one per tensor in its own dtype."""
    if chunks is not None:
        return [(c.nbytes, UINT8, c.nbytes) for c in chunks]
    return [(m.numel, NCCL_TYPES[m.dtype][0], m.nbytes) for m in metas]
