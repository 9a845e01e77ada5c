"""vLLM 0.33.0's ``validate_transfer_plan`` over wire parameters, torch-free:
the check each ``nccl_m2n`` rank runs on the complete plan (source layouts
and the destination placements the first worker published) before the
complete-plan agreement.

Why the trainer runs it too: vLLM's trainer does, and sends what it
raises as its ``local_error``; a plan the workers refuse then fails on
every rank with every rank's reason, and a trainer never starts a
reshard the library would refuse. The messages are vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence

from .agreement import (
    MAX_TENSOR_DIMS,
    REPLICATE,
    M2NMesh,
    M2NWireParam,
    Placements,
    check_placements,
)

__all__ = ["MAX_DEST_SHARDS", "MAX_SOURCE_SHARDS", "SUPPORTED_DTYPE_NAMES", "validate_transfer_plan"]

MAX_SOURCE_SHARDS = 16
MAX_DEST_SHARDS = 64
# torch's names of the dtypes nccl_m2n moves (vLLM's SUPPORTED_DTYPES).
SUPPORTED_DTYPE_NAMES = frozenset({
    "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "int32", "uint32",
    "float32", "int64", "uint64", "float64",
})


def check_transferable(name: str, dtype_name: str, shape: Sequence[int]) -> None:
    """vLLM's ``check_transferable``: a dtype and a rank nccl_m2n moves.

    Args:
        name: the parameter's name.
        dtype_name: torch's name of its dtype.
        shape: its shape.

    Raises:
        ValueError: in vLLM's words.
    """
    if dtype_name not in SUPPORTED_DTYPE_NAMES:
        supported = sorted(f"torch.{d}" for d in SUPPORTED_DTYPE_NAMES)
        raise ValueError(f"parameter '{name}' has dtype torch.{dtype_name}, which nccl_m2n does not "
                         f"support. Supported: {supported}")
    if not 1 <= len(shape) <= MAX_TENSOR_DIMS:
        raise ValueError(f"parameter '{name}' has rank {len(shape)}; nccl_m2n supports rank "
                         f"1..{MAX_TENSOR_DIMS}")


def resolve_layout(mesh: M2NMesh, placements: Placements | None,
                   context: str) -> tuple[M2NMesh, Placements]:
    """vLLM's ``resolve_layout``: a replicated tensor over the same ranks
    as a ``(size, 1)`` mesh sharding dim 0 over the axis of 1.

    Args:
        mesh: the side's mesh.
        placements: the tensor's codes, or None (replicated).
        context: names them in errors.

    Returns:
        The mesh and codes nccl_m2n is given.
    """
    if placements is None:
        return M2NMesh(dims=(mesh.size, 1), start_rank=mesh.start_rank), (REPLICATE, 0)
    check_placements(placements, context)
    return mesh, tuple(placements)


def validate_layout(mesh: M2NMesh, placements: Placements, shape: Sequence[int],
                    context: str) -> tuple[int, ...]:
    """vLLM's ``validate_layout``: each sharded dim exists and divides evenly.

    Args:
        mesh: the resolved mesh.
        placements: the resolved codes.
        shape: the full shape.
        context: names the layout in errors.

    Returns:
        The local shape on each rank.

    Raises:
        ValueError: in vLLM's words.
    """
    local = list(shape)
    for axis, dim in enumerate(placements):
        if dim == REPLICATE:
            continue
        if dim >= len(shape):
            raise ValueError(f"{context} shards tensor dim {dim}, but parameter has rank {len(shape)}")
        if shape[dim] % mesh.dims[axis]:
            raise ValueError(f"{context} shards dim {dim} (size {shape[dim]}) over {mesh.dims[axis]} "
                             "ranks, which does not divide evenly")
        local[dim] //= mesh.dims[axis]
    return tuple(local)


def _shard_spec(mesh: M2NMesh, placements: Placements) -> tuple[int, int]:
    return next((code, mesh.dims[axis]) for axis, code in enumerate(placements) if code != REPLICATE)


def _max_overlaps(extent: int, partitions: int, other_partitions: int) -> int:
    """The most of the other partitioning's parts that one part meets."""
    width, other_width = extent // partitions, extent // other_partitions
    return max((((index + 1) * width - 1) // other_width - (index * width) // other_width + 1
                for index in range(partitions)), default=0)


def check_plan_limits(src: tuple[M2NMesh, Placements], dst: tuple[M2NMesh, Placements], name: str,
                      shape: Sequence[int]) -> None:
    """vLLM's ``check_plan_limits``: fan-in and fan-out within nccl_m2n's.

    Args:
        src: the resolved source mesh and codes.
        dst: the resolved destination mesh and codes.
        name: the parameter's name.
        shape: its shape.

    Raises:
        ValueError: in vLLM's words.
    """
    src_dim, src_shards = _shard_spec(*src)
    dst_dim, dst_shards = _shard_spec(*dst)
    if any(extent == 0 for extent in shape):
        sources = targets = 0
    elif src_dim != dst_dim:
        sources, targets = src_shards, dst_shards
    else:
        sources = _max_overlaps(shape[src_dim], dst_shards, src_shards)
        targets = _max_overlaps(shape[src_dim], src_shards, dst_shards)
    if sources > MAX_SOURCE_SHARDS:
        raise ValueError(f"parameter '{name}' would feed up to {sources} source shards into one "
                         f"destination shard, over nccl_m2n MAX_SOURCES={MAX_SOURCE_SHARDS}")
    if targets > MAX_DEST_SHARDS:
        raise ValueError(f"parameter '{name}' would fan one source shard out to up to {targets} "
                         f"destination shards, over nccl_m2n MAX_TARGETS={MAX_DEST_SHARDS}")


def validate_transfer_plan(params: Sequence[M2NWireParam], dst_mesh: M2NMesh,
                           dst_placements: Sequence[Placements | None]) -> None:
    """vLLM's ``validate_transfer_plan``: the complete ordered plan.

    Args:
        params: the source plan.
        dst_mesh: the workers' mesh.
        dst_placements: one placement (or None) per parameter, as the first
            worker published them.

    Raises:
        ValueError, TypeError: the first problem, in vLLM's words; send
            ``f"{type(e).__name__}: {e}"`` as the complete-plan agreement's
            ``local_error``.
    """
    if len(dst_placements) != len(params):
        raise ValueError(f"destination plan has {len(dst_placements)} parameters, expected {len(params)}")
    for param, placement in zip(params, dst_placements):
        name, shape = param.name, param.shape
        check_transferable(name, param.dtype_name, shape)
        src = resolve_layout(M2NMesh(dims=param.src_mesh_dims, start_rank=0), param.src_placements,
                             f"parameter '{name}' source placements")
        validate_layout(*src, shape, f"parameter '{name}' source layout")
        dst = resolve_layout(dst_mesh, placement, f"parameter '{name}' destination placements")
        validate_layout(*dst, shape, f"parameter '{name}' destination layout")
        check_plan_limits(src, dst, name, shape)
