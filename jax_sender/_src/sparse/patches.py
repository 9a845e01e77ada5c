"""Sparse updates for vLLM's ``sparse_nccl`` backend: only the changed elements.

Between two RL steps most weights may not change at all (frozen layers) or
change in a few places (LoRA merged into a few rows, small learning rates in
low precision). A patch is the int32 flat row-major indices of the changed
elements and their new values, which vLLM's sparse worker writes into its
tensor. "Changed" compares *bits*, not values, so applying the patch to the
previous weights reproduces the new ones exactly, -0.0 and +0.0 included.
A ``tolerance`` instead skips float changes no larger than it; the result is
then lossy, and ``Patch.lossy`` says so.

vLLM's sparse loader fills the unchanged positions with NaN and copies the
rest (NaN marks "keep"), so it takes floating tensors only, refuses a patch
whose values hold a NaN, and has no float8 kernel for its ``index_copy_``:
all three fail after the whole transfer (the last one found on 2 x H200).
``check_sparse`` and ``count_changes`` refuse them here, before anything is
sent.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ..core.tensors.plan import MetadataError, TensorMeta

# vLLM's worker receives int32 indices.
MAX_ELEMENTS = 2**31 - 1
# Wire dtypes vLLM 0.33.0's sparse loader can write (NaN sentinel, CUDA index_copy_).
SPARSE_DTYPES = ("float16", "bfloat16", "float32", "float64")
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclass
class Patch:
    """The changed elements of one tensor, on the device of its arrays.

    ``indices`` and ``values`` may be longer than ``count`` (their length is
    rounded up to a power of two, so XLA compiles ``diff`` once per bucket,
    not once per count); only the first ``count`` elements are the patch, and
    only those are broadcast. The padding indices point past the tensor.
    """

    name: str
    shape: tuple[int, ...]
    indices: jax.Array  # int32, flat row-major
    values: jax.Array  # the tensor's dtype
    count: int
    lossy: bool = False


def _changed(old: jax.Array, new: jax.Array, tolerance: float | None) -> jax.Array:
    if tolerance is not None:
        a, b = old.astype(jnp.float32), new.astype(jnp.float32)
        # NaN compares false: a NaN on either side counts as a change.
        return ~(jnp.abs(b - a) <= tolerance)
    bits = _BITS[new.dtype.itemsize]
    return jax.lax.bitcast_convert_type(old, bits) != jax.lax.bitcast_convert_type(new, bits)


def check_sparse(meta: TensorMeta) -> None:
    """Refuse a tensor vLLM's sparse worker cannot load, before any collective."""
    if meta.dtype not in SPARSE_DTYPES:
        raise MetadataError(
            f"{meta.name!r} is {meta.dtype}: vLLM's sparse worker loads only "
            f"{', '.join(SPARSE_DTYPES)} (NaN marks the elements it keeps, and its "
            "index_copy_ has no float8 kernel). Leave it out of the sparse update, or send "
            "it with a dense push")
    if meta.numel > MAX_ELEMENTS:
        raise MetadataError(f"{meta.name!r} has {meta.numel} elements; vLLM's sparse worker "
                            "takes int32 indices (at most 2**31 - 1 elements)")


@functools.partial(jax.jit, static_argnames="tolerance")
def _tally(old: jax.Array, new: jax.Array, tolerance: float | None) -> jax.Array:
    flat_new = new.reshape(-1)
    changed = _changed(old.reshape(-1), flat_new, tolerance)
    return jnp.stack([jnp.sum(changed, dtype=jnp.int32),
                      jnp.sum(changed & jnp.isnan(flat_new), dtype=jnp.int32)])


@functools.partial(jax.jit, static_argnames=("size", "tolerance"))
def _extract(old: jax.Array, new: jax.Array, size: int,
             tolerance: float | None) -> tuple[jax.Array, jax.Array]:
    flat_new = new.reshape(-1)
    changed = _changed(old.reshape(-1), flat_new, tolerance)
    # Stream compaction: the k-th changed element's index goes to slot k, each
    # slot written once; the rest point past the buffer and are dropped.
    # (``jnp.nonzero`` scatter-adds every element into a few bins instead,
    # which a GPU serializes on its atomics.)
    slot = jnp.where(changed, jnp.cumsum(changed, dtype=jnp.int32) - 1, size)
    indices = jnp.full((size,), flat_new.size, jnp.int32).at[slot].set(
        jnp.arange(flat_new.size, dtype=jnp.int32), mode="drop")
    bits = _BITS[new.dtype.itemsize]  # gathered as bits, like ``apply`` scatters
    values = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(flat_new, bits).at[indices].get(mode="fill", fill_value=0),
        new.dtype)
    return indices, values


