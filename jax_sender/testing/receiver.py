"""A torch-free worker that receives exactly like a vLLM 0.33.0 NCCL worker.

It joins through the unique-id path with the warm-up, receives packed chunks
(cut by the same rule, ``plan.plan_chunks``) or one broadcast per tensor,
reuses the previous metadata on empty updates, and hands each
``(name, array)`` to a ``load_weights`` callback; the default stores JAX
arrays. Checksums follow vLLM's ``/weight_checker`` rule: SHA-256 of each
tensor's raw C-order bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from nccl_cffi import Communicator, cuda, numpy_dtype
from uniqueid import InitInfo, SparseUpdateInfo, UpdateInfo, handshake

from .._src.core.broadcaster import buffer_pointer
from .._src.core.routes import jax_device
from .._src.core.tensors.plan import WIRE_DTYPES, LoadPlan, TensorMeta, check_alignment, plan_chunks
from .._src.sparse.patches import Patch, apply, check_patch

LoadWeights = Callable[[Iterable[tuple[str, jax.Array]]], None]


def _device_zeros(shape: tuple[int, ...], dtype: str, device: jax.Device) -> jax.Array:
    arr = jax.device_put(jnp.zeros(shape, numpy_dtype(dtype)), device)
    return arr.block_until_ready()


class ReferenceWorker:
    """One receiving rank (one GPU). Not thread-safe: one call at a time."""

    def __init__(self, device: int = 0, *, worker_rank: int = 0,
                 load_weights: LoadWeights | None = None, timeout: float = 600.0):
        self.ordinal = device
        self.device = jax_device(device)
        self.worker_rank = worker_rank
        self.timeout = timeout
        self.store: dict[str, jax.Array] = {}
        self.load_weights = load_weights or self._store
        self.comm: Communicator | None = None
        self.info: InitInfo | None = None
        self.plan: LoadPlan | None = None  # with use_load_plan: the manifest from init
        self._last: dict[int, UpdateInfo] = {}  # per src: what an empty update reuses
        self._stream: cuda.Stream | None = None

    def _store(self, pairs: Iterable[tuple[str, jax.Array]]) -> None:
        for name, arr in pairs:
            self.store[name] = arr

    def init(self, info: InitInfo) -> None:
        """``init_transfer_engine``: join as rank ``rank_offset + worker_rank``, warm up."""
        self.shutdown()
        rank = info.rank_offset + self.worker_rank
        if not rank < info.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {info.world_size}")
        plan = LoadPlan.from_payload(info.metadata) if info.use_load_plan else None
        self.comm = handshake(info.world_size, info.unique_id, rank, self.ordinal,
                              timeout=self.timeout)
        self.info = info
        self.plan = plan
        self._last = {}
        self._stream = cuda.Stream(self.ordinal)

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.abort("shutdown")
            self.comm = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _require_init(self) -> None:
        if self.comm is None or self.info is None:
            raise RuntimeError("NCCL weight transfer not initialized. "
                               "Call init_transfer_engine() first.")

    @staticmethod
    def _metas(update: UpdateInfo | SparseUpdateInfo) -> list[TensorMeta]:
        """The update's tensors; a dtype the wire cannot carry is refused here,
        before any collective."""
        metas = []
        for name, dt, shape in zip(update.names, update.dtype_names, update.shapes):
            if dt not in WIRE_DTYPES:
                raise ValueError(f"Unsupported dtype {dt}: should be one of {', '.join(WIRE_DTYPES)}")
            metas.append(TensorMeta(name, dt, tuple(int(d) for d in shape)))
        return metas

    def receive(self, update: UpdateInfo) -> int:
        """Receive one ``update_weights`` call's tensors; returns how many."""
        self._require_init()
        if not 0 <= update.src < self.info.rank_offset:
            raise ValueError(f"NCCL update src must be a sender rank in "
                             f"[0, {self.info.rank_offset}), got {update.src!r}.")
        if not update.names and update.src in self._last:
            update = self._last[update.src]
        metas = self._metas(update)
        if self.plan is not None:
            self.plan.check(metas)  # before any collective, like vLLM's worker
        self._last[update.src] = update  # only once accepted (vLLM keeps a refused one too)
        if self.info.packed:
            self._receive_packed(metas, update.src)
        else:
            self._receive_unpacked(metas, update.src)
        return len(metas)

    def receive_sparse(self, update: SparseUpdateInfo) -> int:
        """``sparse_nccl``, in vLLM's order: per tensor, int32 flat indices then
        values (zero-count ones too); then every patch is checked as vLLM's
        loader checks it (floating dtype, no NaN value, indices in range and
        unique), and only then written into the stored tensors (zeros if
        there is none yet)."""
        self._require_init()
        metas = self._metas(update)
        for m in metas:  # before any collective
            held = self.store.get(m.name)
            if held is not None and TensorMeta.of(m.name, held) != m:
                raise ValueError(f"sparse patch for {m.name!r} as {m.dtype} {list(m.shape)}, "
                                 f"but the worker holds {held.dtype} {list(held.shape)}")
        patches = []
        for m, count in zip(metas, update.num_updates_list):
            indices = _device_zeros((count,), "int32", self.device)
            values = _device_zeros((count,), m.dtype, self.device)
            for arr, dt in ((indices, "int32"), (values, m.dtype)):
                self.comm.broadcast(buffer_pointer(arr), count=count, dtype=dt, root=0,
                                    stream=self._stream, timeout=self.timeout)
            patches.append(Patch(m.name, m.shape, indices, values, count))
        self._wait(f"sparse patches of {len(metas)} tensors")
        for m, p in zip(metas, patches):
            check_patch(m, p)
        for m, p in zip(metas, patches):
            base = self.store.get(m.name)
            if base is None:
                base = _device_zeros(m.shape, m.dtype, self.device)
            self.load_weights([(m.name, apply(base, p))])
        return len(metas)

    def _wait(self, what: str) -> None:
        self.comm.wait(self._stream, self.timeout, what)

    def _receive_unpacked(self, metas: list[TensorMeta], src: int) -> None:
        for m in metas:
            arr = _device_zeros(m.shape, m.dtype, self.device)
            self.comm.broadcast(buffer_pointer(arr), count=m.numel, dtype=m.dtype, root=src,
                                stream=self._stream, timeout=self.timeout)
            self._wait(f"broadcast of {m.name}")
            self.load_weights([(m.name, arr)])

    def _receive_packed(self, metas: list[TensorMeta], src: int) -> None:
        chunks = plan_chunks(metas, self.info.packed_buffer_size_bytes)
        check_alignment(metas, chunks)  # where vLLM's consumer would raise
        for c in chunks:
            buf = _device_zeros((c.nbytes,), "uint8", self.device)
            self.comm.broadcast(buffer_pointer(buf), count=c.nbytes, dtype="uint8", root=src,
                                stream=self._stream, timeout=self.timeout)
            outs = []
            for m, off in zip(metas[c.start:c.stop], c.offsets):
                arr = _device_zeros(m.shape, m.dtype, self.device)
                if m.nbytes:
                    cuda.copy_async(buffer_pointer(arr), buffer_pointer(buf) + off, m.nbytes,
                                    self._stream)
                outs.append((m.name, arr))
            self._wait(f"packed chunk of {c.stop - c.start} tensors")
            self.load_weights(outs)

    def checksums(self) -> dict[str, str]:
        """vLLM's rule: SHA-256 of each stored tensor's raw C-order bytes."""
        return {f"dp0:pp0:pcp0:tp{self.worker_rank}:{name}":
                hashlib.sha256(np.asarray(arr).tobytes(order="C")).hexdigest()
                for name, arr in self.store.items()}

    def reset(self) -> None:
        self.store = {k: jnp.zeros_like(v) for k, v in self.store.items()}
