"""``WeightSender``: push a JAX model into vLLM workers, with vLLM's update protocol.

One ``send`` is: validate everything (names, dtypes, shapes, order, devices)
before any collective; ``/start_weight_update``; ``/update_weights`` posted in
the background *while* the trainer broadcasts (the workers receive inside that
call); ``/finish_weight_update``. Metadata is sent once: an unchanged round
posts empty lists, which vLLM reads as "same as last time".

How the trainer takes part is a *route*: ``SingleProcess`` (one trainer
process sends everything) or ``ProcessGroup`` (several, see ``group.py``).
The push itself runs on a thread of its own (``push.py``), so it can run
while the trainer trains (``send(wait=False)``) and never hangs the caller.

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
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from uniqueid import Connection, InitInfo, UpdateInfo, VLLMClient, as_clients, connect
from uniqueid.wire import SparseUpdateInfo

from .config import SendConfig
from .control import ControlPlane
from .errors import MetadataError, SendError, TransferError
from .group import (
    BroadcastPlan,
    Share,
    TrainerGroup,
    TurnUpdate,
    broadcast_plan,
    gather,
    join_gathers,
    owners_of,
    ready,
    share_from_process_0,
    turn_updates,
)
from .naming import Mapping, identity, named_arrays
from .packer import Broadcaster
from .plan import LoadPlan, TensorMeta, check_against, check_unique
from .push import PendingSend, Round, SendStats, run_push
from .sparse import Patch, check_sparse, count_changed, diff

log = logging.getLogger("jax_sender")

Servers = str | VLLMClient | Sequence[str | VLLMClient]


def describe(params: Any, mapping: Mapping) -> tuple[list[TensorMeta], list[tuple[Any, Any]]]:
    """Metadata of what ``params`` would send, and per tensor (path, source array).

    Shapes and dtypes after the transform come from ``jax.eval_shape``, so
    nothing runs on the GPU. Raises ``MetadataError`` for anything the
    workers could not take.
    """
    metas, sources = [], []
    traced = mapping.transform is not identity
    for name, path, arr in named_arrays(params, mapping):
        if not isinstance(name, str) or not name:
            raise MetadataError(f"parameter at {path} has no checkpoint name")
        # Tracing costs ~0.3 ms per tensor: skipped for JAX arrays with no transform
        # (others are traced, which gives the dtype JAX will turn them into).
        out = (jax.eval_shape(lambda a, p=path: mapping.transform(p, a), arr)
               if traced or not isinstance(arr, jax.Array) else arr)
        metas.append(TensorMeta.of(name, out))
        sources.append((path, arr))
    if not metas:
        raise MetadataError("nothing to send: the parameter tree has no arrays")
    check_unique(metas)
    return metas, sources


def _structure(params: Any) -> tuple[Any, list[Any]] | None:
    """A key for ``describe``'s answer (the tree's structure, names, shapes and
    dtypes) and the leaves; None when there is no cheap key (host data)."""
    if isinstance(params, (list, tuple)) and params and isinstance(params[0], tuple):
        names = tuple(p[0] for p in params)
        leaves = [p[1] for p in params]
        tree: Any = names
    else:
        leaves, tree = jax.tree_util.tree_flatten(params)
    if not all(isinstance(x, jax.Array) for x in leaves):
        return None
    return (tree, tuple((x.shape, x.dtype) for x in leaves)), leaves


def _first_gpu() -> int:
    return jax.local_devices(backend="gpu")[0].local_hardware_id


def _jax_device(ordinal: int) -> jax.Device:
    for d in jax.local_devices():
        if d.platform == "gpu" and d.local_hardware_id == ordinal:
            return d
    raise TransferError(
        f"JAX has no local GPU with CUDA ordinal {ordinal}: install the cuda13 extra "
        "(pip install 'jax-vllm-nccl[cuda13]') and check CUDA_VISIBLE_DEVICES")


def _sender_device(device: int | None) -> int:
    """The trainer's GPU: ``device``, or JAX's first; a sentence where JAX has none."""
    if device is not None:
        return device
    try:
        return _first_gpu()
    except RuntimeError as e:  # JAX's "Unknown backend: 'gpu' requested, ..."
        raise TransferError(
            "JAX sees no GPU here, and the sender broadcasts from one: install JAX with "
            "CUDA (pip install 'jax-vllm-nccl[cuda13]') on a machine with an NVIDIA GPU") from e


@dataclass
class SingleProcess:
    """One trainer process, rank 0, sends every tensor to ``clients``' workers."""

    clients: list[VLLMClient]
    device: int
    config: SendConfig
    metadata: list[list[Any]] | None = None  # the load plan shipped at init
    workers: Sequence[int] | None = None
    rank: int = 0
    group: None = None
    # Its plan depends only on the metadata, so it is kept while that stays the
    # same; a lone sender may push in the background and send sparse patches.
    stable_plan: ClassVar[bool] = True
    alone: ClassVar[bool] = True

    def form(self, timeout_s: float) -> Connection:
        c = self.config
        return connect(self.clients, device=self.device, workers=self.workers,
                       packed=c.packed, packed_buffer_size_bytes=c.buffer_size_bytes,
                       packed_num_buffers=c.num_buffers, timeout=timeout_s,
                       use_load_plan=self.metadata is not None, metadata=self.metadata)

    def plan(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]) -> BroadcastPlan:
        return BroadcastPlan.single(len(metas))


