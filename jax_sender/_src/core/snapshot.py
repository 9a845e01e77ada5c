"""An asynchronous push's snapshot: private copies of what it sends,
dispatched before ``send(wait=False)`` returns.

XLA runs the copies before anything the trainer dispatches next, so a step
that donates (and overwrites) the parameters cannot change the bytes in
flight; the push then reads the copies on its own thread. Every sender that
pushes in the background takes its snapshot here: the broadcast sender
copies what its XLA-packed chunks do not already hold (``broadcast``), the
others every array. Nothing is compiled per array, so a snapshot of 20,000
tensors holds the trainer about as long as a blocking push's preparation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .tensors.describe import Sources, unmeshed

# Arrays of one shape and dtype, this many at a time, through one jitted call
# (compiled once per shape), for the few shapes most arrays share; the rest
# one by one (``jax.device_put``).
COPY_GROUP = 64
GROUPED_SHAPES = 8


@jax.jit
def _copy_all(xs: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(x) for x in xs]


@functools.cache
def puts_copy(device: jax.Device) -> bool:
    """Whether ``jax.device_put(x, may_alias=False)`` makes a buffer of its
    own for an array already on ``device`` (a copy the runtime makes, which
    an older one refused on the same device). Looked at once per device.

    Args:
        device: the sender's device.

    Returns:
        True where the runtime copies.
    """
    x = jax.device_put(np.zeros(4, np.uint8), device)
    try:
        y = jax.device_put(x, may_alias=False)
        return y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    except RuntimeError:  # jaxlib's XlaRuntimeError: the runtime refused
        return False


def copies(arrays: Sequence[jax.Array], device: jax.Device) -> list[jax.Array]:
    """A private copy of each array (one per distinct array: a leaf that
    makes several tensors is copied once), dispatched, not waited for.

    Why not one jitted call: compiling it grows faster than linearly with
    its arrays (minutes and gigabytes for 20,000). Here nothing is compiled
    per array: the ``GROUPED_SHAPES`` shapes (and dtypes) most arrays share
    are copied ``COPY_GROUP`` at a time by one small jitted call, compiled
    once per shape; every other array by ``jax.device_put`` (a copy XLA's
    runtime makes without compiling; where it would not, ``puts_copy``, by
    a jitted copy each, compiled once per shape). Both run after what
    computes the arrays and before any later call that donates them, as any
    XLA work on an array does. A copy is committed to its device exactly
    when its array is, so a jitted call compiled for the copies runs the
    arrays as well.

    Args:
        arrays: JAX arrays on ``device`` alone.
        device: where they are.

    Returns:
        The copies, in the order of ``arrays``.
    """
    distinct = list({id(a): a for a in arrays}.values())
    by_shape: dict[Any, list[jax.Array]] = {}
    for a in distinct:  # committed or not too: XLA packs a copy as it packs the array
        by_shape.setdefault((a.aval, a.committed), []).append(a)
    common = sorted(by_shape.values(), key=len, reverse=True)[:GROUPED_SHAPES]
    made: dict[int, jax.Array] = {}
    for same in common:
        for s in range(0, len(same) - COPY_GROUP + 1, COPY_GROUP):
            group = same[s:s + COPY_GROUP]
            made.update(zip(map(id, group), _copy_all(group)))
    rest = [a for a in distinct if id(a) not in made]
    if rest and puts_copy(device):
        made.update(zip(map(id, rest), jax.device_put(rest, may_alias=False)))
    elif rest:
        made.update((id(a), _copy_all([a])[0]) for a in rest)
    return [made[id(a)] for a in arrays]


def copied(sources: Sources, which: Sequence[int], device: jax.Device) -> Sources:
    """``sources`` with the arrays ``which`` replaced by private copies
    (``copies``) and every other one by None: what the push may read once
    ``send`` returned.

    Args:
        sources: the push's (path, array) per tensor, on ``device`` alone.
        which: the tensors whose arrays the push reads.
        device: the sender's device.

    Returns:
        The copies, as the push's sources.
    """
    arrays: list[Any] = [None] * len(sources)
    made = copies(unmeshed([sources.arrays[i] for i in which], device), device)
    for i, a in zip(which, made):
        arrays[i] = a
    return Sources(sources.paths, arrays, local=True)


def nbytes(arrays: Sequence[jax.Array]) -> int:
    """The bytes ``copies`` makes of ``arrays`` (each distinct array once).

    Args:
        arrays: the arrays to copy.

    Returns:
        Their bytes.
    """
    return sum({id(a): a.nbytes for a in arrays}.values())


def once(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` for one call, forgotten as it is made: what it holds (an
    asynchronous push's copies) is freed on the thread that calls it, before
    that thread reports back, not later by whichever thread drops the push
    last. Why: a JAX array freed on a daemon thread while the interpreter
    exits aborts the process ("FATAL: exception not rethrown").

    Args:
        fn: the call to make once.

    Returns:
        What makes it (and forgets it).
    """
    box = [fn]
    return lambda *args: box.pop()(*args)
