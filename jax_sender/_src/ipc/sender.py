"""``IPCSender``: push a JAX model into a vLLM server on the same GPUs, by
CUDA IPC (vLLM's ``ipc`` weight-transfer backend), with no NCCL and no torch.

Where the trainer and vLLM take turns on one node's GPUs (the rollout, then
the training step), vLLM's workers map the trainer's memory: each update
carries handles (torch's pickled ``rebuild_cuda_tensor`` arguments, keyed by
GPU UUID) to bytes this process placed in buffers of its own
(``staging.py``), and the workers load from there. ``send`` reads top to
bottom like ``WeightSender.send``: check the arguments, take the session's
turn, describe the arrays (checked before anything reaches the server),
order them for vLLM's views, plan the chunks, refuse what the GPU's free
memory cannot stage, then hand the push to the session, whose transaction
stages each chunk and posts its ``/update_weights`` after it (a *staged*
round, ``core/push.py``). The session's admission, deadlines, Ctrl-C,
failure handling, ``reconnect()``, ``close()`` and ``send(wait=False)`` are
every sender's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from nccl_cffi import CudaError, cuda
from nccl_cffi.dtypes import NCCL_TYPES
from nccl_cffi.ipc import CudaIPC, exported_bytes
from nccl_cffi.waiting import Check, Deadline
from uniqueid import RendezvousError
from uniqueid.ipc.counters import SLOTS
from uniqueid.ipc.group import GroupFailed, GroupLink, encoded, failure, merged, open_link
from uniqueid.ipc.join import IPCConnection, Memory

from ..core import senders
from ..core.config import SendConfig
from ..core.errors import MetadataError, SendError, TransferError, UpdateIncomplete
from ..core.push import PreparedPush, Round
from ..core.routes import jax_device, sender_device
from ..core.senders import Servers, VerifyResult, check_push
from ..core.session import PendingSend, Session, Ticket
from ..core.snapshot import copied
from ..core.stats import SendStats
from ..core.tensors.describe import Descriptions, Placement, Sources, describe, on_device, readiness
from ..core.tensors.naming import Mapping
from ..core.tensors.plan import TensorMeta
from .route import IPCRoute
from .staging import Get, Placed, Stager, layout, packed_rounds, update_of

log = logging.getLogger("jax_sender")


@dataclass(frozen=True, kw_only=True)
class Staged:
    """One round of an IPC push, on the lane: stage the chunk in every
    buffer, then give the update that names it (``Round.staged``). In a
    group, process 0 first lets the others write their buffers (``go``),
    then merges their exports into its update; the others send theirs and
    give no update (they post none)."""

    metas: Sequence[TensorMeta]
    placed: Placed
    get: Get
    packed: bool
    first: bool  # the push's first round: the allocations are made ready
    index: int = 0  # the round's place in the push
    group: GroupLink | None = None
    push: int = 0  # the group's count of this push
    digest: str = ""  # the push's tensors and chunks, which every process must share

    def __call__(self, stager: Stager, timeout: float, check: Check) -> Any:
        link = self.group
        if link is not None:
            _in_group(lambda: link.step(f"go{self.index}", Deadline(timeout), self.push))
        if self.first:
            stager.begin(self.placed.sizes, timeout, check)
        stager.copy(self.metas, self.placed, self.get)
        try:  # the handles are encoded while the GPU copies
            exports = stager.exports(self.metas, self.placed, self.packed)
            if link is not None and link.process:
                stager.sync(timeout, check)
                _in_group(lambda: link.send(f"x{self.index}", encoded(exports, self.digest),
                                            Deadline(timeout), self.push))
                return None
            if link is not None:
                exports = merged(exports, _in_group(lambda: link.hear(
                    f"x{self.index}", Deadline(timeout), self.push)), self.digest)
            update = update_of(self.metas, self.placed.chunk, exports, packed=self.packed)
            stager.sync(timeout, check)
        except BaseException:
            stager.withdraw(self.index)  # this round's update was never posted
            raise
        if link is not None:
            link.posted = self.index + 1
        return update


def _in_group(call: Callable[[], Any]) -> Any:
    """``call()`` on the group's store; a failure there (another process
    failed or is late, the store is gone) is this push's to wind down, not
    a reason to give the connection up."""
    try:
        return call()
    except RendezvousError as e:
        raise TransferError(str(e)) from e


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """A push's layout, kept while its metadata is the same object."""

    metas: list[TensorMeta]  # as described
    order: list[int]  # the wire order, as indices into ``metas``
    wire: list[TensorMeta]  # ``metas`` in that order
    rounds: list[Placed]
    nbytes: int  # what each GPU's allocations hold together
    digest: str  # the tensors and chunks, for a group's processes to compare