@dataclass
class ProcessGroup:
    """This process's part in a multi-process trainer (see ``group.py``)."""

    group: TrainerGroup
    # Owners come from the arrays' shardings, so every push plans again; the
    # gathers run in step on every process, so no push runs in the background,
    # and vLLM's sparse engine takes patches from rank 0 only.
    stable_plan: ClassVar[bool] = False
    alone: ClassVar[bool] = False

    @property
    def rank(self) -> int | None:
        return self.group.rank

    @property
    def device(self) -> int:
        return self.group.device

    def form(self, timeout_s: float) -> Connection | None:
        return self.group.form(timeout_s)

    def plan(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]) -> BroadcastPlan:
        plan = broadcast_plan(metas, [owners_of(a) for _, a in sources])
        if plan.group != self.group.plan.group:
            raise MetadataError(
                f"these arrays are broadcast by processes {list(plan.group)}, but the group "
                f"was formed with {list(self.group.plan.group)}: call reconnect() on every "
                "process with the new layout")
        return plan


Route = SingleProcess | ProcessGroup


@dataclass
class _Push:
    """A validated push, ready to run: its rounds and figures."""

    rounds: list[Round]
    stats: SendStats
    timeout_s: float
    http_timeout_s: float
    sent: dict[int, list[TensorMeta]] = field(default_factory=dict)
    prefetch: Callable[[], None] = lambda: None


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


