"""Packed chunks built by XLA: a chunk's transforms and byte views, written
in place into the chunk's buffer, in one jitted call.

Why: with a transform (Flax ``(in, out)`` kernels to torch's ``(out, in)``),
packing tensor by tensor costs a dispatch, a host wait and a copy per
tensor. One jitted call per chunk (``chunk_writer``) writes each tensor's
transformed bytes at its offset in the chunk's buffer, as vLLM's consumer
reads it: one launch, no staging copy, one host wait per chunk. The buffer
is donated to the call, so XLA writes into memory it already has instead
of allocating: a blocking push's chunk buffers are written again once their
broadcasts are done, an asynchronous push's by the next asynchronous push.
The same calls are the asynchronous push's snapshot (the copies it has to
make anyway, already laid out for the wire), which runs before the
trainer's next step, so its speed is the step's: written in place it beat
concatenation (``chunk_packer``, which a chunk too large for int32 offsets
still uses; docs/benchmarks.md, "Figures behind the design").

Compiling those calls costs far more than running them, and more than
linearly in their tensors: a chunk's call is compiled once per layout, its
cost paid by the first push that packs it. So XLA packs a push only while
its calls stay small and few (``packable``); a push of more tensors is
packed by copies, and an asynchronous push of them is snapshot by
``core.snapshot.copies``, which compiles nothing per tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import SingleDeviceSharding

from ..core.tensors.plan import Chunk, TensorMeta

# Tensors per jitted chunk at most: compiling one call grows faster than
# linearly with its inputs; and tensors XLA packs in one push at most: each
# costs tens of milliseconds of compiling, whatever its size
# (docs/benchmarks.md, "Figures behind the design"). A push past either is
# packed by copies instead (``Broadcaster.packed``).
MAX_TENSORS = 256
MAX_PACKED = 512
Transform = Callable[[Any, Any], Any]


def unit_of(metas: Sequence[TensorMeta]) -> Any:
    """The widest of uint32, uint16 and uint8 that divides every tensor's bytes.

    XLA's copies cost per element, so wider words pack a chunk faster
    (docs/benchmarks.md, "Figures behind the design"); a chunk's offsets are
    then multiples of the unit too. 64-bit words would need JAX's x64 mode."""
    for unit in (jnp.uint32, jnp.uint16):
        size = jnp.dtype(unit).itemsize
        if all(m.nbytes % size == 0 for m in metas):
            return unit
    return jnp.uint8


def as_units(x: jax.Array, unit: Any) -> jax.Array:
    """``x``'s bytes as flat ``unit`` words, in memory order (what torch's
    ``view(torch.uint8)`` reads, a word at a time)."""
    flat = x.reshape(-1)
    ratio = jnp.dtype(unit).itemsize // flat.dtype.itemsize
    if ratio > 1:  # several elements per word
        flat = flat.reshape(-1, ratio)
    return jax.lax.bitcast_convert_type(flat, unit).reshape(-1)


def packable(chunks: Sequence[Chunk]) -> bool:
    """Whether XLA packs these chunks: none has more than ``MAX_TENSORS``
    tensors, and those of several tensors (each one jitted call) hold at most
    ``MAX_PACKED`` in all. A chunk of one tensor is that tensor, compiled
    into no call of its own."""
    sizes = [c.stop - c.start for c in chunks]
    return max(sizes, default=0) <= MAX_TENSORS and sum(n for n in sizes if n > 1) <= MAX_PACKED


@functools.lru_cache(maxsize=1024)
def chunk_packer(paths: tuple[Any, ...], transform: Transform,
                 metas: tuple[TensorMeta, ...]) -> Callable[[list[jax.Array]], jax.Array]:
    """One jitted call: the tensors at ``paths`` transformed, checked against
    ``metas`` (while tracing, so a mismatch raises before anything runs) and
    laid end to end as one chunk (of ``unit_of(metas)`` words). Compiled
    once per chunk layout."""

    unit = unit_of(metas)

    def pack(xs: list[jax.Array]) -> jax.Array:
        parts = []
        for path, x, meta in zip(paths, xs, metas):
            out = transform(path, x)
            meta.check(out)
            parts.append(as_units(out, unit))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    return jax.jit(pack)


