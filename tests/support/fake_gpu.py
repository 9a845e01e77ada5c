"""A stand-in for the GPU under ``jax_sender._src.core.broadcaster.Broadcaster``:
its CUDA streams, events and device-to-device copies, and its communicator's
broadcasts, run on JAX's CPU buffers.

The rules are CUDA's, as far as the Broadcaster relies on them:

* work on one stream runs in order; ``stream.wait_event(e)`` makes the
  stream's later work start only after the work ``e`` was recorded after;
* an event is done once its stream ran up to where it was recorded, and
  the host learns it only by waiting for it (``comm.wait_event``);
* a broadcast reads its bytes at some time between its start and its end;
  a copy reads its source and writes its destination when it runs;
* device memory is valid while the array that owns it lives (``Memory``).

What CUDA leaves open, *when* work runs, is chosen adversarially, two ways
(``late``):

* **early**: copies run as soon as their stream's waits allow; a broadcast
  starts at its launch, once what its stream waits for has run, reading
  its bytes (``data``), and ends only when something waits for it, when
  it reads them again: bytes written while it is in flight (a slot reused
  too soon) show up as a change, and a copy into the bytes of a broadcast
  in flight is reported as it happens.
* **late**: nothing runs until something waits for it (the host, or
  another stream), and then in stream order; a broadcast reads its bytes
  when it runs. A broadcast launched before its chunk's copies, a source
  freed before its copy ran, a buffer freed under a pending copy: each
  leaves wrong bytes (a copy from freed memory writes 0xEE) or a problem.

Everything that breaks a rule lands in ``problems``; a test asserts it
stays empty, after ``synchronize()`` has run whatever was left.
"""

from __future__ import annotations

import ctypes
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

from nccl_cffi.dtypes import NCCL_TYPES

ITEMSIZE = {code: size for code, size, _ in NCCL_TYPES.values()}
GARBAGE = 0xEE  # what a copy from freed memory writes
RECEIVED = 0xAB  # what a broadcast received off the root writes