class WeightSender:
    """The trainer's side of weight transfer to one or more vLLM servers.

    ``mapping`` names pytree leaves and transforms them (see ``naming.py``);
    ``config`` holds every setting (see ``SendConfig``); the wire geometry
    went to the workers in the connection's init info, so the two sides
    cannot disagree. Build it with ``connect`` or ``connect_group``.
    """

    def __init__(self, connection: Connection | None, route: Route, *,
                 mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                 load_plan: LoadPlan | None = None, device: jax.Device | None = None,
                 broadcaster: Callable[[Connection], Broadcaster] | None = None):
        """``device`` (the JAX device the arrays are sent from; default: the
        route's GPU) and ``broadcaster`` (what moves the bytes; default:
        NCCL over the connection's communicator) are for tests, which run
        the whole push on CPU over an in-memory link."""
        self.connection = connection
        self.route = route
        self.mapping = mapping
        self.config = config
        self.load_plan = load_plan
        self.device = device or _jax_device(route.device)
        self._make_broadcaster = broadcaster or self._nccl_broadcaster
        self._sent: dict[int, list[TensorMeta]] = {}  # per src: what the workers hold
        self._described: tuple[Any, list[TensorMeta], list[Any]] | None = None
        self._turns: tuple[Any, list[TurnUpdate]] | None = None
        self._broadcaster: Broadcaster | None = None
        self._pending: PendingSend | None = None
        self._orphans: list[PendingSend] = []  # push threads abandoned inside NCCL
        self.broken: str = ""

    def _nccl_broadcaster(self, conn: Connection) -> Broadcaster:
        return Broadcaster(conn.comm, self.device, self.info.packed_buffer_size_bytes,
                           self.info.packed_num_buffers)

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
        device = _sender_device(device)
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
        device = _sender_device(device)
        plan = None if load_plan is None else LoadPlan(describe(load_plan, mapping)[0])
        metas, sources = describe(params, mapping)
        process = jax.process_index()
        group = TrainerGroup(broadcast_plan(metas, [owners_of(a) for _, a in sources]),
                             process, device, share,
                             as_clients(servers) if process == 0 else [], config,
                             None if plan is None else plan.to_payload(), workers)
        route = ProcessGroup(group)
        return cls(route.form(config.init_timeout_s), route, mapping=mapping, config=config,
                   load_plan=plan)

    @property
    def group(self) -> TrainerGroup | None:
        return self.route.group

    @property
    def info(self) -> InitInfo:
        return self.connection.init_info if self.connection else self.route.group.init_info

    @property
    def clients(self) -> list[VLLMClient]:
        return self.connection.clients if self.connection else []

    # -- preparation (no collective, no HTTP) ----------------------------
    def prepare(self, params: Any) -> tuple[list[TensorMeta], list[tuple[Any, Any]]]:
        """``describe(params)``, checked against the load plan when there is one.

        The answer is kept for the next call with the same structure, names,
        shapes and dtypes: a push of many small tensors otherwise spends more
        time describing them than sending them."""
        found = _structure(params)
        if found is not None and self._described is not None and found[0] == self._described[0]:
            metas, paths = self._described[1], self._described[2]
            return metas, list(zip(paths, found[1]))
        metas, sources = describe(params, self.mapping)
        if self.load_plan is not None:
            self.load_plan.check(metas)
        if found is not None:
            self._described = (found[0], metas, [p for p, _ in sources])
        return metas, sources

    def _materialize(self, path: Any, arr: Any) -> jax.Array:
        """The transformed array on the sender's device (not waited for)."""
        if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
            # with this parameter's other owners (processes)
            arr = ready(gather(arr), self.config.wait_timeout_s(arr.nbytes),
                        f"the gather of {path}")
        if not isinstance(arr, jax.Array) or arr.sharding.device_set != {self.device}:
            # Sharded or elsewhere: gather to this device (costs one full copy).
            arr = jax.device_put(arr, self.device)
        if self.mapping.transform is identity:
            return arr
        out = self.mapping.transform(path, arr)
        if out.sharding.device_set != {self.device}:
            out = jax.device_put(out, self.device)
        return out

    def _on_device(self, sources: Sequence[tuple[Any, Any]]) -> bool:
        """Every source a JAX array on the sender's device alone (no gather needed)."""
        dev = {self.device}
        return all(isinstance(a, jax.Array) and a.sharding.device_set == dev for _, a in sources)

    def _getter(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]
                ) -> tuple[Callable[[int], jax.Array], bool]:
        """Tensor ``i`` on the sender's device, ready and checked against its
        metadata; and whether what it returns may be a temporary."""
        if self.mapping.transform is identity and self._on_device(sources):
            # the caller's arrays as they are, one readiness wait for all
            arrays = [a for _, a in sources]
            return arrays.__getitem__, False

        def get(i: int) -> jax.Array:
            arr = self._materialize(*sources[i]).block_until_ready()
            got = TensorMeta.of(metas[i].name, arr)
            if got != metas[i]:
                raise MetadataError(f"{metas[i].name!r}: the transform gave {got.dtype} "
                                    f"{got.shape}, but {metas[i].dtype} {metas[i].shape} "
                                    "was declared")
            return arr

        return get, True

    def _snapshot(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]
                  ) -> list[jax.Array] | None:
        """Private copies of what the push sends, dispatched now, in the
        caller's thread: XLA runs them before anything the trainer dispatches
        next, so a step that donates (and overwrites) the parameters cannot
        change the bytes in flight. None when they would not fit
        ``config.staging_bytes`` or the sources need gathering."""
        nbytes = sum(m.nbytes for m in metas)
        bound = self.config.staging_bytes
        if (bound is not None and nbytes > bound) or not self._on_device(sources):
            return None
        # The copies are what ``describe`` traced (the same transform, jitted), so
        # their metadata needs no check: the trainer waits for this call alone.
        return _copier(tuple(p for p, _ in sources), self.mapping.transform)(
            [a for _, a in sources])

    def _turns_of(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]
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
            join_gathers([t.turn for t in turns], [a for _, a in sources], self.group.process,
                         timeout)
            stats.prepare_s = stats.returned_s = time.perf_counter() - t0
            return stats
        snapshot = None if wait else self._snapshot(metas, sources)
        if snapshot is not None:
            get, temporaries = snapshot.__getitem__, False
            prefetch = functools.partial(jax.block_until_ready, snapshot)
        else:
            get, temporaries = self._getter(metas, sources)
            prefetch = (functools.partial(jax.block_until_ready, [a for _, a in sources])
                        if not temporaries else (lambda: None))
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
                if packed:
                    b.packed(t.metas, t.chunks, mine, t.turn.src, timeout=timeout, check=check,
                             temporaries=temporaries)
                else:
                    b.unpacked(t.metas, mine, t.turn.src, timeout=timeout, check=check)
            return broadcast

        push = _Push([(t.update.to_payload(), broadcast_fn(t)) for t in turns], stats, timeout,
                     timeout * max(n_chunks, 1) + 60, {t.turn.src: t.metas for t in turns},
                     prefetch)
        stats.prepare_s = time.perf_counter() - t0
        pending = self._start(push, weight_version, pause, "jax-sender-push", t0)
        if snapshot is None and not wait:
            log.info("send(wait=False): %d B exceed staging_bytes=%s (or need gathering); "
                     "pushing blocking", nbytes, self.config.staging_bytes)
            wait = True
        if wait:
            return pending.result()
        stats.returned_s = time.perf_counter() - t0
        return pending

    def send_sparse(self, params: Any, previous: Any, *, tolerance: float | None = None,
                    weight_version: str | None = None, pause: str | None = None) -> SendStats:
        """Push only the elements of ``params`` that differ from ``previous`` (the
        weights the workers hold now), to servers running vLLM's ``sparse_nccl``
        backend: per tensor, its int32 flat indices then its values.

        Exact by default (bits compared, see ``sparse.py``); ``tolerance``
        skips float changes no larger than it, which is lossy. float16,
        bfloat16, float32 and float64 only, and no NaN among the changed
        values: vLLM's loader would fail on anything else after the transfer,
        so it is refused here first. Counting the changes syncs the host once
        per tensor; each patch is then built just in time and freed once
        broadcast. A tensor with no change is still two zero-count
        broadcasts, as vLLM's own sparse trainer issues them.
        """
        t0 = time.perf_counter()
        self._join_pending()
        self._ensure_usable()
        if not self.route.alone:
            raise MetadataError("vLLM's sparse engine takes patches from trainer rank 0 only: "
                                "send_sparse needs a single-process sender (connect)")
        metas, sources = self.prepare(params)
        before, old_sources = describe(previous, self.mapping)
        check_against(before, metas)
        for m in metas:
            check_sparse(m)
        get_new, get_old = self._getter(metas, sources)[0], self._getter(before, old_sources)[0]
        counts = [count_changed(m.name, get_old(i), get_new(i), tolerance)
                  for i, m in enumerate(metas)]
        update = SparseUpdateInfo([m.name for m in metas], [m.dtype for m in metas],
                                  [list(m.shape) for m in metas], counts)
        wire = [w for m, n in zip(metas, counts) for w in (
            TensorMeta(f"{m.name}:indices", "int32", (n,)),
            TensorMeta(f"{m.name}:values", m.dtype, (n,)))]
        patches: dict[int, Patch] = {}

        def get(j: int) -> jax.Array:
            i = j // 2
            if j % 2:
                return patches.pop(i).values
            # Padded to a power of two; the broadcast takes the first counts[i] elements.
            p = patches[i] = diff(metas[i].name, get_old(i), get_new(i), tolerance=tolerance,
                                  count=counts[i])
            # NCCL reads the buffers by pointer: XLA must have written them first.
            jax.block_until_ready((p.indices, p.values))
            return p.indices

        nbytes = sum(w.nbytes for w in wire)
        timeout = self.config.wait_timeout_s(2 * max(w.nbytes for w in wire))

        def broadcast(check: Callable[[], None]) -> None:
            self._broadcaster.unpacked(wire, get, 0, timeout=timeout, check=check)

        stats = SendStats(nbytes, len(metas), len(wire), False, False, 0.0)
        # The whole call: every patch at the slow rate, then vLLM's loader.
        push = _Push([(update.to_payload(), broadcast)], stats, timeout,
                     self.config.wait_timeout_s(nbytes) + timeout)
        stats.prepare_s = time.perf_counter() - t0
        stats = self._start(push, weight_version, pause, "jax-sender-sparse", t0).result()
        log.info("sent sparse %s (dense: %d B)", stats, sum(m.nbytes for m in metas))
        return stats

    def _start(self, push: _Push, weight_version: str | None, pause: str | None, name: str,
               t0: float) -> PendingSend:
        """Run ``push`` on its thread; the thread aborts the communicator on failure."""
        conn = self.connection
        if self._broadcaster is None:
            self._broadcaster = self._make_broadcaster(conn)
        broadcaster = self._broadcaster

        def work(cancelled: Callable[[], None]) -> SendStats:
            try:
                push.prefetch()
                run_push(push.rounds, ControlPlane(conn.clients), broadcaster,
                         timeout_s=push.timeout_s, http_timeout_s=push.http_timeout_s,
                         weight_version=weight_version, pause=pause, cancelled=cancelled,
                         stats=push.stats)
            except BaseException as e:
                self._fail(e, conn)
                if isinstance(e, SendError):
                    raise
                raise SendError(f"weight push failed: {type(e).__name__}: {e}. The "
                                "communicator was aborted; call reconnect() before the next "
                                "send") from e
            self._sent = push.sent
            if not push.stats.returned_s:
                push.stats.returned_s = time.perf_counter() - t0
            log.info("sent %s", push.stats)
            return push.stats

        def stuck() -> str:
            since = conn.comm.in_call_since
            if since and time.monotonic() - since > push.timeout_s:
                self.broken = self.broken or "an NCCL call did not return"
                return (f"an NCCL call did not return within {push.timeout_s}s (a peer is "
                        "gone while a connection was being set up)")
            return ""

        self._pending = PendingSend(work, name=name, stuck=stuck)
        return self._pending

    def _join_pending(self) -> None:
        """At most one push in flight: wait for the one before (its own deadlines
        bound the wait); its failure, if any, leaves the sender broken. A push
        thread abandoned inside NCCL keeps its communicator: it is never freed
        under it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except SendError:
            pass  # reported by its own handle; the sender is broken now
        if not pending.wait_stopped(0):
            self._orphans.append(pending)

    def _free_connection(self, shutdown_servers: bool) -> None:
        """Shut the servers' engines down and free the communicator, unless a
        push thread still sits inside one of its calls."""
        alive = any(not p.wait_stopped(0) for p in self._orphans)
        self.connection.close(shutdown_servers=shutdown_servers, free_comm=not alive)

    def _ensure_usable(self) -> None:
        if self.broken:
            raise SendError(f"the transfer group is broken ({self.broken}); call reconnect()")

    def _fail(self, exc: BaseException, conn: Connection) -> None:
        """On the push thread, which owns the communicator: abort it."""
        self.broken = f"{type(exc).__name__}: {exc}"
        conn.comm.abort(f"send failed: {type(exc).__name__}")
        self._sent = {}

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

    # -- lifecycle ------------------------------------------------------
    def reconnect(self) -> None:
        """Shut the servers' engines down, mint a new id and form the group again,
        with the same settings (``config.reconnect_timeout_s`` for init). In a
        group, every process calls it together."""
        self._join_pending()
        self._drop_broadcaster()
        if self.connection is not None:
            self._free_connection(shutdown_servers=True)
        self._sent, self._turns = {}, None
        self.connection = self.route.form(self.config.reconnect_timeout_s)
        self.broken = ""

    def close(self) -> None:
        """Cancel a push in flight, free the streams and slots, shut the servers'
        engines down, free the communicator, close the HTTP clients."""
        pending = self._pending
        if pending is not None and not pending.done():
            pending.cancel("close()")
            pending.wait_stopped(5.0)
        self._join_pending()
        self._drop_broadcaster()
        if self.connection is not None:
            # A broken session's server may be stuck; its engine is shut down on reconnect.
            self._free_connection(shutdown_servers=not self.broken)
        for client in getattr(self.route, "clients", []):
            client.close()

    def _drop_broadcaster(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@functools.lru_cache(maxsize=4)
def _copier(paths: tuple[Any, ...], transform: Callable[[Any, Any], Any]
            ) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """One jitted function that transforms and copies every array of a tree
    with these paths (compiled once per structure and shapes)."""
    return jax.jit(lambda xs: [jnp.copy(transform(p, x)) for p, x in zip(paths, xs)])
