"""``WeightSender``: push a JAX model into vLLM workers, with vLLM's update protocol.

One ``send`` is: validate everything (names, dtypes, shapes, order, devices)
before any collective; ``/start_weight_update``; ``/update_weights`` posted in
the background *while* the trainer broadcasts (the workers receive inside that
call); ``/finish_weight_update``. Metadata is sent once: an unchanged round
posts empty lists, which vLLM reads as "same as last time".

Failures never hang: every wait has a deadline, the HTTP calls are watched
while NCCL works (a worker that refuses the update before its first
collective fails the send at once), and any failure aborts the communicator.
``reconnect()`` then shuts the servers' engines down and forms a new group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import jax

from nccl_cffi import DEFAULT_INIT_TIMEOUT
from uniqueid import Connection, InitInfo, VLLMClient, as_clients, connect, in_background
from uniqueid.wire import SparseUpdateInfo

from .group import (BroadcastPlan, Share, TrainerGroup, TurnUpdate, broadcast_plan, gather,
                    join_gathers, owners_of, ready, share_from_process_0, turn_updates)
from .naming import Mapping, identity, named_arrays
from .packer import Broadcaster
from .plan import LoadPlan, MetadataError, TensorMeta, check_against, check_unique
from .sparse import Patch, check_sparse, count_changed, diff

log = logging.getLogger("jax_sender")

BroadcastFn = Callable[[Broadcaster, Callable[[], None]], None]

# Deadline per wait: a floor, plus the time the bytes take at a slow 1 GB/s.
_TIMEOUT_FLOOR = 60.0
_SLOW_BYTES_PER_S = 1e9


class SendError(RuntimeError):
    """A send failed after it started; the communicator was aborted. Call ``reconnect()``."""


@dataclass
class SendStats:
    """What one ``send`` moved and where its time went."""

    bytes: int
    tensors: int
    chunks: int
    packed: bool
    reused_metadata: bool
    prepare_s: float
    start_s: float
    transfer_s: float
    finish_s: float
    broadcast_s: float = 0.0  # first broadcast launched -> last one done (host clock)
    host_s: float = 0.0  # host time getting and packing tensors, inside transfer_s

    @property
    def total_s(self) -> float:
        return self.prepare_s + self.start_s + self.transfer_s + self.finish_s

    @property
    def transfer_gbps(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0

    def __str__(self) -> str:
        return (f"{self.bytes / 1e9:.3f} GB, {self.tensors} tensors, {self.chunks} "
                f"{'chunks' if self.packed else 'broadcasts'}: prepare {self.prepare_s:.3f}s, "
                f"start {self.start_s:.3f}s, transfer {self.transfer_s:.3f}s "
                f"({self.transfer_gbps:.1f} GB/s; broadcasts {self.broadcast_s:.3f}s), "
                f"finish {self.finish_s:.3f}s")


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


def _first_gpu() -> int:
    return jax.local_devices(backend="gpu")[0].local_hardware_id


def _load_plan(params: Any, mapping: Mapping, connect_kwargs: dict[str, Any]) -> LoadPlan | None:
    """The manifest of ``params``, added to the init info; None when off."""
    if params is None:
        return None
    plan = LoadPlan(describe(params, mapping)[0])
    connect_kwargs.update(use_load_plan=True, metadata=plan.to_payload())
    return plan


def _jax_device(ordinal: int) -> jax.Device:
    for d in jax.local_devices():
        if d.platform == "gpu" and d.local_hardware_id == ordinal:
            return d
    raise RuntimeError(f"no local JAX GPU device with CUDA ordinal {ordinal}")


class WeightSender:
    """The trainer's side of weight transfer to one or more vLLM servers.

    ``mapping`` names pytree leaves and transforms them (see ``naming.py``);
    ``packed``, buffer size and count come from the connection's init info,
    which the workers received, so the two sides cannot disagree.
    """

    def __init__(self, connection: Connection | None, *, mapping: Mapping = Mapping(),
                 timeout: float | None = None, reconnect_timeout: float = 300.0,
                 load_plan: LoadPlan | None = None, group: TrainerGroup | None = None):
        self.connection = connection
        self.mapping = mapping
        self.load_plan = load_plan
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.group = group
        self.device = _jax_device(connection.device if connection else group.device)
        self._sent: dict[int, list[TensorMeta]] = {}  # per src: what the workers hold as metadata
        self._broadcaster: Broadcaster | None = None
        self.broken: str = ""

    @classmethod
    def connect(cls, servers: str | VLLMClient | Sequence[str | VLLMClient], *,
                device: int | None = None, mapping: Mapping = Mapping(),
                load_plan: Any = None, **connect_kwargs: Any) -> "WeightSender":
        """``uniqueid.connect`` (init + warm-up) then a sender on the same device.

        ``device``: CUDA ordinal of the trainer's GPU (default: JAX's first GPU).
        ``load_plan``: params (or pairs) whose metadata is shipped at init with
        ``use_load_plan`` [newer vLLM; 0.33.0 refuses it]; every later send
        must then be a subset of it, checked before any HTTP call. Off by default.
        """
        if device is None:
            device = _first_gpu()
        plan = _load_plan(load_plan, mapping, connect_kwargs)
        return cls(connect(servers, device=device, **connect_kwargs), mapping=mapping,
                   load_plan=plan)

    @classmethod
    def connect_group(cls, servers: str | VLLMClient | Sequence[str | VLLMClient], params: Any,
                      *, device: int | None = None, mapping: Mapping = Mapping(),
                      share: Share = share_from_process_0, timeout: float = DEFAULT_INIT_TIMEOUT,
                      load_plan: Any = None, **connect_kwargs: Any) -> "WeightSender":
        """Every trainer process of a multi-host JAX job calls this, with the
        same ``params`` (global arrays) and arguments: each parameter is sent
        by its first owner (see ``group.py``). Process 0 talks to the servers
        and shares the unique id and world size through ``share`` (default:
        JAX's own broadcast between processes); the other broadcasters join
        as group ranks 1..; the rest hold no communicator. ``servers`` is read
        on process 0 only. Later sends must keep the same broadcasters.
        ``load_plan`` as in ``connect``; every process checks each send."""
        if device is None:
            device = _first_gpu()
        load = _load_plan(load_plan, mapping, connect_kwargs)
        metas, sources = describe(params, mapping)
        plan = broadcast_plan(metas, [owners_of(a) for _, a in sources])
        process = jax.process_index()
        group = TrainerGroup(plan, process, device, share,
                             as_clients(servers) if process == 0 else [], connect_kwargs,
                             timeout)
        return cls(group.form(), mapping=mapping, group=group, load_plan=load)

    @property
    def info(self) -> InitInfo:
        return self.connection.init_info if self.connection else self.group.init_info

    @property
    def clients(self) -> list[VLLMClient]:
        return self.connection.clients if self.connection else []

    # -- preparation (no collective, no HTTP) ----------------------------
    def prepare(self, params: Any) -> tuple[list[TensorMeta], list[tuple[Any, Any]]]:
        """``describe(params)``, checked against the load plan when there is one."""
        metas, sources = describe(params, self.mapping)
        if self.load_plan is not None:
            self.load_plan.check(metas)
        return metas, sources

    def _materialize(self, path: Any, arr: Any) -> jax.Array:
        """The transformed array on the sender's device, ready to be read."""
        if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
            # with this parameter's other owners (processes)
            arr = ready(gather(arr), self.timeout or _TIMEOUT_FLOOR, f"the gather of {path}")
        if not isinstance(arr, jax.Array) or arr.sharding.device_set != {self.device}:
            # Sharded or elsewhere: gather to this device (costs one full copy).
            arr = jax.device_put(arr, self.device)
        if self.mapping.transform is identity:
            return arr.block_until_ready()
        out = self.mapping.transform(path, arr)
        if out.sharding.device_set != {self.device}:
            out = jax.device_put(out, self.device)
        return out.block_until_ready()

    def _plan(self, metas: list[TensorMeta], sources: list[tuple[Any, Any]]) -> BroadcastPlan:
        """One turn for a single process; the group's turns, unchanged since connect."""
        if self.group is None:
            return BroadcastPlan.single(len(metas))
        plan = broadcast_plan(metas, [owners_of(a) for _, a in sources])
        if plan.group != self.group.plan.group:
            raise MetadataError(
                f"these arrays are broadcast by processes {list(plan.group)}, but the group "
                f"was formed with {list(self.group.plan.group)}: call reconnect() on every "
                "process with the new layout")
        return plan

    # -- the push ------------------------------------------------------
    def send(self, params: Any, *, weight_version: str | None = None,
             metadata: Sequence[TensorMeta] | None = None, pause: str | None = None) -> SendStats:
        """Push ``params`` (a pytree, or ``(name, array)`` pairs) to every worker.

        ``metadata``: what the caller declared; checked against the arrays
        before anything is sent. ``pause``: ``"abort"``/``"wait"``/``"keep"``
        pauses generation for the push and resumes it after. In a group
        (``connect_group``) every process calls it with the same arguments.
        """
        self._ensure_usable()
        t0 = time.perf_counter()
        metas, sources = self.prepare(params)
        if metadata is not None:
            check_against(list(metadata), metas)
        plan = self._plan(metas, sources)
        info = self.info
        turns = turn_updates(plan, metas, info.packed_buffer_size_bytes if info.packed else None,
                             self._sent)
        nbytes = sum(m.nbytes for m in metas)
        largest = max(m.nbytes for m in metas)
        timeout = self.timeout or _TIMEOUT_FLOOR + (
            (info.packed_buffer_size_bytes if info.packed else largest) + largest
        ) / _SLOW_BYTES_PER_S
        n_chunks = sum(len(t.chunks) if info.packed else len(t.metas) for t in turns)
        get = self._getter(metas, sources)
        if self.connection is None:  # outside the transfer group: only the gathers
            join_gathers(plan, [a for _, a in sources], self.group.process, timeout)
            return SendStats(nbytes, len(metas), n_chunks, info.packed, False,
                             time.perf_counter() - t0, 0.0, 0.0, 0.0)
        rank = self.group.rank if self.group else 0

        def broadcast_fn(t: TurnUpdate) -> BroadcastFn:
            def broadcast(b: Broadcaster, check: Callable[[], None]) -> None:
                if t.turn.src != rank:
                    b.discard(t.metas, t.chunks if info.packed else None, t.turn.src,
                              timeout=timeout, check=check)
                    return
                mine = lambda j: get(t.turn.params[j])  # noqa: E731
                if info.packed:
                    b.packed(t.metas, t.chunks, mine, t.turn.src, timeout=timeout, check=check)
                else:
                    b.unpacked(t.metas, mine, t.turn.src, timeout=timeout, check=check)
            return broadcast

        t1 = time.perf_counter()
        phases = self._round([(t.update.to_payload(), broadcast_fn(t)) for t in turns], timeout,
                             timeout * max(n_chunks, 1) + 60, weight_version, pause)
        self._sent = {t.turn.src: t.metas for t in turns}
        stats = SendStats(nbytes, len(metas), n_chunks, info.packed,
                          all(t.update.reuse for t in turns), t1 - t0, *phases)
        log.info("sent %s", stats)
        return stats

    def send_sparse(self, params: Any, previous: Any, *, tolerance: float | None = None,
                    weight_version: str | None = None, pause: str | None = None) -> SendStats:
        """Push only the elements of ``params`` that differ from ``previous`` (the
        weights the workers hold now), to servers running vLLM's ``sparse_nccl``
        backend: per tensor, its int32 flat indices then its values.

        Exact by default (bits compared, see ``sparse.py``); ``tolerance``
        skips float changes no larger than it, which is lossy. float16,
        bfloat16, float32 and float64 only, and no NaN among the changed
        values: vLLM's loader would fail on anything else after the transfer,
        so it is refused here first. Counting
        the changes syncs the host once per tensor; each patch is then built
        just in time and freed once broadcast. A tensor with no change is still
        two zero-count broadcasts, as vLLM's own sparse trainer issues them.
        """
        self._ensure_usable()
        if self.group is not None:
            raise MetadataError("vLLM's sparse engine takes patches from trainer rank 0 only: "
                                "send_sparse needs a single-process sender (connect)")
        t0 = time.perf_counter()
        metas, sources = self.prepare(params)
        before, old_sources = describe(previous, self.mapping)
        check_against(before, metas)
        for m in metas:
            check_sparse(m)
        get_new, get_old = self._getter(metas, sources), self._getter(before, old_sources)
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
        largest = max(w.nbytes for w in wire)
        timeout = self.timeout or _TIMEOUT_FLOOR + 2 * largest / _SLOW_BYTES_PER_S

        def broadcast(b: Broadcaster, check: Callable[[], None]) -> None:
            b.unpacked(wire, get, 0, timeout=timeout, check=check)

        t1 = time.perf_counter()
        # The whole call: every patch at the slow rate, then vLLM's loader.
        phases = self._round([(update.to_payload(), broadcast)], timeout,
                             timeout + nbytes / _SLOW_BYTES_PER_S + 60, weight_version, pause)
        self._sent = {}
        stats = SendStats(nbytes, len(metas), len(wire), False, False, t1 - t0, *phases)
        log.info("sent sparse %s (dense: %d B)", stats, sum(m.nbytes for m in metas))
        return stats

    def _ensure_usable(self) -> None:
        if self.broken:
            raise SendError(f"the transfer group is broken ({self.broken}); call reconnect()")

    def _getter(self, metas: list[TensorMeta],
                sources: list[tuple[Any, Any]]) -> Callable[[int], jax.Array]:
        """Tensor ``i`` on the sender's device, checked against its metadata."""
        as_described = self.mapping.transform is identity

        def get(i: int) -> jax.Array:
            arr = self._materialize(*sources[i])
            if as_described and isinstance(sources[i][1], jax.Array):
                return arr  # moving a JAX array keeps the dtype and shape it was described with
            got = TensorMeta.of(metas[i].name, arr)
            if got != metas[i]:
                raise MetadataError(f"{metas[i].name!r}: the transform gave {got.dtype} "
                                    f"{got.shape}, but {metas[i].dtype} {metas[i].shape} "
                                    "was declared")
            return arr

        return get

    def _round(self, rounds: list[tuple[dict[str, Any], BroadcastFn]], timeout: float,
               http_timeout: float, weight_version: str | None,
               pause: str | None) -> tuple[float, float, float, float, float]:
        """Pause, start, per turn an update with its broadcasts, finish, resume.
        Returns the start, transfer and finish times, and the broadcasts' span
        and host time. (Only process 0 has clients: the others just broadcast.)"""
        if pause:
            for c in self.clients:
                c.pause(pause)
        try:
            t1 = time.perf_counter()
            for c in self.clients:
                c.start_weight_update()
            t2 = time.perf_counter()
            spans = [self._transfer(payload, broadcast, timeout, http_timeout)
                     for payload, broadcast in rounds]
            t3 = time.perf_counter()
            for c in self.clients:
                c.finish_weight_update(weight_version)
            t4 = time.perf_counter()
        finally:
            if pause:
                for c in self.clients:
                    c.resume()
        return t2 - t1, t3 - t2, t4 - t3, sum(b for b, _ in spans), sum(h for _, h in spans)

    def _transfer(self, payload: dict[str, Any], broadcast: BroadcastFn, timeout: float,
                  http_timeout: float) -> tuple[float, float]:
        """Broadcast while the workers receive in ``/update_weights``; returns
        the broadcasts' own span and the host's packing time, to tell them
        from HTTP and receiver time."""
        futures: list[Future] = [in_background(c.update_weights, payload, http_timeout)
                                 for c in self.clients]

        def workers_failed() -> None:
            for f in futures:
                if f.done() and f.exception() is not None:
                    f.result()

        if self._broadcaster is None:
            self._broadcaster = Broadcaster(self.connection.comm, self.device,
                                            self.info.packed_buffer_size_bytes,
                                            self.info.packed_num_buffers)
        b = self._broadcaster
        try:
            workers_failed()
            broadcast(b, workers_failed)
            broadcast_s = time.perf_counter() - b.started if b.started else 0.0
            deadline = time.monotonic() + timeout
            for client, f in zip(self.clients, futures):
                try:
                    f.result(timeout=max(deadline - time.monotonic(), 0.0))
                except FutureTimeout:
                    raise TimeoutError(
                        f"{client.base_url}/update_weights did not answer within {timeout}s "
                        "of the last broadcast: a worker is stuck (in load_weights, or in "
                        "NCCL waiting for data that was never sent)") from None
            return broadcast_s, b.host_s
        except BaseException as e:
            self._fail(e)
            if not isinstance(e, Exception):
                raise  # Ctrl-C or exit: the group is aborted, the interrupt goes on
            raise SendError(f"weight push failed: {e}. The communicator was aborted; "
                            "call reconnect() before the next send") from e

    def _fail(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        self.connection.comm.abort(f"send failed: {type(exc).__name__}")
        self._sent = {}

    # -- lifecycle ------------------------------------------------------
    def reconnect(self, **connect_kwargs: Any) -> None:
        """Shut the servers' engines down, mint a new id and form the group again.
        In a group, every process calls it together."""
        old = self.connection
        self._drop_broadcaster()
        if old is not None:
            old.close(shutdown_servers=True)
        self._sent = {}
        if self.group is not None:
            self.group.timeout = connect_kwargs.pop("timeout", self.reconnect_timeout)
            self.group.connect_kwargs.update(connect_kwargs)
            self.connection = self.group.form()
        else:
            i = old.init_info
            kwargs = dict(packed=i.packed,
                          packed_buffer_size_bytes=i.packed_buffer_size_bytes,
                          packed_num_buffers=i.packed_num_buffers,
                          use_load_plan=i.use_load_plan, metadata=i.metadata,
                          timeout=self.reconnect_timeout)
            kwargs.update(connect_kwargs)
            self.connection = connect(old.clients, device=old.device, **kwargs)
        self.broken = ""

    def close(self) -> None:
        """Free the streams and arena, shut the servers' engines down, destroy the group."""
        self._drop_broadcaster()
        if self.connection is not None:
            self.connection.close(shutdown_servers=not self.broken)

    def _drop_broadcaster(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