class IPCSender:
    """The trainer's side of a vLLM server started with ``{"backend":"ipc"}``
    on this process's GPUs. Build it with ``connect``.

    Args:
        session: the connection and its pushes.
        mapping: names and transforms.
        devices: per CUDA ordinal this process may export from, JAX's device.
    """

    def __init__(self, session: Session, *, mapping: Mapping, devices: dict[int, jax.Device]):
        self.session = session
        self.mapping = mapping
        self.devices = devices
        self.device = next(iter(devices.values()))
        self._descriptions = Descriptions(mapping, self.device, None)
        self._plan: _Plan | None = None
        self._bound_s = 0.0  # the last push's bound (a group's end waits that long)
        self._rounds_before = 0  # a group's last push's rounds (process 0 sweeps their keys)

    @classmethod
    def connect(cls, server: Servers, *, devices: Sequence[int] | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                memory: Memory | None = None) -> IPCSender:
        """Join a colocated ``ipc`` server: the checks, an empty probe update
        (every worker maps this process's memory and releases it; which GPU
        each is on), the init (see ``uniqueid.ipc.join``).

        Args:
            server: the server's URL or ``VLLMClient`` (one deployment).
            devices: the CUDA ordinals to export from (each must host a
                worker); default every GPU JAX sees here, those hosting a
                worker kept.
            mapping: names and transforms the pytree's leaves.
            config: every setting (``packed``, ``buffer_size_bytes``: each
                GPU's staging buffer; the timeouts).
            memory: the GPU's side (default ``nccl_cffi.ipc.CudaIPC()``).

        Returns:
            The sender.

        Raises:
            TransferError: JAX has no GPU here (or fell back to the CPU),
                not one server, or a packed buffer larger than a GPU's free
                memory (nothing reached the server).
            RendezvousError: the server is not on the ``ipc`` backend,
                refuses pickles, has a worker on a GPU this process holds
                none of, or cannot map this process's memory (one sentence
                each; it is left released).
            ServerStuck: its engine does not answer.
        """
        jax_devs, memory = _checked_gpus(devices, config, memory)
        return open_ipc_sender(senders.one_server(server, "an IPC sender"), jax_devs, mapping=mapping,
                               config=config, memory=memory, strict_devices=devices is not None)

    @classmethod
    def connect_group(cls, server: Servers | None, *, store: str, process: int | None = None,
                      processes: int | None = None, devices: Sequence[int] | None = None,
                      mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                      memory: Memory | None = None) -> IPCSender:
        """Several trainer processes on one node (one per GPU, say) push to one
        colocated ``ipc`` server together, as vLLM's torch trainer ranks do:
        each exports from its own GPUs, and process 0 posts every update
        with all the handles (``uniqueid.ipc.group``). Every process calls
        this together, then ``send()`` (blocking, with the same tree, as
        often), ``reconnect()`` and ``close()`` together.

        Args:
            server: the server's URL or client, read on process 0 (None elsewhere).
            store: ``host:port`` process 0 listens on for the group's
                exchange, the others reach (``"127.0.0.1:29600"``).
            process: this process's index (default ``jax.process_index()``).
            processes: how many push together (default ``jax.process_count()``).
            devices, mapping, config, memory: as ``connect``; every process
                packs alike.

        Returns:
            This process's sender.

        Raises:
            TransferError: as ``connect``.
            ValueError: a malformed ``store``, or fewer than 2 processes.
            RendezvousError: as ``connect``, or the group did not form (a
                process named, or ``RendezvousTimeout``: not every process
                called this in time); ``StoreError``: process 0 cannot
                listen on ``store``.
        """
        jax_devs, memory = _checked_gpus(devices, config, memory)
        process = jax.process_index() if process is None else process
        processes = jax.process_count() if processes is None else processes
        clients = senders.one_server(server, "an IPC sender") if process == 0 else []
        try:
            link = open_link(store, process, processes, Deadline(config.init_timeout_s))
        except BaseException:
            for client in clients:
                client.close()
            raise
        return open_ipc_sender(clients, jax_devs, mapping=mapping, config=config, memory=memory,
                               strict_devices=devices is not None, link=link)

    # -- the push ------------------------------------------------------------
    def send(self, params: Any, *, weight_version: str | None = None, pause: str | None = None,
             wait: bool = True) -> SendStats | PendingSend:
        """Push ``params`` (a pytree, or ``(name, array)`` pairs) to every worker.

        Args:
            params: the arrays (on any of this process's GPUs, or sharded
                over them: each worker's GPU gets its copy on device).
            weight_version: stamped on the server when the push finishes.
            pause: ``"abort"``/``"wait"``/``"keep"`` pauses generation for
                the push and resumes it after.
            wait: False returns a ``PendingSend`` once private copies of the
                arrays are dispatched (a later step may donate them), the
                push running in the background; a push whose arrays are
                not all on this sender's first device runs blocking.

        Returns:
            The push's ``SendStats``, or its ``PendingSend``.

        Raises:
            MetadataError: nothing was sent (bad arguments or arrays).
            TransferError: nothing was sent: more staging than the GPU has free.
            UpdateIncomplete, SendError, SenderClosed, KeyboardInterrupt:
                as ``WeightSender.send``.
        """
        t0 = time.perf_counter()
        check_push(weight_version, pause, None)
        if not wait and not self.session.route.alone:
            raise TransferError("send(wait=False) needs a single-process sender (connect): "
                                "a group's processes stage every round in step")
        return self.session.in_turn(functools.partial(
            self._push, params, weight_version=weight_version, pause=pause, wait=wait, t0=t0))

    def _push(self, params: Any, ticket: Ticket, *, weight_version: str | None,
              pause: str | None, wait: bool, t0: float) -> SendStats | PendingSend:
        """``send`` in the caller's turn: describe, plan, check the room, run;
        in a group, then the outcome between the processes."""
        link: GroupLink | None = self.session.route.link
        if link is None:
            return self._run(params, ticket, weight_version=weight_version, pause=pause,
                             wait=wait, t0=t0)
        n = link.push = link.push + 1
        link.posted = 0
        try:
            stats = self._run(params, ticket, weight_version=weight_version, pause=pause,
                              wait=True, t0=t0, n=n)
            if link.process:
                link.ended(n, Deadline(self._bound_s))
        except BaseException as e:
            ours = self._unposted(e) if link.process else None
            if ours is None:  # this process's own failure: the others hear it
                link.fail(failure(e), push=n, kind=type(e).__name__)
                raise
            error = UpdateIncomplete if ours.kind == UpdateIncomplete.__name__ else SendError
            raise error(f"weight push failed on trainer process 0, which posts the "
                        f"updates: {ours}") from e
        finally:
            if not link.process:
                self._sweep(link, n)
        if not link.process:
            link.tell("stop", b"", Deadline(5.0), push=n)  # the push landed
        return stats

    def _unposted(self, e: BaseException | None) -> GroupFailed | None:
        """Process 0's failure behind ``e``, if it is one; then this process
        takes back the exports process 0 never posted (it said how many
        rounds it did), so its next push waits for no release that cannot come."""
        while e is not None and not isinstance(e, GroupFailed):
            e = e.__cause__
        stager = self.session.broadcaster
        if e is not None and e.posted is not None and isinstance(stager, Stager):
            stager.withdraw(e.posted)
        return e

    def _sweep(self, link: GroupLink, n: int) -> None:
        """Process 0: delete the keys push ``n`` and the one before may have
        left unread (a process that failed reads no further)."""
        rounds = len(self._plan.rounds) if self._plan else 0
        link.sweep(["quit", *(f"x{k}" for k in range(rounds))], push=n)
        link.sweep(["stop", *(f"go{k}" for k in range(self._rounds_before))], push=n - 1)
        self._rounds_before = rounds

    def _run(self, params: Any, ticket: Ticket, *, weight_version: str | None,
             pause: str | None, wait: bool, t0: float, n: int = 0) -> SendStats | PendingSend:
        """This process's push (``n``: a group's count of it): describe,
        plan, check the room, run."""
        metas, sources = self._descriptions.of(params)
        plan = self._planned(metas)
        self._check(plan)
        copies = None if wait or not on_device(sources, self.device) else copied(
            sources, range(len(sources)), self.device)
        push = self._prepared(plan, sources if copies is None else copies, n=n)
        push.weight_version, push.pause = weight_version, pause
        self._bound_s = push.bound_s
        push.stats.prepare_s = time.perf_counter() - t0
        return self.session.run(ticket, push, background=copies is not None, t0=t0)

    def _planned(self, metas: list[TensorMeta]) -> _Plan:
        """The wire order (by decreasing itemsize: every view aligned) and
        the chunks, kept while the description is the same object."""
        if self._plan is not None and self._plan.metas is metas:
            return self._plan
        order = sorted(range(len(metas)), key=lambda i: -NCCL_TYPES[metas[i].dtype][1])
        wire = [metas[i] for i in order]
        if self.session.info.packed:
            cut = packed_rounds(wire, self.session.config.buffer_size_bytes)
        else:
            cut = [layout(wire)]
        nbytes = sum(exported_bytes(n) for n in cut[0].sizes) if cut else 0
        digest = hashlib.sha256(json.dumps(
            [[(m.name, list(m.shape), m.dtype) for m in wire],
             [(p.chunk.start, p.chunk.stop) for p in cut]]).encode()).hexdigest()
        self._plan = _Plan(metas=metas, order=order, wire=wire, rounds=cut, nbytes=nbytes,
                           digest=digest)
        return self._plan

    def _check(self, plan: _Plan) -> None:
        """Refuse, before any request, what the staging cannot hold."""
        conn: IPCConnection = self.session.connection
        packed = self.session.info.packed
        need = len(conn.ranks) * (1 if packed else len(plan.wire))
        if need > SLOTS:
            raise MetadataError(
                f"an unpacked push of {len(plan.wire)} tensors to {len(conn.ranks)} workers "
                f"needs {need} IPC exports, more than the {SLOTS} a ref-counter file holds: "
                "connect with SendConfig(packed=True)")
        stager = self.session.broadcaster
        stager = stager if isinstance(stager, Stager) else None  # None: no push staged yet
        if not plan.rounds or stager and stager.fits(plan.rounds[0].sizes):
            return  # the allocations held now are reused: nothing to ask the driver
        # Allocations that do not fit are all freed before the new ones are made.
        held = stager.held_bytes() if stager else 0
        _check_room(conn.comm.memory, list(conn.uuids), plan.nbytes, held)

    def _prepared(self, plan: _Plan, sources: Sources, n: int) -> PreparedPush:
        """The push's rounds (one per chunk), figures and deadlines (``n``:
        the group's count of it)."""
        config, packed = self.session.config, self.session.info.packed
        get = self._getter(plan, sources)
        rounds = [Round(update={}, root=0, parts=[], staged=True,
                        feed=Staged(metas=plan.wire, placed=p, get=get, packed=packed,
                                    first=k == 0, index=k, group=self.session.route.link,
                                    push=n, digest=plan.digest))
                  for k, p in enumerate(plan.rounds)]
        nbytes = sum(m.nbytes for m in plan.wire)
        largest = max((p.chunk.nbytes for p in plan.rounds), default=0)
        timeout = config.wait_timeout_s(largest)
        stats = SendStats(bytes=nbytes, tensors=len(plan.wire), chunks=len(rounds),
                          packed=packed, reused_metadata=False)
        return PreparedPush(rounds=rounds, stats=stats, timeout_s=timeout,
                            update_timeout_s=timeout + config.wait_timeout_s(largest),
                            ready=readiness(sources))

    def _getter(self, plan: _Plan, sources: Sources) -> Get:
        """Wire tensor ``i`` on a device, transformed, computed."""
        wait_s = self.session.config.wait_timeout_s
        gets = {d: Placement(mapping=self.mapping, device=d, wait_timeout_s=wait_s).getter(
            plan.metas, sources)[0] for d in self.devices.values()}
        order = plan.order
        return lambda i, device: gets[device](order[i])

    # -- checking a push -----------------------------------------------------
    def verify(self, params: Any) -> VerifyResult:
        """Compare what the workers hold with ``params``, through vLLM's
        ``/weight_checker`` (its SHA-256 of each tensor's bytes, on every
        worker); waits for a push in flight first.

        Args:
            params: what was pushed.

        Returns:
            Which tensors match, differ, or cannot be checked.

        Raises:
            MetadataError, SenderClosed, SendError, RendezvousError: as
                ``WeightSender.verify``.
        """
        if not self.session.clients:
            raise MetadataError("verify() asks the server, which only process 0 of an IPC "
                                "group talks to: call it there")

        def checked(_: Ticket) -> tuple[dict[str, str], dict[str, bool]]:
            metas, sources = describe(params, self.mapping)
            get = Placement(mapping=self.mapping, device=self.device,
                            wait_timeout_s=self.session.config.wait_timeout_s).getter(
                metas, sources)[0]
            return senders.checksums(self.session.clients, metas, get)
        want, seen = self.session.in_turn(checked)
        return senders.verdict(list(want), seen)

    # -- lifetime: the session's (``core.senders``), one server ---------------
    def close(self) -> None:
        """Let a push in flight end, release the server and free everything
        (``Session.close``); then close a group's store. Calling it again
        does nothing."""
        self.session.close()
        self.session.route.close()

    config = property(senders.config)
    broken = property(senders.broken)
    servers = property(senders.servers)
    reconnect = senders.reconnect
    __enter__ = senders.enter
    __exit__ = senders.exit_


