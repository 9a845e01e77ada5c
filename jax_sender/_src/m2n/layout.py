"""A JAX array's sharding as NCCL M2N sees a trainer: each trainer process
is one source rank, holding one block of every parameter.

NCCL M2N describes a side by a 2-D mesh of consecutive ranks and, per mesh
axis, either "replicate" or "shard tensor dimension d"; exactly one axis
may shard (vLLM's ``check_placements``), and a fully replicated tensor is
carried as ``REPLICATED``. A JAX array sharded over a ``Mesh`` of devices,
possibly several per process, is read here per *process*: the union of
the blocks its devices hold. That union must be one box, the boxes of all
processes must cut one tensor dimension into equal slices, and the slice a
process holds must follow from its index the way M2N walks a mesh
row-major. What cannot be expressed so is refused before any server is
touched, in one sentence that says what to change.

Why a process, not a device, is a rank: ``libnccl_m2n`` is process-wide
single-threaded (its release notes), and its first reshard on a
communicator is a step every rank takes together, so one thread cannot
drive two ranks. A process with several GPUs assembles its box on its
sending GPU (a copy between its own devices) and sends it as one rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from uniqueid.m2n.agreement import MAX_TENSOR_DIMS, REPLICATE
from uniqueid.m2n.plan import MAX_SOURCE_SHARDS, SUPPORTED_DTYPE_NAMES

from ..core.errors import MetadataError

Box = tuple[tuple[int, int], ...]  # per tensor dimension, [start, stop)


@dataclass(frozen=True, kw_only=True)
class SourceLayout:
    """One parameter on the trainer's side, as vLLM's wire params carry it.

    Attributes:
        mesh: ``src_mesh_dims``, the source mesh over trainer ranks
            ``[0, rows * columns)``.
        placements: ``src_placements``: per mesh axis ``REPLICATE`` (-1) or
            the tensor dimension it splits; None for a tensor every rank
            holds whole.
        local_shape: the block each rank holds.
    """

    mesh: tuple[int, int]
    placements: tuple[int, int] | None
    local_shape: tuple[int, ...]

    @property
    def shards(self) -> int:
        """How many distinct blocks the trainer ranks hold."""
        if self.placements is None:
            return 1
        return next(self.mesh[a] for a, p in enumerate(self.placements) if p != REPLICATE)



def check_tensor(name: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Refuse what NCCL M2N cannot move at all.

    Raises:
        MetadataError: a dtype it does not move, or not 1 to 3 dimensions.
    """
    if dtype not in SUPPORTED_DTYPE_NAMES:
        raise MetadataError(f"{name!r} has dtype {dtype}, which NCCL M2N does not move (it moves "
                            f"{', '.join(sorted(SUPPORTED_DTYPE_NAMES))}): cast it in the transform")
    if not 1 <= len(shape) <= MAX_TENSOR_DIMS:
        raise MetadataError(
            f"{name!r} has {len(shape)} dimensions {shape}, but NCCL M2N moves tensors of 1 to "
            f"{MAX_TENSOR_DIMS}: reshape it in the mapping's transform (vLLM loads it by name "
            "and shape), or send it with the broadcast sender")


def _union(name: str, shape: tuple[int, ...], blocks: set[Box], process: int) -> Box:
    """The box a process's blocks make together; refused if they leave holes."""
    box = tuple((min(b[d][0] for b in blocks), max(b[d][1] for b in blocks))
                for d in range(len(shape)))
    covered = sum(math.prod(stop - start for start, stop in b) for b in blocks)
    if covered != math.prod(stop - start for start, stop in box):
        raise MetadataError(
            f"{name!r}: process {process} holds blocks that do not form one box ({sorted(blocks)}); "
            "NCCL M2N takes one block per trainer process: shard the parameter over the "
            "processes' axis of the mesh only, or send it with the broadcast sender")
    return box