def _words(chunk: Chunk, metas: Sequence[TensorMeta]) -> tuple[Any, int]:
    """The chunk's word type (``unit_of`` its tensors) and its length in words."""
    unit = unit_of(metas[chunk.start:chunk.stop])
    return unit, chunk.nbytes // jnp.dtype(unit).itemsize


def writable(chunk: Chunk, metas: Sequence[TensorMeta]) -> bool:
    """Whether ``chunk_writer`` can write this chunk: more than one tensor,
    and every offset (in words) an int32 index, as XLA's in-place update takes."""
    return not chunk.single and _words(chunk, metas)[1] < 2**31


@functools.lru_cache(maxsize=1024)
def chunk_writer(paths: tuple[Any, ...], transform: Transform, metas: tuple[TensorMeta, ...],
                 offsets: tuple[int, ...]) -> Callable[[jax.Array, list[jax.Array]], jax.Array]:
    """One jitted call ``write(buffer, xs)``: the tensors at ``paths``,
    transformed and checked as in ``chunk_packer``, written in place into
    ``buffer`` (donated: the result is the same memory) at their byte
    ``offsets``. ``buffer`` holds the chunk as ``unit_of(metas)`` words."""
    unit = unit_of(metas)
    size = jnp.dtype(unit).itemsize

    def write(buffer: jax.Array, xs: list[jax.Array]) -> jax.Array:
        for path, x, meta, offset in zip(paths, xs, metas, offsets):
            out = transform(path, x)
            meta.check(out)
            buffer = lax.dynamic_update_slice(buffer, as_units(out, unit), (offset // size,))
        return buffer

    return jax.jit(write, donate_argnums=0)


def write_chunk(chunk: Chunk, metas: Sequence[TensorMeta], paths: Sequence[Any],
                arrays: Sequence[jax.Array], transform: Transform, device: jax.Device,
                buffer: jax.Array | None = None) -> jax.Array:
    """Chunk ``chunk``'s bytes, dispatched (not waited for), as ``pack_chunk``
    but written in place: into ``buffer`` (donated) when it holds as many
    words of the chunk's unit, else into a fresh buffer. A chunk
    ``chunk_writer`` cannot write is packed by ``pack_chunk``; whether the
    result may be written into again is ``writable(chunk, metas)``."""
    if not writable(chunk, metas):
        return pack_chunk(chunk, metas, paths, arrays, transform)
    span = slice(chunk.start, chunk.stop)
    unit, words = _words(chunk, metas)
    if buffer is None or buffer.shape != (words,) or buffer.dtype != unit:
        buffer = jnp.zeros((words,), unit, device=device)
    write = chunk_writer(tuple(paths[span]), transform, tuple(metas[span]), chunk.offsets)
    return write(buffer, list(arrays[span]))


def compile_chunk(chunk: Chunk, metas: Sequence[TensorMeta], paths: Sequence[Any],
                  arrays: Sequence[jax.Array], transform: Transform, device: jax.Device) -> None:
    """Compile, without running it, the call ``write_chunk`` makes for
    ``chunk`` of these arrays (or arrays of the same shapes, dtypes and
    placement), and the fill of a fresh buffer for it: a push compiles its
    chunks' calls before the workers wait for its broadcasts."""
    span = slice(chunk.start, chunk.stop)
    xs = list(arrays[span])
    if not writable(chunk, metas):
        chunk_packer(tuple(paths[span]), transform, tuple(metas[span])).lower(xs).compile()
        return
    unit, words = _words(chunk, metas)
    jnp.zeros((words,), unit, device=device)  # one buffer, dropped: its fill is compiled
    buffer = jax.ShapeDtypeStruct((words,), unit, sharding=SingleDeviceSharding(device))
    chunk_writer(tuple(paths[span]), transform, tuple(metas[span]), chunk.offsets).lower(
        buffer, xs).compile()


def pack_chunk(chunk: Chunk, metas: Sequence[TensorMeta], paths: Sequence[Any],
               arrays: Sequence[jax.Array], transform: Transform) -> jax.Array:
    """Chunk ``chunk``'s bytes, dispatched (not waited for): ``metas``, ``paths``
    and ``arrays`` are the turn's, in wire order."""
    span = slice(chunk.start, chunk.stop)
    return chunk_packer(tuple(paths[span]), transform, tuple(metas[span]))(list(arrays[span]))