def usable_gpus(devices: Sequence[int] | None) -> dict[int, jax.Device]:
    """The trainer's GPUs, checked before anything reaches a server: each
    ordinal of ``devices`` (default: every GPU JAX sees), with JAX's device.

    Raises:
        TransferError: JAX runs on the CPU (one sentence, with the likely
            cause), has no such GPU, or the driver cannot use one.
    """
    if jax.default_backend() == "cpu":
        raise TransferError(
            "JAX runs on the CPU here, and a colocated push exports GPU memory: install JAX with "
            "CUDA (pip install 'jax-vllm-nccl[cuda13]'); if it is installed, JAX fell back to "
            "the CPU: set only one of XLA_PYTHON_CLIENT_MEM_FRACTION and "
            "XLA_CLIENT_MEM_FRACTION, and check CUDA_VISIBLE_DEVICES")
    ordinals = list(devices) if devices is not None else [
        d.local_hardware_id for d in jax.local_devices(backend="gpu")]
    out = {}
    for ordinal in ordinals or [sender_device(None)]:
        out[ordinal] = jax_device(ordinal)
        try:
            cuda.check_device(ordinal)
        except CudaError as e:
            raise TransferError(str(e)) from e
    return out


def _checked_gpus(devices: Sequence[int] | None, config: SendConfig,
                  memory: Memory | None) -> tuple[dict[int, jax.Device], Memory]:
    """``connect``'s checks before any server is asked: the GPUs
    (``usable_gpus``), and a packed buffer's room on each; with the GPU's
    side (default ``CudaIPC()``)."""
    jax_devs = usable_gpus(devices)
    memory = memory or CudaIPC()
    if config.packed:
        _check_room(memory, list(jax_devs), exported_bytes(config.buffer_size_bytes), 0)
    return jax_devs, memory