def _cut(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> tuple[int, int]:
    """The one dimension the boxes split and into how many equal slices."""
    split = [d for d in range(len(shape)) if any(b[d] != (0, shape[d]) for b in boxes)]
    if len(split) != 1:
        raise MetadataError(
            f"{name!r} is split along dimensions {split} across the trainer processes, but "
            "NCCL M2N splits one dimension per side: shard it over one tensor dimension only")
    d = split[0]
    starts = sorted({b[d][0] for b in boxes})
    width = shape[d] // len(starts)
    if shape[d] % len(starts) or starts != [k * width for k in range(len(starts))] or any(
            b[d][1] - b[d][0] != width for b in boxes):
        raise MetadataError(
            f"{name!r}: dimension {d} (size {shape[d]}) is split unevenly across the trainer "
            f"processes ({sorted({b[d] for b in boxes})}), but NCCL M2N needs equal slices: "
            "pick a mesh size that divides it")
    return d, len(starts)


def source_layout(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> SourceLayout:
    """The M2N source layout of a parameter whose trainer process ``p`` holds
    ``boxes[p]`` (process ``p`` is source rank ``p``).

    Args:
        name: the checkpoint name, for messages.
        shape: the whole tensor's shape.
        boxes: per process, its block.

    Returns:
        The layout.

    Raises:
        MetadataError: a split M2N cannot express (two dimensions, uneven
            slices, slices in an order no row-major mesh gives, more source
            shards than M2N feeds into one destination).
    """
    t = len(boxes)
    full = tuple((0, n) for n in shape)
    if all(b == full for b in boxes):
        return SourceLayout(mesh=(t, 1), placements=None, local_shape=shape)
    d, n = _cut(name, shape, boxes)
    width = shape[d] // n
    slice_of = [b[d][0] // width for b in boxes]
    local = tuple(width if k == d else s for k, s in enumerate(shape))
    if n > MAX_SOURCE_SHARDS:
        raise MetadataError(
            f"{name!r} is split into {n} slices across the trainer processes, but NCCL M2N "
            f"feeds at most {MAX_SOURCE_SHARDS} source shards into one destination: split it "
            f"over at most {MAX_SOURCE_SHARDS} processes (replicate it over the others)")
    if slice_of == [p // (t // n) for p in range(t)]:
        return SourceLayout(mesh=(n, t // n), placements=(d, REPLICATE), local_shape=local)
    if slice_of == [p % n for p in range(t)]:
        return SourceLayout(mesh=(t // n, n), placements=(REPLICATE, d), local_shape=local)
    raise MetadataError(
        f"{name!r}: trainer processes 0..{t - 1} hold slices {slice_of} of dimension {d}, an "
        "order NCCL M2N cannot express (it walks the trainer ranks row-major over a 2-D mesh): "
        "order the mesh's devices by process index")


def _box(index: tuple[Any, ...], shape: tuple[int, ...]) -> Box:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def process_boxes(name: str, array: Any, processes: int) -> list[Box]:
    """Per trainer process, the block of ``array`` it holds (host data:
    every process holds it whole).

    Args:
        name: the checkpoint name, for messages.
        array: the tensor to send: anything with ``shape`` and ``sharding``
            (a global ``jax.Array``, a ``jax.ShapeDtypeStruct``), or host data.
        processes: the trainer processes (source ranks).

    Returns:
        One box per process.

    Raises:
        MetadataError: a process holds none of it, or blocks with holes.
    """
    shape = tuple(array.shape)
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return [tuple((0, n) for n in shape)] * processes
    held: list[set[Box]] = [set() for _ in range(processes)]
    for device, index in sharding.devices_indices_map(shape).items():
        held[device.process_index].add(_box(index, shape))
    for p, blocks in enumerate(held):
        if not blocks:
            raise MetadataError(
                f"{name!r} has no shard on trainer process {p}, but NCCL M2N "
                "needs every trainer process to hold a block of every parameter: place it on "
                "a mesh over every process's devices")
    return [_union(name, shape, blocks, p) for p, blocks in enumerate(held)]


def local_block(array: Any, box: Box, device: jax.Device) -> jax.Array:
    """This process's block of ``array`` on ``device`` (dispatched): its one
    shard as it is, or its devices' shards assembled (copies between this
    process's own devices only; nothing crosses processes).

    Args:
        array: a global ``jax.Array``, or host data.
        box: this process's block (``process_boxes``).
        device: the device it is sent from.

    Returns:
        A single-device array of the block's shape.
    """
    if not isinstance(array, jax.Array):
        return jax.device_put(np.asarray(array)[tuple(slice(a, b) for a, b in box)], device)
    shape = tuple(array.shape)
    shards = {}
    for shard in array.addressable_shards:
        shards.setdefault(_box(shard.index, shape), shard.data)
    if len(shards) == 1:
        (data,) = shards.values()
        return data if data.devices() == {device} else jax.device_put(data, device)
    out = jnp.zeros(tuple(b - a for a, b in box), array.dtype, device=device)
    for b, data in shards.items():
        where = tuple(slice(lo - base, hi - base) for (lo, hi), (base, _) in zip(b, box))
        out = out.at[where].set(jax.device_put(data, device))
    return out
