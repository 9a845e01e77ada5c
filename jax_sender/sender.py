"""``WeightSender``: push a JAX model into vLLM workers, with vLLM's update protocol.

One ``send`` is: validate everything (names, dtypes, shapes, order, devices)
before any collective; ``/start_weight_update``; ``/update_weights`` posted in
the background *while* the trainer broadcasts (the workers receive inside that
call); ``/finish_weight_update``. Metadata is sent once: an unchanged round
posts empty lists, which vLLM reads as "same as last time".

How the trainer takes part is a *route*: ``SingleProcess`` (one trainer
process sends everything) or ``ProcessGroup`` (several, see ``group.py``).
The NCCL calls run on a thread of their own (``push.py``), so a push never
hangs the caller; ``send(wait=False)`` runs the whole push in the
background, while the trainer trains.

Failures never hang: every wait has a deadline, the HTTP calls are watched
while NCCL works (a worker that refuses the update before its first
collective fails the send at once), and any failure aborts the communicator.
``reconnect()`` then shuts the servers' engines down and forms a new group.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from uniqueid import UpdateInfo, as_clients

from .base import BaseSender, PreparedPush, Servers, Sources, describe
from .config import SendConfig
from .errors import TransferError
from .group import (
    Share,
    TrainerGroup,
    TurnUpdate,
    broadcast_plan,
    join_gathers,
    owners_of,
    share_from_process_0,
    turn_updates,
)
from .naming import Mapping, identity
from .packing import packable, writable, write_chunk
from .plan import LoadPlan, TensorMeta, check_against
from .push import PendingSend, SendStats
from .routes import ProcessGroup, SingleProcess, sender_device

log = logging.getLogger("jax_sender")


@dataclass(frozen=True)
class Snapshot:
    """An asynchronous push's private copies: one per chunk of its turn
    (``chunks``, packed by XLA), or one per tensor."""

    arrays: list[jax.Array]
    chunks: bool


@dataclass(frozen=True)
class VerifyResult:
    """What ``verify`` found: tensors whose digest matches on every worker, those
    that differ somewhere, and those no server reports under their own name
    (fused or sharded at runtime, e.g. ``qkv_proj``), which it cannot check."""

    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unchecked: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatched


class WeightSender(BaseSender):
    """The trainer's side of weight transfer to one or more vLLM servers.

    ``mapping`` names pytree leaves and transforms them (see ``naming.py``);
    ``config`` holds every setting (see ``SendConfig``); the wire geometry
    went to the workers in the connection's init info, so the two sides
    cannot disagree. Build it with ``connect`` or ``connect_group``.
    """

    # Order and chunks of the last plan, kept while its metadata is the same object.
    _turns: tuple[Any, list[TurnUpdate]] | None = None
    # The last asynchronous push's chunk buffers, by chunk: the next one writes
    # into them again (donated), once that push is over.
    _staging: dict[int, jax.Array] = {}  # replaced, never changed in place

    @classmethod
    def connect(cls, servers: Servers, *, device: int | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                load_plan: Any = None, workers: Sequence[int] | None = None) -> WeightSender:
        """Join the servers' workers (init + warm-up) and return a sender.

        ``device``: CUDA ordinal of the trainer's GPU (default: JAX's first GPU).
        ``load_plan``: params (or pairs) whose metadata is shipped at init with
        ``use_load_plan`` [newer vLLM; 0.33.0 refuses it]; every later send
        must then be a subset of it, checked before any HTTP call. Off by default.
        ``workers``: each server's worker count, asked when not given.
        """
        device = sender_device(device)
        plan = None if load_plan is None else LoadPlan(describe(load_plan, mapping)[0])
        route = SingleProcess(as_clients(servers), device, config,
                              None if plan is None else plan.to_payload(), workers)
        return cls(route.form(config.init_timeout_s), route, mapping=mapping, config=config,
                   load_plan=plan)

    @classmethod
    def connect_group(cls, servers: Servers, params: Any, *, device: int | None = None,
                      mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                      share: Share = share_from_process_0, load_plan: Any = None,
                      workers: Sequence[int] | None = None) -> WeightSender:
        """Every trainer process of a multi-host JAX job calls this, with the
        same ``params`` (global arrays) and arguments: each parameter is sent
        by its first owner (see ``group.py``). Process 0 talks to the servers
        and shares the unique id and world size through ``share`` (default:
        JAX's own broadcast between processes; it waits ``config.init_timeout_s``
        at most); the other broadcasters join as group ranks 1..; the rest hold
        no communicator. ``servers`` is read on process 0 only. Later sends
        must keep the same broadcasters. ``load_plan`` as in ``connect``; every
        process checks each send."""
        device = sender_device(device)
        plan = None if load_plan is None else LoadPlan(describe(load_plan, mapping)[0])
        metas, sources = describe(params, mapping)
        process = jax.process_index()
        group = TrainerGroup(broadcast_plan(metas, [owners_of(a) for a in sources.arrays]),
                             process, device, share,
                             as_clients(servers) if process == 0 else [], config,
                             None if plan is None else plan.to_payload(), workers)
        route = ProcessGroup(group)
        return cls(route.form(config.init_timeout_s), route, mapping=mapping, config=config,
                   load_plan=plan)

    def _snapshot(self, metas: list[TensorMeta], sources: Sources,
                  turn: TurnUpdate) -> Snapshot | None:
        """Private copies of what the push sends, dispatched now, in the
        caller's thread: XLA runs them before anything the trainer dispatches
        next, so a step that donates (and overwrites) the parameters cannot
        change the bytes in flight. Packed, the copies are the chunks
        themselves (``_write_chunks``), so the push only broadcasts. None when
        they would not fit ``config.staging_bytes`` or the sources need
        gathering."""
        nbytes = sum(m.nbytes for m in metas)
        bound = self.config.staging_bytes
        if (bound is not None and nbytes > bound) or not self._on_device(sources):
            return None
        if self.info.packed and packable(turn.chunks):
            return Snapshot(self._write_chunks(turn, metas, sources), chunks=True)
        # The copies are what ``describe`` traced (the same transform, jitted), so
        # their metadata needs no check: the trainer waits for this call alone.
        return Snapshot(_copier(tuple(sources.paths), self.mapping.transform)(
            sources.arrays), chunks=False)

    def _write_chunks(self, turn: TurnUpdate, metas: list[TensorMeta],
                      sources: Sources) -> list[jax.Array]:
        """Every chunk of ``turn``, dispatched, each written into the buffer
        the last asynchronous push used for it (donated, so nothing is
        allocated). Called only once that push is over: its broadcasts read
        those buffers."""
        make = self._packs(turn, metas, sources, copy=True)
        kept, self._staging = self._staging, {}  # a buffer once donated is gone
        out = [make(k, kept.get(k)) for k in range(len(turn.chunks))]
        self._staging = {k: a for k, (c, a) in enumerate(zip(turn.chunks, out))
                         if writable(c, turn.metas)}
        return out

    def _packs(self, turn: TurnUpdate, metas: list[TensorMeta],
               sources: Sources, *, copy: bool = False
               ) -> Callable[[int, jax.Array | None], jax.Array]:
        """``make(k, spare)``: chunk ``k`` of ``turn`` packed by XLA, dispatched,
        written into ``spare`` when it fits (``packing.write_chunk``). A chunk
        of one tensor is the transform's output itself, unless ``copy`` (a
        snapshot must not share the caller's arrays)."""
        paths = [sources.paths[i] for i in turn.turn.params]
        arrays = [sources.arrays[i] for i in turn.turn.params]
        transform = self.mapping.transform

        def make(k: int, spare: jax.Array | None) -> jax.Array:
            c = turn.chunks[k]
            if c.single and not copy:  # broadcast from the transform's output
                return self._checked(metas, sources, turn.turn.params[c.start])
            return write_chunk(c, turn.metas, paths, arrays, transform, self.device, spare)
        return make

    def _turns_of(self, metas: list[TensorMeta], sources: Sources
                  ) -> list[TurnUpdate]:
        """Every turn's tensors in wire order, its chunks and ``update_info``.
        A single process keeps order and chunks while its metadata stays the
        same object (``prepare``'s cache); a group re-plans every time, since
        its owners come from the arrays' shardings."""
        info = self.info
        if self.route.stable_plan and self._turns is not None and self._turns[0] is metas:
            turns = self._turns[1]
        else:
            turns = turn_updates(self.route.plan(metas, sources), metas,
                                 info.packed_buffer_size_bytes if info.packed else None, {})
            self._turns = (metas, turns)
        return [replace(t, update=UpdateInfo(src=t.turn.src))
                if self._sent.get(t.turn.src) == t.metas else t for t in turns]

    # -- the push ------------------------------------------------------
    def send(self, params: Any, *, weight_version: str | None = None,
             metadata: Sequence[TensorMeta] | None = None, pause: str | None = None,
             wait: bool = True) -> SendStats | PendingSend:
        """Push ``params`` (a pytree, or ``(name, array)`` pairs) to every worker.

        ``metadata``: what the caller declared; checked against the arrays
        before anything is sent. ``pause``: ``"abort"``/``"wait"``/``"keep"``
        pauses generation for the push and resumes it after. In a group
        (``connect_group``) every process calls it with the same arguments.

        ``wait=False`` returns a ``PendingSend`` as soon as the trainer may go
        on: the push snapshots what it sends (XLA copies, dispatched before
        this returns, so a later step that donates the parameters cannot
        change them) and runs in the background; ``result()`` gives its
        ``SendStats`` or its ``SendError``. One push at a time: a send while
        one is in flight first waits for it. Single-process senders only;
        a push larger than ``config.staging_bytes`` runs blocking instead.
        """
        t0 = time.perf_counter()
        if not wait and not self.route.alone:
            raise TransferError("send(wait=False) needs a single-process sender (connect): "
                                "a group's gathers run in step on every process")
        self._join_pending()
        self._ensure_usable()
        metas, sources = self.prepare(params)
        if metadata is not None:
            check_against(list(metadata), metas)
        turns = self._turns_of(metas, sources)
        info = self.info
        nbytes = sum(m.nbytes for m in metas)
        largest = max(m.nbytes for m in metas)
        timeout = self.config.wait_timeout_s(
            (info.packed_buffer_size_bytes if info.packed else largest) + largest)
        n_chunks = sum(len(t.chunks) if info.packed else len(t.metas) for t in turns)
        stats = SendStats(nbytes, len(metas), n_chunks, info.packed,
                          all(t.update.reuse for t in turns), 0.0)
        if self.connection is None:  # outside the transfer group: only the gathers,
            # in the order the broadcasters gather (their turns, in wire order)
            join_gathers([t.turn for t in turns], sources.arrays, self.group.process,
                         timeout)
            stats.prepare_s = stats.returned_s = time.perf_counter() - t0
            return stats
        snapshot = None if wait else self._snapshot(metas, sources, turns[0])
        # With a transform, XLA packs each chunk in one call (``packing.py``).
        by_xla = (info.packed and snapshot is None and self.mapping.transform is not identity
                  and self._on_device(sources))
        if snapshot is not None:
            get, temporaries = snapshot.arrays.__getitem__, False
            ready = functools.partial(jax.block_until_ready, snapshot.arrays)
        else:
            get, temporaries = self._getter(metas, sources)
            ready = None if temporaries else _readiness(sources.arrays)
        rank = self.route.rank
        packed = info.packed

        def broadcast_fn(t: TurnUpdate) -> Callable[[Callable[[], None]], None]:
            def broadcast(check: Callable[[], None]) -> None:
                b = self._broadcaster
                if t.turn.src != rank:
                    b.discard(t.metas, t.chunks if packed else None, t.turn.src,
                              timeout=timeout, check=check)
                    return
                params_ = t.turn.params
                mine = lambda j: get(params_[j])  # noqa: E731
                if snapshot is not None and snapshot.chunks:
                    b.produced(t.chunks, lambda k, _: get(k), t.turn.src, timeout=timeout,
                               check=check)
                elif by_xla and packable(t.chunks):
                    b.produced(t.chunks, self._packs(t, metas, sources),
                               t.turn.src, timeout=timeout, check=check, reuse=True)
                elif packed:
                    b.packed(t.metas, t.chunks, mine, t.turn.src, timeout=timeout, check=check,
                             temporaries=temporaries)
                else:
                    b.unpacked(t.metas, mine, t.turn.src, timeout=timeout, check=check)
            return broadcast

        push = PreparedPush([(t.update.to_payload(), broadcast_fn(t)) for t in turns], stats,
                            timeout, timeout * max(n_chunks, 1) + 60,
                            {t.turn.src: t.metas for t in turns}, ready)
        stats.prepare_s = time.perf_counter() - t0
        if snapshot is None and not wait:
            log.info("send(wait=False): %d B exceed staging_bytes=%s (or need gathering); "
                     "pushing blocking", nbytes, self.config.staging_bytes)
            wait = True
        if wait:
            return self._push_here(push, weight_version, pause, t0)
        pending = self._start(push, weight_version, pause, "jax-sender-push", t0)
        stats.returned_s = time.perf_counter() - t0
        return pending

    def _forget(self) -> None:
        super()._forget()
        self._turns = None
        # A failed push's broadcasts may still read them: never write there again.
        self._staging = {}

    # -- checking a push -------------------------------------------------
    def verify(self, params: Any) -> VerifyResult:
        """Compare what the workers hold with ``params``, through vLLM's
        ``/weight_checker``: its SHA-256 of each runtime parameter's bytes,
        computed here for what this sender would push and compared on every
        worker of every server. Copies every tensor to the host once."""
        self._join_pending()
        metas, sources = describe(params, self.mapping)
        get = self._getter(metas, sources)[0]
        want = {m.name: hashlib.sha256(np.asarray(get(i)).tobytes(order="C")).hexdigest()
                for i, m in enumerate(metas)}
        seen: dict[str, bool] = {}
        for client in self.clients:
            held = client.weight_checker("checksum")["checksums"]
            for key, digest in held.items():
                name = key.split(":", 4)[-1]
                if name in want:
                    seen[name] = seen.get(name, True) and digest == want[name]
        return VerifyResult(tuple(n for n in want if seen.get(n) is True),
                            tuple(n for n in want if seen.get(n) is False),
                            tuple(n for n in want if n not in seen))


# Up to this many arrays, a push looks whether they are all computed before
# it hands a readiness wait to a thread: a look costs ~0.5 us an array, the
# thread's handoff ~50 us and a share of the GIL while /start_weight_update
# runs (0.09-0.11 ms of a 4 KiB push's 2.2 on a 2-core host, pushes with and
# without the look interleaved).
LOOK_FIRST = 64


def _readiness(arrays: list[jax.Array]) -> Callable[[], None] | None:
    """The wait until ``arrays`` are computed, or None when a look shows they are."""
    if len(arrays) <= LOOK_FIRST and all(a.is_ready() for a in arrays):
        return None
    return functools.partial(jax.block_until_ready, arrays)


@functools.lru_cache(maxsize=4)
def _copier(paths: tuple[Any, ...], transform: Callable[[Any, Any], Any]
            ) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """One jitted function that transforms and copies every array of a tree
    with these paths (compiled once per structure and shapes)."""
    return jax.jit(lambda xs: [jnp.copy(transform(p, x)) for p, x in zip(paths, xs)])
