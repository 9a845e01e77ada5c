"""The IPC push's data plane: exported buffers the workers map, one per
trainer GPU a worker is on, and the copies into them.

JAX's own buffers cannot be exported (``nccl_cffi.ipc``), so each tensor
is copied once, device to device, into a buffer of this package's
(``Stager``), on the GPU the reading worker is on. Then the host waits for
the copies (no IPC event: torch's receiver would open one per import and
never close it) and the update is posted with the handles.

* **Packed**: one buffer per GPU, sized for the largest chunk
  (``chunks``: a chunk ends before the tensor that would overflow the
  buffer; a larger tensor travels alone). Every chunk of a push names the
  same buffer with the same arguments, so a worker maps it once per push
  (vLLM's ``PackedBufferImporter``) and releases it at
  ``/finish_weight_update``. A chunk is written over only once vLLM
  answered the last one: vLLM clones what it unpacks.
* **Unpacked**: every tensor at an offset of one buffer (``layout``), each
  exported on its own. vLLM hands the views straight to ``load_weights``
  (its layerwise reload may keep them until finish), so nothing is written
  over before the push ends.

Every export counts on a slot of the connection's ref-counter file, one
per worker: two workers on one GPU each rebuild and each release counts
down once, so workers sharing a GPU get payloads of their own (vLLM's
rank-indexed ``update_info`` list). A buffer is written again, grown or
freed only once the last push's exports are back to 0; the connection
frees it, after the server's release, at close.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax

from nccl_cffi.dtypes import NCCL_TYPES
from nccl_cffi.waiting import Check
from uniqueid.ipc.handles import RebuildArgs, pickled
from uniqueid.ipc.join import IPCConnection
from uniqueid.ipc.wire import IPCUpdateInfo

from ..core.tensors.plan import Chunk, TensorMeta

ALIGN = 256  # each unpacked tensor's offset: CUDA's allocation alignment, a multiple of every itemsize
Get = Callable[[int, jax.Device], jax.Array]  # tensor i, computed, on a device
Exports = list[dict[str, list[RebuildArgs]]]  # per worker rank: its GPU's UUID -> its exports


def chunks(metas: Sequence[TensorMeta], buffer_bytes: int) -> list[Chunk]:
    """The packed chunks of ``metas`` (in wire order): a chunk ends before
    the tensor that would make it larger than ``buffer_bytes``; a larger
    tensor is a chunk of its own. Offsets are running sums, so in wire
    order (decreasing itemsize) each is a multiple of its tensor's itemsize,
    as vLLM's views need.

    Args:
        metas: the push's tensors, in wire order.
        buffer_bytes: the buffer size.

    Returns:
        The chunks, in order.
    """
    out: list[Chunk] = []
    start, offsets, total = 0, [], 0
    for i, m in enumerate(metas):
        if offsets and total + m.nbytes > buffer_bytes:
            out.append(Chunk(start=start, stop=i, nbytes=total, offsets=tuple(offsets)))
            start, offsets, total = i, [], 0
        offsets.append(total)
        total += m.nbytes
    if offsets:
        out.append(Chunk(start=start, stop=len(metas), nbytes=total, offsets=tuple(offsets)))
    return out


def layout(metas: Sequence[TensorMeta]) -> Chunk:
    """The unpacked layout: every tensor in one buffer, each at a multiple of ``ALIGN``.

    Args:
        metas: the push's tensors, in wire order.

    Returns:
        One chunk of them all (``nbytes``: the buffer it needs).
    """
    offsets, total = [], 0
    for m in metas:
        offsets.append(total)
        total += -(-m.nbytes // ALIGN) * ALIGN
    return Chunk(start=0, stop=len(metas), nbytes=total, offsets=tuple(offsets))


class Stager:
    """The exported buffers of one connection and the copies into them
    (the session's data plane for an IPC push).

    Args:
        conn: the connection (its plane, its workers' GPUs).
        devices: per trainer ordinal a worker is on, JAX's device.
    """

    def __init__(self, conn: IPCConnection, devices: dict[int, jax.Device]):
        self.conn = conn
        self.plane = conn.comm
        self.devices = devices
        self.buffers: dict[int, Any] = {}  # ordinal -> exported buffer
        self._slots: list[int] = []  # every export since the last push began
        self._whole: Exports | None = None  # packed: this push's exports of the buffers
        self.started = 0.0
        self.host_s = 0.0
        self.link_s = 0.0
        self.link_bytes = 0

    @property
    def capacity(self) -> int:
        """The bytes each buffer holds now (0: none yet)."""
        return min((b.nbytes for b in self.buffers.values()), default=0)

    def begin(self, nbytes: int, timeout: float, check: Check) -> None:
        """A push begins: once the last push's exports are released (a
        worker may map them until then), every buffer holds ``nbytes``.

        Args:
            nbytes: the largest chunk (packed) or the layout (unpacked).
            timeout: how long the release may take.
            check: polled while waiting.

        Raises:
            CountersHeld: they are not released within ``timeout``.
        """
        self.plane.counters.wait(self._slots, timeout, "the last push's staging buffer",
                                 check=check)
        self._slots, self._whole, self.started = [], None, 0.0
        if nbytes > self.capacity:
            for buffer in self.buffers.values():
                buffer.free()
            self.buffers = {}  # the old ones go before the new ones are asked for
            self.buffers = {o: self.plane.memory.export(o, max(nbytes, 1)) for o in self.devices}

    def stage(self, metas: Sequence[TensorMeta], chunk: Chunk, get: Get, timeout: float,
              check: Check) -> None:
        """Copy ``chunk``'s tensors into every buffer and wait for the copies.

        Args:
            metas: the push's tensors (wire order).
            chunk: which, and where.
            get: tensor ``i`` on a device, computed.
            timeout: each wait's deadline.
            check: polled while waiting.

        Raises:
            TimeoutError: the copies did not end within ``timeout``.
        """
        t0 = time.perf_counter()
        self.started = self.started or t0
        memory, kept = self.plane.memory, []
        for ordinal, device in self.devices.items():
            base = self.buffers[ordinal].ptr
            for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets):
                if metas[i].nbytes:
                    kept.append(get(i, device))  # alive until its copy is done
                    memory.copy(ordinal, base + offset, int(kept[-1].unsafe_buffer_pointer()),
                                metas[i].nbytes)
        for ordinal in self.devices:
            memory.sync(ordinal, timeout, check)
        self.host_s = time.perf_counter() - t0
        self.link_bytes = chunk.nbytes * len(self.devices)

    def exports(self, metas: Sequence[TensorMeta], chunk: Chunk, packed: bool) -> Exports:
        """Every worker's exports for ``chunk``, each on a slot of its own:
        packed, the whole buffer (made once a push, the same every chunk);
        unpacked, each tensor at its offset.

        Args:
            metas: the push's tensors (wire order).
            chunk: the round's tensors.
            packed: the buffer as one export.

        Returns:
            Per worker rank, its GPU's UUID and its exports.
        """
        if packed and self._whole is not None:
            return self._whole
        by_uuid = {u: o for o, u in self.conn.uuids.items()}
        ranks = self.conn.ranks
        per = 1 if packed else sum(1 for m in metas[chunk.start:chunk.stop] if m.nbytes)
        slots = iter(self.plane.counters.take(per * len(ranks)))
        out = [{u: self._args(metas, chunk, by_uuid[u], packed, slots)} for u in ranks]
        if packed:
            self._whole = out
        return out

    def _args(self, metas: Sequence[TensorMeta], chunk: Chunk, ordinal: int, packed: bool,
              slots: Any) -> list[RebuildArgs]:
        buffer, name = self.buffers[ordinal], self.plane.counters.name
        if packed:
            places = [((buffer.nbytes,), "uint8", 1, 0)]
        else:
            places = [(m.shape, m.dtype, NCCL_TYPES[m.dtype][1], off)
                      for m, off in zip(metas[chunk.start:chunk.stop], chunk.offsets)]
        out = []
        for shape, dtype, itemsize, offset in places:
            args = RebuildArgs(shape=tuple(shape), dtype=dtype, itemsize=itemsize,
                               device=ordinal, handle=buffer.handle, offset=offset,
                               counter=name, slot=0)
            if args.nbytes:  # torch rebuilds an empty tensor without mapping or counting it
                args = replace(args, slot=next(slots))
                self._slots.append(args.slot)
            out.append(args)
        return out

    def close(self) -> None:
        """Hand the buffers to the connection, which frees them once the
        workers released them (after the server's release, at close)."""
        for buffer in self.buffers.values():
            self.plane.retire(buffer, self._slots)
        self.buffers = {}


def update_of(metas: Sequence[TensorMeta], chunk: Chunk, exports: Exports, *,
              packed: bool) -> Any:
    """The ``update_info`` of ``chunk``: one payload when no two workers
    share a GPU (every UUID's exports in one dict), else one per worker.

    Args:
        metas: the push's tensors (wire order).
        chunk: the round's tensors.
        exports: ``Stager.exports``'s answer.
        packed: the buffer is one export (sent with ``tensor_sizes``).

    Returns:
        The payload (a dict), or the rank-indexed list of them.
    """
    mine = metas[chunk.start:chunk.stop]
    lists = {"names": [m.name for m in mine], "dtype_names": [m.dtype for m in mine],
             "shapes": [list(m.shape) for m in mine],
             "tensor_sizes": [m.nbytes for m in mine] if packed else None}

    def one(handles: dict[str, list[RebuildArgs]]) -> dict[str, Any]:
        if packed:
            obj: Any = {u: e[0].to_tuple() for u, e in handles.items()}
        else:
            obj = [{u: e[k].to_tuple() for u, e in handles.items()} for k in range(len(mine))]
        return IPCUpdateInfo(**lists, ipc_handles_pickled=pickled(obj)).to_payload()

    uuids = [u for e in exports for u in e]
    if len(set(uuids)) == len(uuids):  # one worker per GPU: one payload for all
        return one({u: h for e in exports for u, h in e.items()})
    return [one(e) for e in exports]
