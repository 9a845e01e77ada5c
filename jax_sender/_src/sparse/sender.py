"""``SparseSender``: push only what changed, to vLLM's ``sparse_nccl`` backend.

The backend is fixed when the server starts, so a sparse sender is a sender
of its own, over the same session as ``WeightSender`` (``core/session.py``): the
same connection, NCCL thread, deadlines, failure handling, ``reconnect()``
and ``close()``. Only its round differs: per tensor, the int32 flat indices
of the changed elements, then their values (two unpacked broadcasts), as
vLLM's own sparse trainer issues them. The patches are built in
``sparse.py``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp

from nccl_cffi import NCCL_TYPES
from uniqueid import as_clients
from uniqueid.wire import SparseUpdateInfo

from ..core import senders
from ..core.broadcaster import parts_of
from ..core.config import SendConfig
from ..core.errors import MetadataError, UpdateIncomplete
from ..core.feeds import Tensors
from ..core.push import PreparedPush, Round
from ..core.routes import SingleProcess, usable_device
from ..core.senders import Servers, check_push, open_session
from ..core.session import Session, Ticket
from ..core.stats import SendStats
from ..core.tensors.describe import Descriptions, Get, Placement, describe
from ..core.tensors.naming import Mapping
from ..core.tensors.plan import TensorMeta, check_against
from .patches import Patch, check_sparse, count_changes, diff, padded

log = logging.getLogger("jax_sender")


class SparseSender:
    """The trainer's side of sparse weight updates to vLLM servers launched
    with the ``sparse_nccl`` weight-transfer backend. Build it with ``connect``.

    One trainer process only: vLLM's sparse engine takes patches from
    trainer rank 0. Patches are unpacked broadcasts, so ``config``'s packing
    settings do not apply (the connection is made unpacked).

    Args:
        session: the connection and its pushes.
        mapping: names and transforms.
        device: the JAX device the arrays are sent from.
    """

    def __init__(self, session: Session, *, mapping: Mapping = Mapping(), device: jax.Device):
        self.session = session
        self.mapping = mapping
        self.device = device
        self._descriptions = Descriptions(mapping, device, None)
        self._place = Placement(mapping=mapping, device=device,
                                wait_timeout_s=session.config.wait_timeout_s)
        self._unknown = False  # what the servers hold is unknown: the next push sends all
        session.on_reset.append(self._forget)

    @classmethod
    def connect(cls, servers: Servers, *, device: int | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                workers: Sequence[int] | None = None) -> SparseSender:
        """Join the servers' workers (init + warm-up) and return a sparse sender.

        Args:
            servers: a URL, a ``VLLMClient``, or a list of either.
            device: CUDA ordinal of the trainer's GPU (default: JAX's first GPU).
            mapping: names and transforms the pytree's leaves.
            config: every setting (its packing ones do not apply).
            workers: each server's worker count, asked when not given.

        Returns:
            The sender.

        Raises:
            TransferError: no usable GPU here (nothing reached a server).
            NcclLibraryNotFound: no usable libnccl (nothing reached a server).
            ValueError: no server given, or a URL that is not http(s).
            RendezvousError: a server refused, or the group did not form.
            NcclError: NCCL refused the trainer's init.
        """
        ordinal, jax_dev = usable_device(device)
        config = replace(config, packed=False)
        route = SingleProcess(clients=as_clients(servers), device=ordinal, config=config,
                              workers=workers)
        return cls(open_session(route, config, jax_dev), mapping=mapping, device=jax_dev)

    def send(self, params: Any, previous: Any, *, tolerance: float | None = None,
             weight_version: str | None = None, pause: str | None = None) -> SendStats:
        """Push only the elements of ``params`` that differ from ``previous``.

        Exact by default (bits compared, see ``sparse.py``); ``tolerance``
        skips float changes no larger than it, which is lossy. Counting the
        changes syncs the host once; the patches are then built ahead of
        their broadcasts, at most ``buffer_size_bytes`` x ``num_buffers`` of
        them alive. A tensor with no change is still two zero-count
        broadcasts, as vLLM's own sparse trainer issues them.

        Args:
            params: the new weights (a pytree, or pairs).
            previous: what the workers hold now, same layout; None sends
                every element (a first push, or the repair after an
                ``UpdateIncomplete``).
            tolerance: the largest float change to skip, or None (exact).
            weight_version, pause: as ``WeightSender.send``.

        Returns:
            The push's ``SendStats`` (bytes: the patches').

        Raises:
            MetadataError: float16, bfloat16, float32 and float64 only, and
                no NaN among the changed values (vLLM's loader would fail on
                anything else after the transfer); ``previous`` given while
                the servers hold an incomplete update.
            UpdateIncomplete, SendError, SenderClosed: as ``WeightSender.send``.
        """
        t0 = time.perf_counter()
        check_push(weight_version, pause, None)
        stats, dense = self.session.in_turn(functools.partial(
            self._push, params, previous, tolerance, weight_version, pause, t0))
        self._unknown = False
        log.info("sent sparse %s (dense: %d B)", stats, dense)
        return stats

    def _push(self, params: Any, previous: Any, tolerance: float | None,
              weight_version: str | None, pause: str | None, t0: float,
              ticket: Ticket) -> tuple[SendStats, int]:
        """``send`` in the caller's turn: count the changes, build the
        patches, run the push; its figures and the dense size."""
        metas, get_old, get_new, counts = self._changes(params, previous, tolerance)
        push, patches = self._prepared(metas, counts, get_old, get_new, tolerance)
        push.weight_version, push.pause = weight_version, pause
        patches.make_ahead(0)  # XLA starts on them while the HTTP calls go out
        push.stats.prepare_s = time.perf_counter() - t0
        try:
            stats = self.session.run(ticket, push, background=False, t0=t0)
        except UpdateIncomplete:
            self._unknown = True
            raise
        return stats, sum(m.nbytes for m in metas)

    def _changes(self, params: Any, previous: Any, tolerance: float | None
                 ) -> tuple[list[TensorMeta], Get, Get, list[int]]:
        """The push's metadata (sparse dtypes only), the tensors the workers
        hold and the new ones, and how many elements of each changed."""
        metas, sources = self._descriptions.of(params)
        for m in metas:
            check_sparse(m)
        get_new = self._place.getter(metas, sources)[0]
        get_old = self._previous(previous, metas, tolerance, get_new)
        counts = count_changes(((m.name, get_old(i), get_new(i))
                                for i, m in enumerate(metas)), tolerance)
        return metas, get_old, get_new, counts

    def _forget(self, aborted: bool) -> None:
        """A push aborted mid-stream may have changed some of the weights; a
        server added holds weights of its own."""
        self._unknown = self._unknown or aborted

    def _previous(self, previous: Any, metas: list[TensorMeta], tolerance: float | None,
                  get_new: Callable[[int], jax.Array]) -> Callable[[int], jax.Array]:
        """Tensor ``i`` of what the workers hold, checked against ``metas``."""
        if previous is None:
            if tolerance is not None:
                raise MetadataError("previous=None sends every element; a tolerance has "
                                    "nothing to compare with")
            return lambda i: _unlike(get_new(i))
        if self._unknown:
            raise MetadataError(
                "the servers may hold an incomplete update (the last push failed after it "
                "started), or a server added holds weights of its own, so what they hold is "
                "unknown: send(params, None) pushes every element and repairs it")
        before, old_sources = describe(previous, self.mapping)
        check_against(before, metas)
        return self._place.getter(before, old_sources)[0]

    def _prepared(self, metas: list[TensorMeta], counts: list[int],
                  get_old: Callable[[int], jax.Array], get_new: Callable[[int], jax.Array],
                  tolerance: float | None) -> tuple[PreparedPush, _Patches]:
        config = self.session.config
        update = SparseUpdateInfo([m.name for m in metas], [m.dtype for m in metas],
                                  [list(m.shape) for m in metas], counts)
        wire = [w for m, n in zip(metas, counts) for w in (
            TensorMeta(f"{m.name}:indices", "int32", (n,)),
            TensorMeta(f"{m.name}:values", m.dtype, (n,)))]
        patches = _Patches(metas, counts, get_old, get_new, tolerance,
                           config.buffer_size_bytes * config.num_buffers)

        def get(j: int) -> jax.Array:
            if j % 2:
                return patches.take(j // 2).values
            return patches.ready(j // 2).indices

        nbytes = sum(w.nbytes for w in wire)
        timeout = config.wait_timeout_s(2 * max(w.nbytes for w in wire))
        stats = SendStats(bytes=nbytes, tensors=len(metas), chunks=len(wire), packed=False,
                          reused_metadata=False)
        parts = parts_of(wire, None)
        push = PreparedPush(
            rounds=[Round(update=update.to_payload(), root=0, parts=parts,
                          feed=Tensors(metas=wire, get=get, root=0),
                          fill=functools.partial(_harmless, wire, self.device))],
            # The whole call: every patch at the slow rate, then vLLM's loader.
            stats=stats, timeout_s=timeout,
            update_timeout_s=config.wait_timeout_s(nbytes) + timeout)
        return push, patches

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


def _harmless(wire: list[TensorMeta], device: jax.Device, k: int) -> jax.Array:
    """Part ``k`` of a sparse round completed after its patches failed: a
    patch vLLM's loader takes (distinct indices in range, no NaN), writing
    zeros into a tensor's first elements; scratch bytes would repeat an
    index, which the loader refuses after the transfer."""
    m = wire[k]
    if k % 2 == 0:
        return jax.device_put(jnp.arange(m.numel, dtype=jnp.int32), device)
    return jax.device_put(jnp.zeros(m.shape, m.dtype), device)


@jax.jit
def _unlike(x: jax.Array) -> jax.Array:
    """``x`` with every bit flipped: differs from it in every element."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                            8: jnp.uint64}[x.dtype.itemsize])
    return jax.lax.bitcast_convert_type(~bits, x.dtype)


