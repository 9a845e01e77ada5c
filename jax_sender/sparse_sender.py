"""``SparseSender``: push only what changed, to vLLM's ``sparse_nccl`` backend.

The backend is fixed when the server starts, so a sparse sender is a sender
of its own, over the same core as ``WeightSender`` (``base.py``): the same
connection, push thread, deadlines, failure handling, ``reconnect()`` and
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

from uniqueid import as_clients
from uniqueid.wire import SparseUpdateInfo

from .base import BaseSender, PreparedPush, Servers, describe
from .config import SendConfig
from .naming import Mapping
from .plan import TensorMeta, check_against
from .push import SendStats
from .routes import SingleProcess, sender_device
from .sparse import Patch, check_sparse, count_changed, diff

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
        so it is refused here first. Counting the changes syncs the host once
        per tensor; each patch is then built just in time and freed once
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
        push = PreparedPush([(update.to_payload(), broadcast)], stats, timeout,
                            self.config.wait_timeout_s(nbytes) + timeout)
        stats.prepare_s = time.perf_counter() - t0
        stats = self._start(push, weight_version, pause, "jax-sender-sparse", t0).result()
        log.info("sent sparse %s (dense: %d B)", stats, sum(m.nbytes for m in metas))
        return stats
