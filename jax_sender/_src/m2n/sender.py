"""``M2NSender``: every trainer process sends its own shards, and NCCL M2N
reshards them straight into each vLLM worker's shard.

For a server started with vLLM's ``nccl_m2n`` weight-transfer backend. The
trainer processes (one per JAX process, each holding a block of every
parameter: see ``m2n_layout.py``) and the server's workers share one
communicator; every parameter is one reshard, from the trainer's layout to
the one each worker's model needs (its shard for tensor-parallel
parameters vLLM can write in place, the whole tensor for the rest). No
trainer GPU gathers a full tensor, and no worker receives more than it
holds where vLLM resolves its shard.

The plan (every tensor's name, dtype, shape and trainer layout) is fixed at
``connect``: it travels in the init payload, and vLLM's workers check every
push against it. ``send`` reads top to bottom like ``WeightSender.send``:
check the arguments, take the session's turn, describe the arrays and hold
them to the plan (before anything reaches a server), then one round through
the session (``session.py``): start, ``/update_weights`` with the names in
flight while every trainer rank reshards, finish. The session's deadlines,
failure handling, Ctrl-C, ``reconnect()`` and ``close()`` are the broadcast
senders'.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from nccl_cffi import NCCL_TYPES, Deadline, poll_until
from nccl_cffi.m2n import DistTensor
from uniqueid import RendezvousError, VLLMClient
from uniqueid.http.fleet import call_all
from uniqueid.m2n.agreement import REPLICATE, M2NMesh, M2NWireParam
from uniqueid.m2n.plan import resolve_layout, validate_layout

from ..core import senders
from ..core.config import SendConfig
from ..core.errors import MetadataError, SendError, TransferError
from ..core.group import Share, share_from_process_0
from ..core.push import PreparedPush, Round
from ..core.routes import usable_device
from ..core.senders import Servers, VerifyResult, check_push, verdict
from ..core.session import PendingSend, Session, Ticket
from ..core.stats import SendStats
from ..core.tensors.describe import Descriptions, Sources, readiness
from ..core.tensors.naming import Mapping, identity
from ..core.tensors.plan import TensorMeta, check_against
from .layout import Box, SourceLayout, check_tensor, local_block, process_boxes, source_layout
from .resharder import Resharder, ReshardPart, Reshards
from .route import M2NRoute

log = logging.getLogger("jax_sender")


@dataclass(frozen=True, kw_only=True)
class _Tensor:
    """One tensor of the plan, as this process sends it."""

    meta: TensorMeta
    layout: SourceLayout
    box: Box  # this process's block
    sharding: Any  # the source array's sharding at connect (None: host data)


def _output_of(mapping: Mapping, path: Any, array: Any) -> Any:
    """What the mapping makes of ``array``, as shape and sharding, without
    running it (compiled, for a transform of a sharded array)."""
    if mapping.transform is identity or not isinstance(array, jax.Array):
        return array
    compiled = jax.jit(lambda a: mapping.apply(path, a)).lower(array).compile()
    out = jax.eval_shape(lambda a: mapping.apply(path, a), array)
    return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=compiled.output_shardings)


def plan_tensors(metas: Sequence[TensorMeta], sources: Sources, mapping: Mapping,
                 processes: int, process: int) -> list[_Tensor]:
    """Every tensor's M2N source layout and this process's block, checked
    before any server is touched.

    Raises:
        MetadataError: anything NCCL M2N cannot move or express.
    """
    out = []
    for meta, (path, array) in zip(metas, sources):
        check_tensor(meta.name, meta.dtype, meta.shape)
        boxes = process_boxes(meta.name, _output_of(mapping, path, array), processes)
        out.append(_Tensor(meta=meta, layout=source_layout(meta.name, meta.shape, boxes),
                           box=boxes[process], sharding=getattr(array, "sharding", None)))
    return out


def wire_params(tensors: Sequence[_Tensor]) -> list[M2NWireParam]:
    """The plan as vLLM's init payload carries it."""
    return [M2NWireParam(name=t.meta.name, dtype_name=t.meta.dtype, shape=t.meta.shape,
                      src_mesh_dims=t.layout.mesh, src_placements=t.layout.placements)
            for t in tensors]