class Memory:
    """The device buffers alive: each array's range, for as long as the
    array lives (and is not donated)."""

    def __init__(self) -> None:
        self._buffers: list[tuple[int, int, weakref.ref]] = []

    def add(self, array: Any) -> Any:
        """Register ``array``'s buffer as valid memory; returns ``array``."""
        if array.nbytes and not any(ref() is array for _, _, ref in self._buffers):
            self._buffers = [b for b in self._buffers if self._alive(b[2])]
            self._buffers.append((int(array.unsafe_buffer_pointer()), array.nbytes,
                                  weakref.ref(array)))
        return array

    @staticmethod
    def _alive(ref: weakref.ref) -> bool:
        a = ref()
        return a is not None and not a.is_deleted()

    def valid(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one live buffer."""
        return nbytes == 0 or any(p <= ptr and ptr + nbytes <= p + n and self._alive(ref)
                                  for p, n, ref in self._buffers)


@dataclass(eq=False)
class Wait:
    """``stream.wait_event``: the work of ``stream`` up to ``mark`` runs first."""

    stream: FakeStream
    mark: int
    done: bool = False


@dataclass(eq=False)
class Copy:
    dst: int
    src: int
    nbytes: int


@dataclass(eq=False)
class Broadcast:
    """One ``launch_broadcast``: what it was given, what it read, and the
    state of the GPU when it was launched."""

    index: int
    ptr: int
    count: int
    dtype: int
    root: int
    stream: int  # the handle it was launched on
    nbytes: int
    in_flight: int  # broadcasts launched and not yet known done, itself included
    pending_copies: int  # copies enqueued and not yet run, at its launch
    data: bytes | None = None  # what it read (sending), once started
    started: bool = False
    done: bool = False


class FakeStream:
    def __init__(self, gpu: FakeGPU, device: int):
        self.gpu, self.device = gpu, device
        self.handle = 0x5000 + 0x10 * len(gpu.streams)
        self.ops: list[Wait | Copy | Broadcast] = []
        self.ran = 0
        self.closed = 0

    def wait_event(self, event: FakeEvent) -> None:
        if event.stream is not None:  # an event never recorded is done (CUDA)
            self.ops.append(Wait(event.stream, event.mark))
            self.gpu._enqueued(self)

    def close(self) -> None:
        self.closed += 1


class FakeEvent:
    def __init__(self, gpu: FakeGPU, device: int, timing: bool):
        self.gpu, self.device, self.timing = gpu, device, timing
        self.stream: FakeStream | None = None
        self.mark = 0
        self.closed = 0

    def record(self, stream: FakeStream) -> FakeEvent:
        self.stream, self.mark = stream, len(stream.ops)
        return self

    def done(self) -> bool:
        return self.stream is None or self.stream.ran >= self.mark

    def elapsed_s(self, later: FakeEvent) -> float:
        if not (self.timing and later.timing and self.done() and later.done()):
            self.gpu.problems.append("elapsed_s between events not both timing and done")
        return self.gpu.elapsed_s

    def close(self) -> None:
        self.closed += 1


class FakeGPU:
    """One device: streams, events, copies and broadcasts, scheduled
    ``late`` or early (see the module docstring). ``rank``: the
    communicator's; a broadcast from another root receives."""

    def __init__(self, *, late: bool, rank: int = 0):
        self.late, self.rank = late, rank
        self.memory = Memory()
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.broadcasts: list[Broadcast] = []
        self.host_waits: list[str] = []  # ``what`` of each comm.wait_event
        self.problems: list[str] = []
        self.elapsed_s = 0.25
        self.on_launch = lambda b: None  # called at each launch, with its Broadcast

    def cuda(self) -> Any:
        """The ``cuda`` module's names that ``broadcaster.py`` uses."""
        return types.SimpleNamespace(Stream=self._stream, Event=self._event,
                                     use_device=lambda ordinal: None, copy_async=self.copy_async)

    def _stream(self, device: int) -> FakeStream:
        self.streams.append(FakeStream(self, device))
        return self.streams[-1]

    def _event(self, device: int, *, timing: bool = False) -> FakeEvent:
        self.events.append(FakeEvent(self, device, timing))
        return self.events[-1]

    # -- enqueueing --------------------------------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: FakeStream) -> None:
        stream.ops.append(Copy(dst, src, nbytes))
        self._enqueued(stream)

    def _enqueued(self, stream: FakeStream) -> None:
        """Early: a stream of copies runs what it can at once."""
        if not self.late and not any(isinstance(op, Broadcast) for op in stream.ops[stream.ran:]):
            self.run(stream, len(stream.ops))

    def launch(self, ptr: int, count: int, dtype: int, root: int, handle: int) -> None:
        stream = next((s for s in self.streams if s.handle == handle), None)
        if stream is None:
            self.problems.append(f"broadcast launched on {handle:#x}, not a stream of this GPU")
            return
        b = Broadcast(len(self.broadcasts), ptr, count, dtype, root, handle,
                      count * ITEMSIZE[dtype], self.in_flight() + 1, self.pending_copies())
        self.broadcasts.append(b)
        stream.ops.append(b)
        if not self.late:  # starts now, once what its stream waits for has run
            for op in stream.ops[stream.ran:]:
                if isinstance(op, Wait) and not op.done:
                    op.done = True
                    self.run(op.stream, op.mark)
            self._start(b)
        self.on_launch(b)

    # -- running --------------------------------------------------------------
    def run(self, stream: FakeStream, upto: int) -> None:
        """Run ``stream``'s work up to position ``upto``, in order."""
        while stream.ran < upto:
            op = stream.ops[stream.ran]
            stream.ran += 1
            if isinstance(op, Wait):
                if not op.done:
                    op.done = True
                    self.run(op.stream, op.mark)
            elif isinstance(op, Copy):
                self._copy(op)
            else:
                self._start(op)
                self._end(op)

    def host_wait(self, event: FakeEvent, what: str) -> None:
        """The host waits for ``event``: the work before it runs."""
        self.host_waits.append(what)
        if event.stream is not None:
            self.run(event.stream, event.mark)

    def synchronize(self) -> None:
        """Run everything left (the end of a test)."""
        while any(s.ran < len(s.ops) for s in self.streams):
            for s in self.streams:
                self.run(s, len(s.ops))

    def in_flight(self) -> int:
        return sum(not b.done for b in self.broadcasts)

    def pending_copies(self) -> int:
        return sum(isinstance(op, Copy) for s in self.streams for op in s.ops[s.ran:])

    def _start(self, b: Broadcast) -> None:
        if b.started:
            return
        b.started = True
        if not self.memory.valid(b.ptr, b.nbytes):
            self.problems.append(f"broadcast {b.index} started on freed memory")
        elif b.root == self.rank:
            b.data = ctypes.string_at(b.ptr, b.nbytes)

    def _end(self, b: Broadcast) -> None:
        b.done = True
        if not self.memory.valid(b.ptr, b.nbytes):
            self.problems.append(f"broadcast {b.index} ended on freed memory")
        elif b.root != self.rank:
            ctypes.memset(b.ptr, RECEIVED, b.nbytes)
        elif b.data is not None and ctypes.string_at(b.ptr, b.nbytes) != b.data:
            self.problems.append(f"broadcast {b.index}: its bytes changed while in flight")

    def _copy(self, c: Copy) -> None:
        for b in self.broadcasts:
            if b.started and not b.done and c.dst < b.ptr + b.nbytes and b.ptr < c.dst + c.nbytes:
                self.problems.append(f"a copy wrote into the bytes of broadcast {b.index} "
                                     "while it was in flight")
        if not self.memory.valid(c.dst, c.nbytes):
            self.problems.append("a copy wrote into freed memory")
        elif self.memory.valid(c.src, c.nbytes):
            ctypes.memmove(c.dst, c.src, c.nbytes)
        else:
            ctypes.memset(c.dst, GARBAGE, c.nbytes)


@dataclass
class FakeComm:
    """The communicator a ``Broadcaster`` drives, over ``gpu``."""

    gpu: FakeGPU
    device: int = 0
    timeouts: list[float | None] = field(default_factory=list)

    def launch_broadcast(self, ptr: int, count: int, dtype: int, root: int, stream: int,
                         timeout: float | None) -> None:
        self.timeouts.append(timeout)
        self.gpu.launch(ptr, count, dtype, root, stream)

    def wait_event(self, event: FakeEvent, timeout: float | None, what: str = "collective",
                   check: Any = None) -> None:
        self.timeouts.append(timeout)
        if check is not None:
            check()
        self.gpu.host_wait(event, what)
