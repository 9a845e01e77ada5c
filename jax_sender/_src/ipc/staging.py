"""The IPC push's data plane: exported buffers the workers map, one per
trainer GPU a worker is on, and the copies into them.

JAX's own buffers cannot be exported (``nccl_cffi.ipc``), so each tensor
is copied once, device to device, into a buffer of this package's
(``Stager``), on the GPU the reading worker is on. While the GPU copies,
the host encodes the update's handles; then it waits for the copies (no
IPC event: torch's receiver would open one per import and never close it)
and the update is posted. A round whose copies fail takes its exports back
(``withdraw``): no worker saw them.

* **Packed**: one buffer per GPU, sized for the largest chunk
  (``chunks``: a chunk ends before the tensor that would overflow the
  buffer; a larger tensor travels alone). Every chunk of a push names the
  same buffer with the same arguments, so a worker maps it once per push
  (vLLM's ``PackedBufferImporter``) and releases it at
  ``/finish_weight_update``. A chunk is written over only once vLLM
  answered the last one: vLLM clones what it unpacks.
* **Unpacked**: every tensor exported on its own, from allocations laid
  out as torch's caching allocator lays out a torch trainer's tensors
  (``layout``): one per tensor of 1 MiB or more, small ones together. A
  worker maps each allocation once, and CUDA maps many allocations faster
  than one of the same bytes (on an H200, 16.4 GB in one took a worker
  ~120 ms to map, in 255 ~20 ms). vLLM hands the views straight to
  ``load_weights`` (its layerwise reload may keep them until finish), so
  nothing is written over before the push ends.

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
from dataclasses import dataclass, replace
from typing import Any

import jax

from nccl_cffi.dtypes import NCCL_TYPES
from nccl_cffi.ipc import exported_bytes
from nccl_cffi.waiting import Check
from uniqueid.ipc.handles import RebuildArgs, pickled
from uniqueid.ipc.join import IPCConnection
from uniqueid.ipc.wire import IPCUpdateInfo

from ..core.tensors.plan import Chunk, TensorMeta

ALIGN = 256  # each unpacked tensor's offset: CUDA's allocation alignment, a multiple of every itemsize
SMALL = 1 << 20  # an unpacked tensor under this shares an allocation (torch's small pool's rule)
SMALL_PIECE = 2 << 20  # the allocation small tensors share (torch's small block)
Get = Callable[[int, jax.Device], jax.Array]  # tensor i, computed, on a device
Exports = list[dict[str, list[RebuildArgs]]]  # per worker rank: its GPU's UUID -> its exports


@dataclass(frozen=True, kw_only=True)
class Placed:
    """A round's tensors and where they lie in the staging allocations.

    Attributes:
        chunk: the tensors (``offsets``: each one's byte offset in its allocation).
        pieces: each tensor's allocation, an index into ``sizes``.
        sizes: the bytes of every allocation the push stages into.
    """

    chunk: Chunk
    pieces: tuple[int, ...]
    sizes: tuple[int, ...]


def packed_rounds(metas: Sequence[TensorMeta], buffer_bytes: int) -> list[Placed]:
    """The packed rounds: ``chunks`` of ``metas``, each in the one buffer,
    sized for the largest.

    Args:
        metas: the push's tensors, in wire order.
        buffer_bytes: the configured buffer size.

    Returns:
        The rounds, in order.
    """
    cut = chunks(metas, buffer_bytes)
    sizes = (max((c.nbytes for c in cut), default=0),)
    return [Placed(chunk=c, pieces=(0,) * (c.stop - c.start), sizes=sizes) for c in cut]


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


def layout(metas: Sequence[TensorMeta]) -> Placed:
    """The unpacked layout: a tensor of ``SMALL`` bytes or more in an
    allocation of its own, smaller ones together in allocations of up to
    ``SMALL_PIECE``, each at a multiple of ``ALIGN``.

    Args:
        metas: the push's tensors, in wire order.

    Returns:
        One round of them all (``chunk.nbytes``: every allocation's bytes).
    """
    offsets, pieces, sizes, small = [], [], [], -1  # small: the allocation small ones fill
    for m in metas:
        size = -(-m.nbytes // ALIGN) * ALIGN
        if m.nbytes >= SMALL:
            k = len(sizes)
            sizes.append(0)
        else:
            if small < 0 or sizes[small] + size > SMALL_PIECE:
                small = len(sizes)
                sizes.append(0)
            k = small
        offsets.append(sizes[k])
        pieces.append(k)
        sizes[k] += size
    chunk = Chunk(start=0, stop=len(metas), nbytes=sum(sizes), offsets=tuple(offsets))
    return Placed(chunk=chunk, pieces=tuple(pieces), sizes=tuple(sizes))


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
        self.buffers: dict[int, list[Any]] = {}  # ordinal -> its exported allocations
        self._slots: list[int] = []  # every export since the last push began
        self._whole: Exports | None = None  # packed: this push's exports of the buffers
        self._kept: list[jax.Array] = []  # what the copies in flight read
        self.marks: list[int] = []  # per round of this push, the exports made before it
        self._copying = 0.0
        self.started = 0.0
        self.host_s = 0.0
        self.link_s = 0.0
        self.link_bytes = 0

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether the allocations now can hold ones of ``sizes``."""
        return all(len(held) == len(sizes) and all(b.nbytes >= n for b, n in zip(held, sizes))
                   for held in self.buffers.values()) and bool(self.buffers)

    def begin(self, sizes: Sequence[int], timeout: float, check: Check) -> None:
        """A push begins: once the last push's exports are released (a
        worker may map them until then), every GPU has allocations of ``sizes``.

        Args:
            sizes: the buffer (packed) or the layout's allocations (unpacked).
            timeout: how long the release may take.
            check: polled while waiting.

        Raises:
            CountersHeld: they are not released within ``timeout``.
            Exception: what a failed allocation raised; none is then held.
        """
        self.plane.counters.wait(self._slots, timeout, "the last push's staging buffer",
                                 check=check)
        self._slots, self._whole, self.started, self.marks = [], None, 0.0, []
        if not self.fits(sizes):
            self._free()  # the old ones go before the new ones are asked for
            try:
                for o in self.devices:
                    self.buffers[o] = []
                    for n in sizes:
                        self.buffers[o].append(self.plane.memory.export(o, max(n, 1)))
            except BaseException:
                self._free()  # a push that cannot stage keeps none of the GPU's memory
                raise

    def held_bytes(self) -> int:
        """The most any one GPU's allocations take now (none: 0)."""
        return max((sum(exported_bytes(b.nbytes) for b in held)
                    for held in self.buffers.values()), default=0)

    def _free(self) -> None:
        for held in self.buffers.values():
            for buffer in held:
                buffer.free()
        self.buffers = {}

    def copy(self, metas: Sequence[TensorMeta], placed: Placed, get: Get) -> None:
        """Start copying the round's tensors into every GPU's allocations
        (``sync`` waits for them; the host meanwhile encodes the update).

        Args:
            metas: the push's tensors (wire order).
            placed: which, and where.
            get: tensor ``i`` on a device, computed.
        """
        self._copying = time.perf_counter()
        self.started = self.started or self._copying
        memory, chunk = self.plane.memory, placed.chunk
        for ordinal, device in self.devices.items():
            held = self.buffers[ordinal]
            for i, k, offset in zip(range(chunk.start, chunk.stop), placed.pieces, chunk.offsets):
                if metas[i].nbytes:
                    self._kept.append(get(i, device))  # alive until its copy is done
                    memory.copy(ordinal, held[k].ptr + offset,
                                int(self._kept[-1].unsafe_buffer_pointer()), metas[i].nbytes)
        self.link_bytes = chunk.nbytes * len(self.devices)

    def sync(self, timeout: float, check: Check) -> None:
        """Wait for the copies ``copy`` started.

        Args:
            timeout: each GPU's deadline.
            check: polled while waiting.

        Raises:
            TimeoutError: the copies did not end within ``timeout``.
        """
        try:
            for ordinal in self.devices:
                self.plane.memory.sync(ordinal, timeout, check)
        finally:
            self._kept.clear()
        self.host_s = time.perf_counter() - self._copying

    def withdraw(self, posted: int) -> None:
        """Take back the exports of this push's rounds from ``posted`` on:
        their updates were never posted (a round whose copies failed, or
        rounds a group's process 0 did not reach), so no worker releases them.

        Args:
            posted: how many of the push's rounds were posted.
        """
        if posted >= len(self.marks):
            return
        since = self.marks[posted]
        fresh = self._slots[since:]
        if fresh:
            del self._slots[since:]
            self.plane.counters.drop(fresh)
            if not since:
                self._whole = None  # packed: the buffer's exports were this round's

    def exports(self, metas: Sequence[TensorMeta], placed: Placed, packed: bool) -> Exports:
        """Every worker's exports for the round, each on a slot of its own:
        packed, the whole buffer (made once a push, the same every chunk);
        unpacked, each tensor at its offset of its allocation.

        Args:
            metas: the push's tensors (wire order).
            placed: the round's tensors, and where they lie.
            packed: the buffer as one export.

        Returns:
            Per worker rank, its GPU's UUID and its exports.
        """
        self.marks.append(len(self._slots))
        if packed and self._whole is not None:
            return self._whole
        by_uuid = {u: o for o, u in self.conn.uuids.items()}
        ranks = self.conn.ranks  # in a group, some on other processes' GPUs: theirs to export
        chunk = placed.chunk
        per = 1 if packed else sum(1 for m in metas[chunk.start:chunk.stop] if m.nbytes)
        slots = iter(self.plane.counters.take(per * sum(u in by_uuid for u in ranks)))
        out = [{u: self._args(metas, placed, by_uuid[u], packed, slots)} if u in by_uuid else {}
               for u in ranks]
        if packed:
            self._whole = out
        return out

    def _args(self, metas: Sequence[TensorMeta], placed: Placed, ordinal: int, packed: bool,
              slots: Any) -> list[RebuildArgs]:
        held, name, chunk = self.buffers[ordinal], self.plane.counters.name, placed.chunk
        if packed:
            places = [((held[0].nbytes,), "uint8", 1, held[0], 0)]
        else:
            places = [(m.shape, m.dtype, NCCL_TYPES[m.dtype][1], held[k], off) for m, k, off
                      in zip(metas[chunk.start:chunk.stop], placed.pieces, chunk.offsets)]
        out = []
        for shape, dtype, itemsize, buffer, offset in places:
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
        for held in self.buffers.values():
            for buffer in held:
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