class _Patches:
    """A sparse push's patches, made ahead of their broadcasts.

    XLA builds patches while NCCL sends earlier ones, as long as the patches
    made and not yet sent fit ``budget`` bytes (the packed path's staging
    bound; at least one patch is always made). Why ahead: a patch built
    only when its turn comes leaves the link idle while XLA works on it.
    """

    def __init__(self, metas: Sequence[TensorMeta], counts: Sequence[int],
                 get_old: Callable[[int], jax.Array], get_new: Callable[[int], jax.Array],
                 tolerance: float | None, budget: int):
        self._metas, self._counts = metas, counts
        self._get_old, self._get_new, self._tolerance = get_old, get_new, tolerance
        # Padded to a power of two; the broadcast takes the first counts[i] elements.
        self._sizes = [padded(n) * (4 + NCCL_TYPES[m.dtype][1]) for m, n in zip(metas, counts)]
        self._budget = budget
        self._made: dict[int, Patch] = {}
        self._next = 0
        self._alive = 0

    def make_ahead(self, i: int) -> None:
        """Dispatch patches up to ``i`` and on while they fit the budget."""
        while self._next < len(self._metas) and (
                self._next <= i or self._alive + self._sizes[self._next] <= self._budget):
            k = self._next
            self._made[k] = diff(self._metas[k].name, self._get_old(k), self._get_new(k),
                                 tolerance=self._tolerance, count=self._counts[k])
            self._alive += self._sizes[k]
            self._next += 1

    def ready(self, i: int) -> Patch:
        """Patch ``i``, written: NCCL reads its buffers by pointer, so XLA must be done."""
        self.make_ahead(i)
        p = self._made[i]
        jax.block_until_ready((p.indices, p.values))
        return p

    def take(self, i: int) -> Patch:
        """Patch ``i``, handed to the broadcaster: it no longer counts against the budget."""
        self._alive -= self._sizes[i]
        return self._made.pop(i)
