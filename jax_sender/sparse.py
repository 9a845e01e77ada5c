"""Sparse updates for vLLM's ``sparse_nccl`` backend: only the changed elements.

Between two RL steps most weights may not change at all (frozen layers) or
change in a few places (LoRA merged into a few rows, small learning rates in
low precision). A patch is the int32 flat row-major indices of the changed
elements and their new values, which vLLM's sparse worker writes into its
tensor. "Changed" compares *bits*, not values, so applying the patch to the
previous weights reproduces the new ones exactly: NaN payloads, -0.0 and +0.0
included. A ``tolerance`` instead skips float changes no larger than it; the
result is then lossy, and ``Patch.lossy`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .plan import MetadataError

# vLLM's worker receives int32 indices.
MAX_ELEMENTS = 2**31 - 1
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@dataclass
class Patch:
    """The changed elements of one tensor, on the device of its arrays."""

    name: str
    shape: tuple[int, ...]
    indices: jax.Array  # int32, flat row-major
    values: jax.Array  # the tensor's dtype
    lossy: bool = False

    @property
    def count(self) -> int:
        return int(self.indices.shape[0])


def _changed(old: jax.Array, new: jax.Array, tolerance: float | None) -> jax.Array:
    if tolerance is not None and jnp.issubdtype(new.dtype, jnp.floating):
        a, b = old.astype(jnp.float32), new.astype(jnp.float32)
        # NaN compares false: a NaN on either side counts as a change.
        return ~(jnp.abs(b - a) <= tolerance)
    bits = _BITS[new.dtype.itemsize]
    return jax.lax.bitcast_convert_type(old, bits) != jax.lax.bitcast_convert_type(new, bits)


def count_changed(old: jax.Array, new: jax.Array, tolerance: float | None = None) -> int:
    """How many elements ``diff`` would put in the patch (one host sync)."""
    return int(jnp.sum(_changed(old.reshape(-1), new.reshape(-1), tolerance), dtype=jnp.int32))


def diff(name: str, old: jax.Array, new: jax.Array, *,
         tolerance: float | None = None) -> Patch:
    """The patch that turns ``old`` into ``new`` (same shape and dtype)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise MetadataError(f"{name!r}: previous {old.dtype} {old.shape} and new {new.dtype} "
                            f"{new.shape} differ; a sparse patch needs the same layout")
    if new.size > MAX_ELEMENTS:
        raise MetadataError(f"{name!r} has {new.size} elements; vLLM's sparse worker takes "
                            "int32 indices (at most 2**31 - 1 elements)")
    flat_old, flat_new = old.reshape(-1), new.reshape(-1)
    changed = _changed(flat_old, flat_new, tolerance)
    count = int(jnp.sum(changed, dtype=jnp.int32))  # one host sync: the patch's size
    indices = jnp.nonzero(changed, size=count)[0].astype(jnp.int32)
    bits = _BITS[new.dtype.itemsize]  # gathered as bits, like ``apply`` scatters
    values = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(flat_new, bits)[indices], new.dtype)
    return Patch(name, tuple(new.shape), indices, values,
                 lossy=tolerance is not None and bool(jnp.issubdtype(new.dtype, jnp.floating)))


def apply(base: jax.Array, patch: Patch) -> jax.Array:
    """``base`` with the patch written in: what the worker holds after it.

    The scatter runs on the bits: XLA may compute a bfloat16 scatter in
    float32 and quieten NaN payloads on the way.
    """
    bits = _BITS[base.dtype.itemsize]
    flat = jax.lax.bitcast_convert_type(base.reshape(-1), bits)
    out = flat.at[patch.indices].set(jax.lax.bitcast_convert_type(patch.values, bits))
    return jax.lax.bitcast_convert_type(out, base.dtype).reshape(patch.shape)
