"""``WeightSender``: push a JAX model into vLLM workers, with vLLM's update protocol.

One ``send`` reads top to bottom: check the arguments, take the session's
turn, describe the arrays (names, dtypes, shapes, order, devices: all
checked before anything reaches a server), plan the turns and their chunks,
choose once how the chunks are produced (``feeds.py``), and hand the push
to the session, which runs it as a transaction (``push.py``,
``session.py``). Metadata is sent once: an unchanged round posts empty
lists, which vLLM reads as "same as last time".

How the trainer takes part is a *route*: ``SingleProcess`` (one trainer
process sends everything) or ``ProcessGroup`` (several, see ``group.py``).
``send(wait=False)`` snapshots what it sends (XLA copies, dispatched before
it returns) and runs the push in the background, while the trainer trains.
The snapshot compiles nothing per tensor on the trainer's thread: the
packed chunks themselves once an earlier push compiled their calls
(``packing.py``), else copies of the arrays, from which the push packs on
its own thread as a blocking push would (compiling the chunks' calls there
first, before any ``/update_weights``: the next push snapshots with them).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from uniqueid import UpdateInfo, as_clients

from ..core import senders
from ..core.broadcaster import parts_of
from ..core.config import SendConfig
from ..core.errors import TransferError
from ..core.feeds import Copies, Produced, Received, Tensors
from ..core.group import Share, TrainerGroup, join_gathers, share_from_process_0
from ..core.push import Feed, PreparedPush, Round
from ..core.routes import ProcessGroup, SingleProcess, usable_device
from ..core.senders import Servers, VerifyResult, check_push, open_session
from ..core.session import PendingSend, Session, Ticket
from ..core.snapshot import copied, nbytes, once
from ..core.stats import SendStats
from ..core.tensors.describe import (
    Descriptions,
    Placement,
    Sources,
    addressable,
    describe,
    on_device,
    readiness,
    unmeshed,
)
from ..core.tensors.naming import Mapping, identity
from ..core.tensors.plan import LoadPlan, TensorMeta, check_against
from ..core.turns import TurnUpdate, broadcast_plan, owners_of, turn_updates
from .packing import compile_chunk, packable, writable, write_chunk

log = logging.getLogger("jax_sender")

@dataclass(frozen=True, kw_only=True)
class _Snapshot:
    """An asynchronous push's private copies of ``turn``, dispatched before
    ``send`` returns: chunk ``k`` packed by XLA (``chunks``), and a copy of
    the source array of every tensor in no such chunk (``sources``: the
    caller's paths; None where a tensor is in ``chunks``). ``by_xla``: the
    push's chunks are XLA's (``chunks``, or made from ``sources`` on the
    push's thread), not copies into staging slots."""

    turn: TurnUpdate
    chunks: dict[int, jax.Array]
    sources: Sources
    by_xla: bool

    def arrays(self) -> list[jax.Array]:
        """Every array the snapshot holds."""
        return [*self.chunks.values(), *(a for a in self.sources.arrays if a is not None)]


class WeightSender:
    """The trainer's side of weight transfer to one or more vLLM servers.

    Build it with ``connect`` (one trainer process) or ``connect_group``
    (several). ``mapping`` names pytree leaves and transforms them (see
    ``naming.py``); ``config`` holds every setting (``SendConfig``); the wire
    geometry went to the workers at init, so the two sides cannot disagree.

    Args:
        session: the connection and its pushes (``session.py``).
        mapping: names and transforms.
        load_plan: what the workers were told at init, or None.
        device: the JAX device the arrays are sent from.
    """

    def __init__(self, session: Session, *, mapping: Mapping = Mapping(),
                 load_plan: LoadPlan | None = None, device: jax.Device):
        self.session = session
        self.mapping = mapping
        self.device = device
        self._descriptions = Descriptions(mapping, device, load_plan)
        self._place = Placement(mapping=mapping, device=device,
                                wait_timeout_s=session.config.wait_timeout_s)
        self._turns: tuple[Any, list[TurnUpdate]] | None = None  # kept while metadata is the same
        # The last asynchronous push's chunk buffers, by chunk: the next one writes
        # into them again (donated), once that push is over.
        self._staging: dict[int, jax.Array] = {}
        # The metadata whose chunks' jitted calls every one ran once (compiled).
        self._compiled: list[TensorMeta] | None = None
        session.on_reset.append(self._drop_staging)

    @classmethod
    def connect(cls, servers: Servers, *, device: int | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                load_plan: Any = None, workers: Sequence[int] | None = None) -> WeightSender:
        """Join the servers' workers (init + warm-up) and return a sender.

        Args:
            servers: a URL, a ``VLLMClient``, or a list of either.
            device: CUDA ordinal of the trainer's GPU (default: JAX's first GPU).
            mapping: names and transforms the pytree's leaves.
            config: every setting.
            load_plan: params (or pairs) whose metadata is shipped at init
                with ``use_load_plan`` [newer vLLM; 0.33.0 refuses it]; every
                later send must then be a subset of it. Off by default.
            workers: each server's worker count, asked when not given.

        Returns:
            The sender.

        Raises:
            TransferError: no usable GPU here (nothing reached a server).
            NcclLibraryNotFound: no usable libnccl (nothing reached a server).
            MetadataError: a ``load_plan`` the workers could not take
                (nothing reached a server).
            ValueError: no server given, or a URL that is not http(s).
            RendezvousError: a server refused, or the group did not form.
            NcclError: NCCL refused the trainer's init (a version mismatch,
                a duplicate GPU, ...).
        """
        ordinal, jax_dev = usable_device(device)
        plan = None if load_plan is None else LoadPlan(describe(load_plan, mapping)[0])
        route = SingleProcess(clients=as_clients(servers), device=ordinal, config=config,
                              metadata=None if plan is None else plan.to_payload(),
                              workers=workers)
        return cls(open_session(route, config, jax_dev), mapping=mapping, load_plan=plan,
                   device=jax_dev)

    @classmethod
    def connect_group(cls, servers: Servers, params: Any, *, device: int | None = None,
                      mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                      share: Share = share_from_process_0, load_plan: Any = None,
                      workers: Sequence[int] | None = None) -> WeightSender:
        """Every trainer process of a multi-host JAX job calls this, with the
        same ``params`` (global arrays) and arguments: each parameter is sent
        by its first owner (see ``turns.py``). Process 0 talks to the servers
        and shares the unique id and world size through ``share`` (default:
        JAX's own broadcast between processes); the other broadcasters join
        as group ranks 1..; the rest hold no communicator. ``servers`` is read
        on process 0 only. Later sends must keep the same broadcasters.

        Args:
            servers, device, mapping, config, load_plan, workers: as ``connect``.
            params: the global arrays to be pushed, for their owners.
            share: how process 0's id reaches the others.

        Returns:
            This process's sender.

        Raises:
            TransferError, NcclLibraryNotFound, ValueError: as ``connect``.
            MetadataError: arrays the workers could not take, or an
                ownership layout vLLM cannot take.
            RendezvousError: the group did not form (``RendezvousTimeout``:
                not every process called this in time).
            NcclError: NCCL refused this process's init.
        """
        ordinal, jax_dev = usable_device(device)
        plan = None if load_plan is None else LoadPlan(describe(load_plan, mapping)[0])
        metas, sources = describe(params, mapping)
        process = jax.process_index()
        group = TrainerGroup(
            plan=broadcast_plan(metas, [owners_of(a) for a in sources.arrays]),
            process=process, device=ordinal, share=share,
            clients=as_clients(servers) if process == 0 else [], config=config,
            metadata=None if plan is None else plan.to_payload(), workers=workers)
        return cls(open_session(ProcessGroup(group=group), config, jax_dev), mapping=mapping,
                   load_plan=plan, device=jax_dev)

    # -- the push ------------------------------------------------------
    def send(self, params: Any, *, weight_version: str | None = None,
             metadata: Sequence[TensorMeta] | None = None, pause: str | None = None,
             wait: bool = True) -> SendStats | PendingSend:
        """Push ``params`` (a pytree, or ``(name, array)`` pairs) to every worker.

        One push at a time: a send while another is in flight (this thread's
        ``wait=False`` push, or another thread's) first waits for it.

        Args:
            params: the arrays.
            weight_version: stamped on the servers when the push finishes.
            metadata: what the caller declared; checked against the arrays.
            pause: ``"abort"``/``"wait"``/``"keep"`` pauses generation for the
                push and resumes it after.
            wait: False returns a ``PendingSend`` as soon as the trainer may
                go on: the push snapshots what it sends (XLA copies,
                dispatched before this returns, so a later step that donates
                the parameters cannot change them) and runs in the
                background. Nothing is compiled per tensor before it
                returns. Single-process senders only; a push whose snapshot
                would exceed ``config.staging_bytes`` runs blocking instead.

        Returns:
            The push's ``SendStats``, or its ``PendingSend``.

        Raises:
            MetadataError: nothing was sent (bad arguments or arrays).
            TransferError: ``wait=False`` on a multi-process sender (nothing sent).
            UpdateIncomplete: failed on the trainer's side after the servers
                started; they finished an incomplete update; the next send repairs it.
            SendError: failed; ``broken`` says whether ``reconnect()`` is needed.
                Also before anything is sent: the group is broken (call
                ``reconnect()``), or the push in flight did not end by its deadlines.
            SenderClosed: after ``close()``.
            KeyboardInterrupt: Ctrl-C (the push first ended on the servers).
        """
        t0 = time.perf_counter()
        check_push(weight_version, pause, metadata)
        if not wait and not self.session.route.alone:
            raise TransferError("send(wait=False) needs a single-process sender (connect): "
                                "a group's gathers run in step on every process")
        return self.session.in_turn(functools.partial(
            self._push, params, weight_version=weight_version, metadata=metadata, pause=pause,
            wait=wait, t0=t0))

    def _push(self, params: Any, ticket: Ticket, *, weight_version: str | None,
              metadata: Sequence[TensorMeta] | None, pause: str | None, wait: bool,
              t0: float) -> SendStats | PendingSend:
        """``send`` in the caller's turn: describe and plan the push, then run it."""
        metas, sources = self._descriptions.of(params)
        if metadata is not None:
            check_against(list(metadata), metas)
        turns = self._turns_of(metas, sources)
        push = self._prepared(metas, turns, weight_version, pause)
        if self.session.connection is None:  # outside the transfer group: the gathers
            return self._gathers_only(turns, sources, push, t0)
        snapshot = None if wait else self._snapshot(metas, sources, turns[0])
        feed, push.ready = self._feeds(metas, sources, snapshot)
        push.rounds = [self._round(t, feed) for t in turns]
        push.stats.prepare_s = time.perf_counter() - t0
        if snapshot is None and not wait:
            log.info("send(wait=False): a snapshot of %d B of tensors exceeds staging_bytes="
                     "%s (or they need gathering); pushing blocking", push.stats.bytes,
                     self.session.config.staging_bytes)
        return self.session.run(ticket, push, background=snapshot is not None, t0=t0)

    def _turns_of(self, metas: list[TensorMeta], sources: Sources) -> list[TurnUpdate]:
        """Every turn's tensors in wire order, its chunks and ``update_info``
        (empty lists where the workers hold this metadata already). A single
        process keeps order and chunks while its metadata stays the same
        object (the kept description); a group plans again every time, since
        its owners come from the arrays' shardings."""
        info, route = self.session.info, self.session.route
        if route.stable_plan and self._turns is not None and self._turns[0] is metas:
            turns = self._turns[1]
        else:
            turns = turn_updates(route.plan(metas, sources), metas,
                                 info.packed_buffer_size_bytes if info.packed else None, {})
            self._turns = (metas, turns)
        sent = self.session.sent
        return [replace(t, update=UpdateInfo(src=t.turn.src))
                if sent.get(t.turn.src) == t.metas else t for t in turns]

    def _prepared(self, metas: list[TensorMeta], turns: list[TurnUpdate],
                  weight_version: str | None, pause: str | None) -> PreparedPush:
        """The push's figures and deadlines, its rounds still to come."""
        info, config = self.session.info, self.session.config
        largest = max(m.nbytes for m in metas)
        timeout = config.wait_timeout_s(
            (info.packed_buffer_size_bytes if info.packed else largest) + largest)
        n_chunks = sum(len(t.chunks) if info.packed else len(t.metas) for t in turns)
        stats = SendStats(bytes=sum(m.nbytes for m in metas), tensors=len(metas),
                          chunks=n_chunks, packed=info.packed,
                          reused_metadata=all(t.update.reuse for t in turns))
        return PreparedPush(rounds=[], stats=stats, timeout_s=timeout,
                            update_timeout_s=timeout * max(n_chunks, 1) + 60,
                            sent={t.turn.src: t.metas for t in turns},
                            weight_version=weight_version, pause=pause,
                            alone=self.session.route.alone, rank=self.session.route.rank or 0)

    def _gathers_only(self, turns: list[TurnUpdate], sources: Sources, push: PreparedPush,
                      t0: float) -> SendStats:
        """A process outside the transfer group joins the gathers of what it
        co-owns, in the order the broadcasters gather (their turns, in wire order)."""
        join_gathers([t.turn for t in turns], sources.arrays, self.session.route.group.process,
                     push.timeout_s)
        push.stats.prepare_s = push.stats.returned_s = time.perf_counter() - t0
        return push.stats

    def _feeds(self, metas: list[TensorMeta], sources: Sources, snapshot: _Snapshot | None
               ) -> tuple[Callable[[TurnUpdate], Feed], Callable[[], None] | None]:
        """How this push produces its chunks, chosen once: a turn's feed, and
        the wait for the arrays it reads to be computed (None: none needed)."""
        if snapshot is not None:
            return self._snapshot_feeds(metas, snapshot)
        # Arrays this process holds are waited for before any /update_weights,
        # with or without a transform; others (host data, gathers) are got on the lane.
        local = on_device(sources, self.device)
        ready = readiness(sources) if local or addressable(sources) else None
        if self.session.info.packed and local and self.mapping.transform is not identity:
            return lambda t: self._xla_or_copies(t, metas, sources), ready  # XLA packs
        return self._by_tensor(*self._place.getter(metas, sources)), ready

    def _by_tensor(self, get: Callable[[int], jax.Array], temporaries: bool
                   ) -> Callable[[TurnUpdate], Feed]:
        """A turn's feed from its tensors ``get(i)``: copied into staging
        slots (packed), or one broadcast each."""
        packed = self.session.info.packed

        def feed(t: TurnUpdate) -> Feed:
            mine = t.turn.params
            at = lambda j: get(mine[j])  # noqa: E731
            if packed:
                return Copies(metas=t.metas, chunks=t.chunks, get=at, root=t.turn.src,
                              temporaries=temporaries)
            return Tensors(metas=t.metas, get=at, root=t.turn.src)
        return feed

    def _snapshot_feeds(self, metas: list[TensorMeta], snapshot: _Snapshot
                        ) -> tuple[Callable[[TurnUpdate], Feed], Callable[[], None]]:
        """``_feeds`` for a push from ``snapshot``: its chunks broadcast, or
        made from its copies as a blocking push makes them (those of a push
        that packs by XLA, with their calls compiled first). Each called
        once, and forgotten as it is called (``core.snapshot.once``)."""
        ready = functools.partial(jax.block_until_ready, snapshot.arrays())
        if snapshot.by_xla and not snapshot.chunks:  # its chunks' calls compile first
            ready = functools.partial(self._compile_then_wait, metas, snapshot)
        if snapshot.by_xla:
            feed = lambda t: self._from_snapshot(t, metas, snapshot)  # noqa: E731
        else:
            feed = self._by_tensor(*self._place.getter(metas, snapshot.sources))
        return lambda t: once(feed(t)), once(ready)

    def _xla_or_copies(self, t: TurnUpdate, metas: list[TensorMeta], sources: Sources) -> Feed:
        if packable(t.chunks):
            return Produced(chunks=t.chunks, make=self._packs(t, metas, sources),
                            root=t.turn.src, reuse=True)
        mine = t.turn.params
        return Copies(metas=t.metas, chunks=t.chunks, root=t.turn.src, temporaries=True,
                      get=lambda j: self._place.checked(metas, sources, mine[j]).block_until_ready())

    def _round(self, t: TurnUpdate, feed: Callable[[TurnUpdate], Feed]) -> Round:
        parts = parts_of(t.metas, t.chunks if self.session.info.packed else None)
        mine = t.turn.src == self.session.route.rank
        return Round(update=t.update.to_payload(), root=t.turn.src, parts=parts,
                     feed=feed(t) if mine else Received(parts=parts, root=t.turn.src))

    # -- the asynchronous push's snapshot -------------------------------
    def _snapshot(self, metas: list[TensorMeta], sources: Sources,
                  turn: TurnUpdate) -> _Snapshot | None:
        """Private copies of what the push sends, dispatched now, in the
        caller's thread: XLA runs them before anything the trainer dispatches
        next, so a step that donates (and overwrites) the parameters cannot
        change the bytes in flight. Where an earlier push compiled this
        layout's chunk calls, the copies are those chunks themselves (the
        push only broadcasts them); every other tensor's source array is
        copied (``packing.copies``: nothing compiled per tensor), and the
        push makes its bytes from the copy. None when they would not fit
        ``config.staging_bytes`` or the sources need gathering."""
        if not on_device(sources, self.device):
            return None
        by_xla = self.session.info.packed and packable(turn.chunks)
        compiled = by_xla and self._compiled is metas
        in_chunks = [k for k, c in enumerate(turn.chunks) if compiled and not c.single]
        outside = _outside(turn, in_chunks)
        bound = self.session.config.staging_bytes
        if bound is not None and bound < (sum(turn.chunks[k].nbytes for k in in_chunks)
                                          + nbytes([sources.arrays[i] for i in outside])):
            return None
        if not compiled:
            self._staging = {}  # another layout's buffers: free them before copying
        return _Snapshot(turn=turn, chunks=self._write_chunks(turn, metas, sources, in_chunks),
                         sources=copied(sources, outside, self.device), by_xla=by_xla)

    def _write_chunks(self, turn: TurnUpdate, metas: list[TensorMeta], sources: Sources,
                      which: list[int]) -> dict[int, jax.Array]:
        """Chunks ``which`` of ``turn``, dispatched, each written into the
        buffer the last asynchronous push used for it (donated, so nothing is
        allocated). Called only once that push is over: its broadcasts read
        those buffers."""
        if not which:
            return {}
        make = self._packs(turn, metas, sources)
        kept, self._staging = self._staging, {}  # a buffer once donated is gone
        out = {k: make(k, kept.get(k)) for k in which}
        self._staging = {k: a for k, a in out.items() if writable(turn.chunks[k], turn.metas)}
        return out

    def _compile_then_wait(self, metas: list[TensorMeta], snapshot: _Snapshot) -> None:
        """The readiness step of a push that packs its copies by XLA, on a
        thread of its own beside ``/start_weight_update``: compile every
        chunk's call for the copies (so no worker waits in NCCL while one
        compiles, and the next push snapshots with them), then wait for the
        copies."""
        turn, copied = snapshot.turn, snapshot.sources
        paths = [copied.paths[i] for i in turn.turn.params]
        arrays = [copied.arrays[i] for i in turn.turn.params]
        for c in turn.chunks:
            if not c.single:
                compile_chunk(c, turn.metas, paths, arrays, self.mapping.apply, self.device)
        self._compiled = metas
        jax.block_until_ready(snapshot.arrays())

    def _from_snapshot(self, turn: TurnUpdate, metas: list[TensorMeta],
                       snapshot: _Snapshot) -> Produced:
        """``turn``'s chunks from ``snapshot``: its chunk ``k``, or a single
        tensor made from its copy; with no chunks, every chunk made from the
        copies as a blocking push makes it. A chunk of the snapshot is kept
        for the next push, never handed on as a spare."""
        chunks, copied, params = snapshot.chunks, snapshot.sources, turn.turn.params
        make = self._packs(turn, metas, copied) if not chunks else (
            lambda k, _: chunks[k] if k in chunks
            else self._place.checked(metas, copied, params[turn.chunks[k].start]))
        return Produced(chunks=turn.chunks, make=make, root=turn.turn.src)

    def _packs(self, turn: TurnUpdate, metas: list[TensorMeta], sources: Sources
               ) -> Callable[[int, jax.Array | None], jax.Array]:
        """``make(k, spare)``: chunk ``k`` of ``turn`` packed by XLA, dispatched,
        written into ``spare`` when it fits (``packing.write_chunk``). A chunk
        of one tensor is the transform's output itself. Once every chunk of
        several tensors was made, their calls are compiled: the next
        asynchronous push of this metadata snapshots them."""
        params = turn.turn.params
        paths = [sources.paths[i] for i in params]
        arrays = unmeshed([sources.arrays[i] for i in params], self.device)
        transform = self.mapping.apply
        left = {k for k, c in enumerate(turn.chunks) if not c.single}

        def make(k: int, spare: jax.Array | None) -> jax.Array:
            c = turn.chunks[k]
            if c.single:  # broadcast from the transform's output
                return self._place.checked(metas, sources, params[c.start])
            out = write_chunk(c, turn.metas, paths, arrays, transform, self.device, spare)
            left.discard(k)
            if not left:
                self._compiled = metas
            return out
        return make

    def _drop_staging(self, aborted: bool) -> None:
        # A failed push's broadcasts may still read them: never write there again.
        self._staging = {}

    # -- checking a push -------------------------------------------------
    def verify(self, params: Any) -> VerifyResult:
        """Compare what the workers hold with ``params``, through vLLM's
        ``/weight_checker``: its SHA-256 of each runtime parameter's bytes,
        computed here for what this sender would push and compared on every
        worker of every server (asked all at once). Copies every tensor to
        the host once; waits for a push in flight first.

        Args:
            params: what was pushed.

        Returns:
            Which tensors match, differ, or cannot be checked.

        Raises:
            MetadataError: ``params`` a push could not send.
            SenderClosed: after ``close()``.
            SendError: the group is broken, or the push in flight did not
                end by its deadlines.
            RendezvousError: a server did not answer, or answered what vLLM
                never does (a ``VLLMHTTPError``, ...).
        """
        want, seen = self.session.in_turn(lambda _: self._checksums(params))
        return senders.verdict(list(want), seen)

    def _checksums(self, params: Any) -> tuple[dict[str, str], dict[str, bool]]:
        """Each tensor's SHA-256 here, and by name whether every worker's matches."""
        metas, sources = describe(params, self.mapping)
        return senders.checksums(self.session.clients, metas,
                                 self._place.getter(metas, sources)[0])

    # -- lifetime: the session's (``core.senders``) -------------------------
    config = property(senders.config)
    broken = property(senders.broken)
    servers = property(senders.servers)
    reconnect = senders.reconnect
    drop_server = senders.drop_server
    add_server = senders.add_server
    close = senders.close
    __enter__ = senders.enter
    __exit__ = senders.exit_


def _outside(turn: TurnUpdate, chunks: Sequence[int]) -> list[int]:
    """The tensors of ``turn`` in none of its ``chunks``, as indices into the
    push's sources: those an asynchronous push copies."""
    taken = {j for k in chunks for j in range(turn.chunks[k].start, turn.chunks[k].stop)}
    return [i for j, i in enumerate(turn.turn.params) if j not in taken]