def count_changes(pairs: Iterable[tuple[str, jax.Array, jax.Array]],
                  tolerance: float | None = None) -> list[int]:
    """How many elements ``diff`` would put in each ``(name, old, new)``
    patch; refuses a NaN among them. One host sync for the whole list.

    ``pairs`` may make its arrays as it goes (a transform's outputs): they
    are dropped once counted, so a tree is never held twice.
    """
    names, tallies = [], []
    for name, old, new in pairs:
        names.append(name)
        tallies.append(_tally(old, new, tolerance))
    counts = jax.device_get(tallies)
    for name, (_, nans) in zip(names, counts):
        if nans:
            raise MetadataError(
                f"{name!r}: {nans} changed elements are NaN, which vLLM's sparse worker "
                "refuses (NaN marks the elements it keeps), after the whole transfer. Send "
                "it with a dense push")
    return [int(count) for count, _ in counts]


def count_changed(name: str, old: jax.Array, new: jax.Array,
                  tolerance: float | None = None) -> int:
    """``count_changes`` of one tensor."""
    return count_changes([(name, old, new)], tolerance)[0]


def padded(count: int) -> int:
    """A patch's buffer length: ``count`` rounded up to a power of two (at least 1)."""
    return 1 << max(count - 1, 0).bit_length()  # 0 -> 1, 5 -> 8, 8 -> 8


def diff(name: str, old: jax.Array, new: jax.Array, *, tolerance: float | None = None,
         count: int | None = None) -> Patch:
    """The patch that turns ``old`` into ``new`` (same shape and dtype);
    ``count``: ``count_changed``'s answer, when already known."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise MetadataError(f"{name!r}: previous {old.dtype} {old.shape} and new {new.dtype} "
                            f"{new.shape} differ; a sparse patch needs the same layout")
    check_sparse(TensorMeta.of(name, new))
    if count is None:
        count = count_changed(name, old, new, tolerance)
    if not new.size:  # nothing to gather from
        indices, values = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), new.dtype)
    else:
        indices, values = _extract(old, new, padded(count), tolerance)
    return Patch(name, tuple(new.shape), indices, values, count, lossy=tolerance is not None)


def check_patch(meta: TensorMeta, patch: Patch) -> None:
    """What vLLM's sparse loader refuses once the patch has arrived."""
    if "float" not in meta.dtype:
        raise TypeError(f"{meta.name}: sparse checkpoint patches require a floating dtype "
                        "because NaN is the unchanged-value sentinel")
    if meta.dtype not in SPARSE_DTYPES:
        raise RuntimeError(f'"index_copy_cuda" not implemented for {meta.dtype!r}')
    idx = patch.indices[:patch.count]
    bad = jnp.any(jnp.isnan(patch.values[:patch.count])) | jnp.any((idx < 0) | (idx >= meta.numel))
    ordered = jnp.sort(idx)
    if bool(bad | jnp.any(ordered[1:] == ordered[:-1])):
        raise ValueError("Sparse checkpoint patches contain NaN values, out-of-range "
                         "indices, or duplicate indices")


def apply(base: jax.Array, patch: Patch) -> jax.Array:
    """``base`` with the patch written in: what the worker holds after it.

    The scatter runs on the bits: XLA may compute a bfloat16 scatter in
    float32 and quieten NaN payloads on the way.
    """
    bits = _BITS[base.dtype.itemsize]
    flat = jax.lax.bitcast_convert_type(base.reshape(-1), bits)
    out = flat.at[patch.indices].set(jax.lax.bitcast_convert_type(patch.values, bits),
                                     mode="drop")  # the padding points past the end
    return jax.lax.bitcast_convert_type(out, base.dtype).reshape(patch.shape)
