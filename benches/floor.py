"""The floor under a dense push: vLLM's update protocol around broadcasts
that cost the sender nothing.

Packed (the job mode ``prepacked``), each chunk is broadcast as it is from
one staging buffer, with no copies; unpacked (``preplaced``), each tensor
from that buffer, in its own dtype. The arrays are never read and the
workers load garbage. The push is what vLLM's consumer takes when a sender
costs nothing but its launches: a floor for any sender.

Why it is built here, on public names only (``uniqueid.connect``, the
``VLLMClient`` routes, ``Communicator.launch_broadcast``): a floor must not
depend on how the sender is made inside. It moves exactly what
``WeightSender`` moves for the same tensors and geometry: the same order
(``wire_order``), the same chunks (``plan_chunks``), the same
``update_info`` (full metadata once, then empty lists: "same as before"),
the same number of broadcasts in flight; and it is timed the same way
(``SendStats``: ``transfer_s`` from posting ``/update_weights`` to every
answer, ``update_s`` the call inside its own thread).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp

import uniqueid
from jax_sender import SendConfig, SendStats, TensorMeta, plan_chunks, wire_order
from nccl_cffi import NCCL_TYPES, await_future, cuda, in_background

UINT8 = NCCL_TYPES["uint8"][0]
UNPACKED_WINDOW = 8  # an unpacked push keeps at least this many broadcasts in flight
HTTP_GRACE_S = 60.0  # beyond its broadcasts' deadlines, how long /update_weights may take

# One broadcast: (element count, NCCL dtype code, bytes).
Part = tuple[int, int, int]


def _timed_update(client: uniqueid.VLLMClient, payload: dict[str, Any],
                  timeout: float) -> float:
    """``/update_weights``; the call's own time, measured in its thread."""
    t = time.perf_counter()
    client.update_weights(payload, timeout=timeout)
    return time.perf_counter() - t