def reshard_parts(tensors: Sequence[_Tensor], destinations: Sequence[Any], *,
                  trainer_ranks: int, dst_mesh: tuple[int, int]) -> list[ReshardPart]:
    """Each tensor's reshard as this trainer rank issues it: its source side
    (the pointer filled per push), the workers' side (placements resolved
    as vLLM resolves them: replicated is a shard over a size-1 axis)."""
    parts = []
    for t, placement in zip(tensors, destinations):
        code, name = NCCL_TYPES[t.meta.dtype][0], t.meta.name
        smesh, splc = resolve_layout(M2NMesh(dims=t.layout.mesh, start_rank=0),
                                     t.layout.placements, name)
        dmesh, dplc = resolve_layout(M2NMesh(dims=dst_mesh, start_rank=trainer_ranks),
                                     placement, name)
        src = DistTensor(ptr=0, local_shape=t.layout.local_shape, dtype=code, mesh=smesh.dims,
                         start_rank=0, placements=splc)
        dst = DistTensor(ptr=0, local_shape=validate_layout(dmesh, dplc, t.meta.shape, name),
                         dtype=code, mesh=dmesh.dims, start_rank=trainer_ranks, placements=dplc)
        parts.append(ReshardPart(name=name, src=src, dst=dst,
                                 nbytes=t.meta.nbytes // t.layout.shards))
    return parts


def open_m2n_session(route: M2NRoute, config: SendConfig, device: jax.Device) -> Session:
    """Form ``route``'s M2N group (within ``config.init_timeout_s``) and hold
    it in a session whose pushes reshard from ``device``."""
    try:
        connection = route.form(config.init_timeout_s)
    except BaseException:
        for client in route.clients:
            client.close()
        raise
    budget = config.buffer_size_bytes * config.num_buffers
    return Session(route, connection, config, broadcaster=lambda conn: Resharder(
        conn.comm, device, window=max(config.num_buffers, 8), budget=budget))


class M2NSender:
    """The trainer's side of an ``nccl_m2n`` server. Build it with ``connect``.

    Args:
        session: the connection and its pushes.
        tensors: the plan, as this process sends it.
        mapping: names and transforms.
        device: the JAX device this process sends from.
    """

    def __init__(self, session: Session, tensors: list[_Tensor], *, mapping: Mapping,
                 device: jax.Device):
        self.session = session
        self.mapping = mapping
        self.device = device
        self._tensors = tensors
        self._metas = [t.meta for t in tensors]
        self._descriptions = Descriptions(mapping, device, None)

    @classmethod
    def connect(cls, servers: Servers, params: Any, *, device: int | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                share: Share = share_from_process_0, store_host: str | None = None,
                store_port: int = 0, max_cta: int | None = None) -> M2NSender:
        """Form the M2N group with one vLLM server; every trainer process calls
        it together, with the same ``params`` (global arrays) and arguments.

        Args:
            servers: the server's URL or ``VLLMClient`` (one deployment,
                read on process 0 only).
            params: what later pushes send (their names, dtypes, shapes and
                shardings make the plan).
            device: this process's CUDA ordinal (default: JAX's first GPU).
            mapping: names and transforms the pytree's leaves.
            config: every setting (``init_timeout_s``, ``send_timeout_s``,
                ``reconnect_timeout_s``; ``buffer_size_bytes`` x
                ``num_buffers`` bounds the blocks in flight).
            share: how process 0's id and store reach the other processes.
            store_host, store_port: where vLLM's workers reach the metadata
                store (default: this machine's address on the route to the
                server; a port the system picks, or a fixed one for a firewall).
            max_cta: the most CTAs a reshard kernel uses.

        Returns:
            This process's sender.

        Raises:
            TransferError: no usable GPU here, or not one server (nothing
                reached a server).
            NcclLibraryNotFound: no libnccl >= 2.30.5 or no libnccl_m2n
                (nothing reached a server).
            MetadataError: a tensor NCCL M2N cannot move or a layout it
                cannot express (nothing reached a server).
            RendezvousError: the server refused, or the group did not form.
            ServerStuck: the server's engine does not answer (nothing posted).
            NcclError: NCCL refused this process's init.
        """
        ordinal, jax_dev = usable_device(device)
        processes, process = jax.process_count(), jax.process_index()
        clients = senders.one_server(servers, "an M2N group") if process == 0 else []
        descriptions = Descriptions(mapping, jax_dev, None)
        metas, sources = descriptions.of(params)
        tensors = plan_tensors(metas, sources, mapping, processes, process)
        route = M2NRoute(clients=clients, device=ordinal, config=config, params=wire_params(tensors),
                         process=process, processes=processes, share=share,
                         store_host=store_host, store_port=store_port, max_cta=max_cta)
        sender = cls(open_m2n_session(route, config, jax_dev), tensors, mapping=mapping,
                     device=jax_dev)
        sender._descriptions = descriptions
        return sender

    # -- a push -----------------------------------------------------------
    def send(self, params: Any, *, weight_version: str | None = None, pause: str | None = None,
             wait: bool = True) -> SendStats | PendingSend:
        """Push ``params``: every trainer process calls it together.

        Args:
            params: the same tree as at ``connect`` (names, dtypes, shapes
                and shardings), new values.
            weight_version: stamped by ``/finish_weight_update``.
            pause: ``"abort"``, ``"wait"`` or ``"keep"``: pause generation
                around the update; None: leave it running.
            wait: False: return once this process's blocks are copied (one
                process only), the push running in the background.

        Returns:
            Its ``SendStats``, or a ``PendingSend`` with ``wait=False``.

        Raises:
            MetadataError: ``params`` differ from the plan (nothing was sent).
            UpdateIncomplete, SendError, SenderClosed, KeyboardInterrupt: as
                ``WeightSender.send``.
        """
        t0 = time.perf_counter()
        check_push(weight_version, pause, None)
        if not wait and not self.session.route.alone:
            raise TransferError("send(wait=False) needs a single trainer process: every "
                                "process reshards in step")
        return self.session.in_turn(functools.partial(
            self._push, params, weight_version=weight_version, pause=pause, wait=wait, t0=t0))

    def _push(self, params: Any, ticket: Ticket, *, weight_version: str | None,
              pause: str | None, wait: bool, t0: float) -> SendStats | PendingSend:
        """``send`` in the caller's turn: hold the arrays to the plan, then run
        the push (several processes: then share its outcome)."""
        metas, sources = self._descriptions.of(params)
        self._check_plan(metas, sources)
        get = self._getter(sources, snapshot=not wait)
        arrays = all(isinstance(a, jax.Array) for a in sources.arrays)
        push = self._prepared(get, readiness(sources) if wait and arrays else None)
        push.weight_version, push.pause = weight_version, pause
        push.stats.prepare_s = time.perf_counter() - t0
        if self.session.route.alone:
            return self.session.run(ticket, push, background=not wait, t0=t0)
        try:
            stats = self.session.run(ticket, push, background=False, t0=t0)
        except BaseException as e:
            self._round_outcome(e, push.bound_s)
            raise
        self._round_outcome(None, push.bound_s)
        return stats

    def _round_outcome(self, failure: BaseException | None, bound_s: float) -> None:
        """vLLM's M2N trainer's last step of a round with several trainer
        ranks: process 0, the only one that saw the server finish, tells the
        others whether it did (each acknowledges), so every process's
        ``send`` ends the same way.

        Raises:
            SendError: process 0's push failed (on the other processes), or
                the outcome did not arrive within the push's deadlines.
        """
        conn, deadline = self.session.connection, Deadline(bound_s)
        group, rank = conn.group, self.session.route.rank
        try:
            if rank == 0:
                said = {"ok": failure is None,
                        "error": None if failure is None else f"{type(failure).__name__}: {failure}"}
                for r in range(1, self.session.route.processes):
                    group.send_obj(said, r, deadline)
                for r in range(1, self.session.route.processes):
                    group.recv_obj(r, deadline, what="round-outcome acknowledgement")
                return
            said = group.recv_obj(0, deadline, what="round outcome")
            group.send_obj({"phase": "round_outcome_consumed"}, 0, deadline)
        except RendezvousError as e:
            if failure is None:
                raise SendError(f"the push's outcome was not shared among the trainer processes: "
                                f"{e}") from e
            return
        if failure is None and not said.get("ok"):
            raise SendError(f"the push failed on trainer process 0: {said.get('error')}")

    def _check_plan(self, metas: list[TensorMeta], sources: Sources) -> None:
        """Refuse a push the workers would not take: the plan is fixed at init."""
        check_against(self._metas, metas)
        for t, array in zip(self._tensors, sources.arrays):
            if getattr(array, "sharding", None) != t.sharding:
                raise MetadataError(
                    f"{t.meta.name!r} is sharded as {getattr(array, 'sharding', None)}, but the "
                    f"group was formed for {t.sharding}: NCCL M2N fixes every layout at "
                    "connect; connect a new M2NSender for the new layout")

    def _getter(self, sources: Sources, *, snapshot: bool) -> Callable[[int], jax.Array]:
        """Tensor ``k``'s block on this process's device, ready: made on the
        lane, or (``snapshot``) copied now, so the caller may overwrite its
        arrays once ``send`` returns."""
        timeout = self.session.config.wait_timeout_s(max(t.meta.nbytes for t in self._tensors))

        def make(k: int) -> jax.Array:
            path, array = sources[k]
            out = array if self.mapping.transform is identity else self.mapping.apply(path, array)
            return local_block(out, self._tensors[k].box, self.device)

        def ready(block: jax.Array) -> jax.Array:
            poll_until(block.is_ready, timeout, on_timeout=lambda: TimeoutError(
                f"a block to reshard was not computed within {timeout}s"))
            return block

        if snapshot:
            blocks = [jax.numpy.copy(make(k)) for k in range(len(sources))]
            return lambda k: ready(blocks[k])
        return lambda k: ready(make(k))

    def _prepared(self, get: Callable[[int], jax.Array],
                  ready: Callable[[], None] | None) -> PreparedPush:
        conn, config = self.session.connection, self.session.config
        parts = self._parts(conn)
        largest = max(p.nbytes for p in parts)
        timeout = config.wait_timeout_s(2 * largest)
        stats = SendStats(bytes=sum(p.nbytes for p in parts), tensors=len(parts),
                          chunks=len(parts), packed=False, reused_metadata=True)
        rank = self.session.route.rank
        return PreparedPush(
            rounds=[Round(update={"names": [m.name for m in self._metas]}, root=rank,
                          parts=parts, feed=Reshards(parts=parts, get=get))],
            stats=stats, timeout_s=timeout, update_timeout_s=timeout * len(parts) + 60,
            ready=ready, alone=self.session.route.alone, rank=rank)

    def _parts(self, conn: Any) -> list[ReshardPart]:
        info = conn.init_info
        return reshard_parts(self._tensors, conn.destinations, trainer_ranks=info.rank_offset,
                             dst_mesh=info.dst_mesh_dims)

    # -- checking a push ---------------------------------------------------
    def verify(self, params: Any) -> VerifyResult:
        """Compare every worker's shard with ``params``, through vLLM's
        ``/weight_checker``: its SHA-256 of each runtime parameter, against
        the same digest of the block of the trainer's full array that
        worker holds. Every trainer process calls it together (the full
        arrays are gathered on each); process 0 asks the server.

        Args:
            params: what was pushed.

        Returns:
            Which tensors match on every worker, differ, or are not reported
            under their own name (fused at runtime), which cannot be checked.

        Raises:
            MetadataError: ``params`` differ from the plan.
            SenderClosed, SendError: as ``WeightSender.verify``.
            RendezvousError: the server did not answer as vLLM does.
        """
        metas, seen = self.session.in_turn(lambda _: self._checked(params))
        return verdict([m.name for m in metas], seen)

    def _checked(self, params: Any) -> tuple[list[TensorMeta], dict[str, bool]]:
        """The plan's metadata, and by name whether every worker's digest is
        one its block of ``params`` gives (every server asked at once)."""
        metas, sources = self._descriptions.of(params)
        self._check_plan(metas, sources)
        conn = self.session.connection
        held = call_all(conn.clients, VLLMClient.weight_checker, "checksum",
                        deadline=Deadline(None))
        seen: dict[str, bool] = {}
        for k, (path, array) in enumerate(sources):
            full = _full(self.mapping, path, array)
            for key, digest in (kv for h in held for kv in h["checksums"].items()):
                name, worker = _worker_of(key)
                if name == metas[k].name:
                    seen[name] = seen.get(name, True) and digest in _digests(full, conn, k, worker)
        return metas, seen

    # -- lifetime: the session's (``core.senders``), but one server -------------
    config = property(senders.config)
    broken = property(senders.broken)
    close = senders.close
    __enter__ = senders.enter
    __exit__ = senders.exit_

    def reconnect(self) -> None:
        """Form the group again after a failure (``Session.reconnect``): the
        server's open update session finished, its engine shut down, a new
        id, store and plan agreement; every trainer process calls it together.

        Raises:
            SenderClosed: the sender is closed.
            SendError: a push in flight did not end by its deadlines.
            ServerStuck: the server's engine does not answer (restart it).
            RendezvousError: the new group did not form.
            NcclError: NCCL refused this process's new init.
        """
        self.session.reconnect()


def _full(mapping: Mapping, path: Any, array: Any) -> np.ndarray:
    """The whole tensor on the host (gathered from every process)."""
    out = array if mapping.transform is identity else mapping.apply(path, array)
    if isinstance(out, jax.Array) and not out.is_fully_addressable:
        from jax.experimental import multihost_utils
        out = multihost_utils.process_allgather(out, tiled=True)
    return np.asarray(out)


def _worker_of(key: str) -> tuple[str, tuple[int, int]]:
    """(checkpoint name, (data-parallel, tensor-parallel) rank) of a
    ``/weight_checker`` key ``dp{d}:pp{p}:pcp{c}:tp{t}:<name>``."""
    fields = key.split(":", 4)
    if len(fields) != 5:
        return fields[-1], (0, 0)
    return fields[4], (int(fields[0].removeprefix("dp")), int(fields[3].removeprefix("tp")))


def _sha(block: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(block).tobytes()).hexdigest()


def _digests(full: np.ndarray, conn: Any, k: int, worker: tuple[int, int]) -> set[str]:
    """What a worker may hold of tensor ``k``: the block its destination
    placement gives it; for a replicated destination (vLLM's fallback path,
    where its own loader shards), the whole tensor or its tensor-parallel
    slice along any dimension."""
    placement, mesh = conn.destinations[k], conn.init_info.dst_mesh_dims
    if placement is not None:
        where = [slice(None)] * full.ndim
        for axis, dim in enumerate(placement):
            if dim != REPLICATE:
                width = full.shape[dim] // mesh[axis]
                where[dim] = slice(worker[axis] * width, (worker[axis] + 1) * width)
        return {_sha(full[tuple(where)])}
    shards, tp = mesh[1], worker[1]
    out = {_sha(full)}
    for dim, n in enumerate(full.shape):
        if shards > 1 and n % shards == 0:
            width = n // shards
            out.add(_sha(np.take(full, range(tp * width, (tp + 1) * width), axis=dim)))
    return out
