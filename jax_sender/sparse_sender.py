"""``SparseSender``: push only what changed, to vLLM's ``sparse_nccl`` backend.

The backend is fixed when the server starts, so a sparse sender is a sender
of its own, over the same core as ``WeightSender`` (``base.py``): the same
connection, NCCL thread, deadlines, failure handling, ``reconnect()`` and
``close()``. Only its round differs: per tensor, the int32 flat indices of
the changed elements, then their values (two unpacked broadcasts), as
vLLM's own sparse trainer issues them. The patches are built in
``sparse.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax

from nccl_cffi.dtypes import NCCL_TYPES
from uniqueid import as_clients
from uniqueid.wire import SparseUpdateInfo

from .base import BaseSender, PreparedPush, Servers, describe
from .config import SendConfig
from .naming import Mapping
from .plan import TensorMeta, check_against
from .push import SendStats
from .routes import SingleProcess, sender_device
from .sparse import Patch, check_sparse, count_changes, diff, padded

log = logging.getLogger("jax_sender")


class SparseSender(BaseSender):
    """The trainer's side of sparse weight updates to vLLM servers launched
    with the ``sparse_nccl`` weight-transfer backend. Build it with ``connect``.

    One trainer process only: vLLM's sparse engine takes patches from
    trainer rank 0. Patches are unpacked broadcasts, so ``config``'s packing
    settings do not apply (the connection is made unpacked).
    """

    @classmethod
    def connect(cls, servers: Servers, *, device: int | None = None,
                mapping: Mapping = Mapping(), config: SendConfig = SendConfig(),
                workers: Sequence[int] | None = None) -> SparseSender:
        """Join the servers' workers (init + warm-up) and return a sparse sender.

        ``device``: CUDA ordinal of the trainer's GPU (default: JAX's first GPU).
        ``workers``: each server's worker count, asked when not given.
        """
        config = replace(config, packed=False)
        route = SingleProcess(as_clients(servers), sender_device(device), config,
                              None, workers)
        return cls(route.form(config.init_timeout_s), route, mapping=mapping, config=config)

    def send(self, params: Any, previous: Any, *, tolerance: float | None = None,
             weight_version: str | None = None, pause: str | None = None) -> SendStats:
        """Push only the elements of ``params`` that differ from ``previous`` (the
        weights the workers hold now).

        Exact by default (bits compared, see ``sparse.py``); ``tolerance``
        skips float changes no larger than it, which is lossy. float16,
        bfloat16, float32 and float64 only, and no NaN among the changed
        values: vLLM's loader would fail on anything else after the transfer,
        so it is refused here first. Counting the changes syncs the host once;
        the patches are then built ahead of their broadcasts, at most
        ``buffer_size_bytes`` x ``num_buffers`` of them alive, and freed once
        broadcast. A tensor with no change is still two zero-count
        broadcasts, as vLLM's own sparse trainer issues them.
        """
        t0 = time.perf_counter()
        self._join_pending()
        self._ensure_usable()
        metas, sources = self.prepare(params)
        before, old_sources = describe(previous, self.mapping)
        check_against(before, metas)
        for m in metas:
            check_sparse(m)
        get_new, get_old = self._getter(metas, sources)[0], self._getter(before, old_sources)[0]
        counts = count_changes(((m.name, get_old(i), get_new(i)) for i, m in enumerate(metas)),
                               tolerance)
        update = SparseUpdateInfo([m.name for m in metas], [m.dtype for m in metas],
                                  [list(m.shape) for m in metas], counts)
        wire = [w for m, n in zip(metas, counts) for w in (
            TensorMeta(f"{m.name}:indices", "int32", (n,)),
            TensorMeta(f"{m.name}:values", m.dtype, (n,)))]
        patches = _Patches(metas, counts, get_old, get_new, tolerance,
                           self.config.buffer_size_bytes * self.config.num_buffers)
        patches.make_ahead(0)  # XLA starts on them while the HTTP calls go out

        def get(j: int) -> jax.Array:
            if j % 2:
                return patches.take(j // 2).values
            return patches.ready(j // 2).indices

        nbytes = sum(w.nbytes for w in wire)
        timeout = self.config.wait_timeout_s(2 * max(w.nbytes for w in wire))

        def broadcast(check: Callable[[], None]) -> None:
            self._broadcaster.unpacked(wire, get, 0, timeout=timeout, check=check)

        stats = SendStats(nbytes, len(metas), len(wire), False, False, 0.0)
        # The whole call: every patch at the slow rate, then vLLM's loader.
        push = PreparedPush([(update.to_payload(), broadcast)], stats, timeout,
                            self.config.wait_timeout_s(nbytes) + timeout)
        stats.prepare_s = time.perf_counter() - t0
        stats = self._push_here(push, weight_version, pause, t0)
        log.info("sent sparse %s (dense: %d B)", stats, sum(m.nbytes for m in metas))
        return stats


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