def _check_room(memory: Memory, ordinals: list[int], nbytes: int, staged: int) -> None:
    """Refuse staging a GPU's free memory cannot hold (beyond ``staged``,
    what the allocations it replaces hold), before anything reaches a server.

    Raises:
        TransferError: not enough free memory, with the sizes and the fixes.
    """
    grow = nbytes - staged
    for ordinal in ordinals:
        free = memory.free_bytes(ordinal)
        if grow > free:
            raise TransferError(
                f"the IPC staging buffer needs {_sized(nbytes)} on GPU {ordinal}, which has "
                f"{_sized(free)} free: push packed with a smaller "
                "SendConfig(buffer_size_bytes=...), let JAX take less "
                "(XLA_PYTHON_CLIENT_MEM_FRACTION) or let vLLM sleep during the push")


def _sized(nbytes: int) -> str:
    """Bytes for a message: GiB, or MiB under one (staging comes in 2 MiB
    granules, which GiB to two places would show as 0.00)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def open_ipc_sender(clients: list[Any], devices: dict[int, jax.Device], *, mapping: Mapping,
                    config: SendConfig, memory: Memory, strict_devices: bool,
                    link: GroupLink | None = None) -> IPCSender:
    """Join the server (``IPCRoute.form``, within ``config.init_timeout_s``)
    and hold it in a session whose rounds stage through ``memory``; the
    client and the group's store are closed if that fails. ``connect`` and
    ``connect_group`` after their checks (tests give CPU devices and a
    stand-in ``memory``).

    Args:
        clients: the server's client, alone (none on a group's processes but 0).
        devices: per CUDA ordinal this process may export from, JAX's device.
        mapping: names and transforms.
        config: every setting.
        memory: the GPU's side.
        strict_devices: refuse a device no worker is on.
        link: this process's link to a group (None: alone).

    Returns:
        The sender.
    """
    route = IPCRoute(clients=clients, devices=list(devices), config=config, memory=memory,
                     strict_devices=strict_devices, link=link)
    try:
        conn = route.form(config.init_timeout_s)
    except BaseException:
        for client in clients:
            client.close()
        route.close()
        raise
    session = Session(route, conn, config, broadcaster=lambda c: Stager(
        c, {o: devices[o] for o in c.uuids}))
    return IPCSender(session, mapping=mapping, devices=devices)