class FloorSender:
    """A sender that only launches broadcasts, inside vLLM's update protocol.

    Args:
        servers: a URL, or a list of them (one broadcast feeds them all).
        config: the geometry the workers are told at init (``packed``,
            buffer size and count) and the deadlines, as ``WeightSender``'s.
        device: the JAX device whose GPU broadcasts (the staging buffer is
            allocated through XLA, so it counts in its memory figures).
    """

    def __init__(self, servers: str | Sequence[str], config: SendConfig, device: jax.Device):
        self.config, self.device = config, device
        self.ordinal = device.local_hardware_id
        self.conn = uniqueid.connect(servers, device=self.ordinal, packed=config.packed,
                                     packed_buffer_size_bytes=config.buffer_size_bytes,
                                     packed_num_buffers=config.num_buffers,
                                     timeout=config.init_timeout_s)
        self.stream = cuda.Stream(self.ordinal)
        # the link's own time: from the end of the first broadcast to the end of the last
        self.marks = (cuda.Event(self.ordinal, timing=True), cuda.Event(self.ordinal, timing=True))
        self.events: list[cuda.Event] = []  # spare, for the broadcasts in flight
        self.staging: jax.Array | None = None
        self.held: list[TensorMeta] | None = None  # what the workers hold (sent metadata)
        self.key: list[tuple[str, Any, Any]] | None = None
        self.kept: tuple[list[TensorMeta], list[Part]] = ([], [])

    def _plan(self, pairs: Sequence[tuple[str, Any]]) -> tuple[list[TensorMeta], list[Part]]:
        """The tensors in wire order and one part per broadcast, kept while the
        names, shapes and dtypes stay the same."""
        key = [(name, a.shape, a.dtype) for name, a in pairs]
        if key != self.key:
            metas = [TensorMeta.of(name, a) for name, a in pairs]
            size = self.config.buffer_size_bytes
            if self.config.packed:
                metas = [metas[i] for i in wire_order(metas, size)]
                parts = [(c.nbytes, UINT8, c.nbytes) for c in plan_chunks(metas, size)]
            else:
                parts = [(m.numel, NCCL_TYPES[m.dtype][0], m.nbytes) for m in metas]
            self.key, self.kept = key, (metas, parts)
        return self.kept

    def send(self, pairs: Sequence[tuple[str, Any]]) -> SendStats:
        """One push of ``pairs``' metadata, broadcasting the staging buffer.

        Returns:
            Its figures, as ``WeightSender.send`` gives them (``host_s`` is 0:
            there is no host work).
        """
        t0 = time.perf_counter()
        metas, parts = self._plan(pairs)
        packed, config = self.config.packed, self.config
        largest = max(m.nbytes for m in metas)
        timeout = config.wait_timeout_s((config.buffer_size_bytes if packed else largest)
                                        + largest)
        reuse = metas == self.held
        info = uniqueid.UpdateInfo() if reuse else uniqueid.UpdateInfo(
            names=[m.name for m in metas], dtype_names=[m.dtype for m in metas],
            shapes=[list(m.shape) for m in metas])
        stats = SendStats(bytes=sum(m.nbytes for m in metas), tensors=len(metas),
                          chunks=len(parts), packed=packed, reused_metadata=reuse, prepare_s=0.0)
        need = max(nbytes for _, _, nbytes in parts)
        if self.staging is None or self.staging.nbytes < need:
            self.staging = None  # free the old buffer before asking for a larger one
            self.staging = jax.device_put(jnp.zeros((need,), jnp.uint8), self.device)
            self.staging.block_until_ready()
        window = config.num_buffers if packed else max(config.num_buffers, UNPACKED_WINDOW)
        stats.prepare_s = time.perf_counter() - t0

        clients = self.conn.clients
        t1 = time.perf_counter()
        for c in clients:
            c.start_weight_update()
        t2 = time.perf_counter()
        answers = [in_background(_timed_update, c, info.to_payload(),
                                 timeout * max(len(parts), 1) + HTTP_GRACE_S, name="vllm-update")
                   for c in clients]

        def refused() -> None:  # a worker that refused fails the push at once
            for f in answers:
                if f.done() and f.exception() is not None:
                    f.result()

        refused()
        lane = in_background(self._broadcast, parts, window, timeout, refused,
                             name="bench-floor-nccl")
        self._await_answers(answers, lane, timeout)
        await_future(lane, None, refused)
        started, ended, stats.link_s, stats.link_bytes = lane.result()
        t3 = time.perf_counter()
        for c in clients:
            c.finish_weight_update()
        t4 = time.perf_counter()
        self.held = metas
        stats.start_s, stats.transfer_s, stats.finish_s = t2 - t1, t3 - t2, t4 - t3
        stats.update_s = max(f.result() for f in answers)
        stats.broadcast_s = ended - started
        stats.returned_s = time.perf_counter() - t0
        return stats

    @staticmethod
    def _await_answers(answers: list[Future[float]], lane: Future, timeout: float) -> None:
        """Wait for every ``/update_weights`` answer: the broadcasts end first,
        then the answers have ``timeout`` seconds; a failed broadcast ends the wait."""
        answer_by: list[float] = []

        def watch() -> None:
            if not answer_by and lane.done():
                lane.result()  # the broadcasts' failure
                answer_by.append(time.monotonic() + timeout)

        for f in answers:
            if not await_future(f, lambda: answer_by[0] if answer_by else None, watch):
                raise TimeoutError(f"/update_weights did not answer within {timeout}s of the "
                                   "last broadcast")

    def _broadcast(self, parts: list[Part], window: int, timeout: float,
                   check: Callable[[], None]) -> tuple[float, float, float, int]:
        """Launch one broadcast per part from the staging buffer, at most
        ``window`` in flight, on a kept thread of its own.

        Returns:
            (first launch, last done: ``perf_counter()``; the link's GPU
            seconds from the end of the first broadcast to the end of the
            last, and the bytes sent in them).
        """
        assert self.staging is not None
        cuda.use_device(self.ordinal)  # NCCL runs on this thread's device
        comm, stream = self.conn.comm, self.stream
        ptr = int(self.staging.unsafe_buffer_pointer())
        inflight: deque[cuda.Event] = deque()
        started, launched = 0.0, []

        def retire() -> None:
            ev = inflight.popleft()
            comm.wait_event(ev, timeout, "broadcast", check)
            self.events.append(ev)

        for count, code, nbytes in parts:
            while len(inflight) >= window:
                retire()
            started = started or time.perf_counter()
            comm.launch_broadcast(ptr, count, code, 0, stream.handle, timeout)
            launched.append(nbytes)
            if len(launched) == 1:
                self.marks[0].record(stream)
            inflight.append((self.events.pop() if self.events
                             else cuda.Event(self.ordinal)).record(stream))
            check()
        if len(launched) > 1:
            self.marks[1].record(stream)
        while inflight:
            retire()
        link_s, link_bytes = 0.0, 0
        if len(launched) > 1:  # recorded after the last broadcast's own event
            comm.wait_event(self.marks[1], timeout, "broadcast", check)
            link_s, link_bytes = self.marks[0].elapsed_s(self.marks[1]), sum(launched[1:])
        return started, time.perf_counter(), link_s, link_bytes

    def close(self) -> None:
        """Shut the servers' engines down, free the communicator, the stream,
        the events and the staging buffer."""
        self.conn.close()
        for ev in [*self.events, *self.marks]:
            ev.close()
        self.stream.close()
        self.staging = None
