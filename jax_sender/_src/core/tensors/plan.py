"""Tensor metadata and the packed-mode chunk rule, shared by sender and receiver.

vLLM's packed consumer closes a chunk right after the tensor that makes the
running byte total *strictly greater* than ``packed_buffer_size_bytes``, and
never splits a tensor. Both sides derive the boundaries from the metadata
alone, so the sender must compute them exactly the same way: this module is
the one place that does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nccl_cffi.dtypes import NCCL_TYPES, dtype_name

from ..errors import MetadataError

# What vLLM 0.33.0's worker can receive (its pynccl dtype table); it raises
# mid-transfer on anything else, so the sender refuses it up front.
WIRE_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64",
               "bfloat16", "float8_e4m3fn")


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as the worker sees it: checkpoint name, torch dtype name, shape.

    Attributes:
        name: the checkpoint name vLLM loads, e.g. ``"model.norm.weight"``.
        dtype: the torch dtype name, one of ``WIRE_DTYPES``.
        shape: the tensor's shape.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]

    @cached_property  # read per tensor on a push's hot path
    def numel(self) -> int:
        """The tensor's element count."""
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return self.numel * NCCL_TYPES[self.dtype][1]

    @classmethod
    def of(cls, name: str, array) -> TensorMeta:
        """Metadata of an array (or ``jax.ShapeDtypeStruct``), dtype checked for the wire.

        Args:
            name: the tensor's checkpoint name.
            array: anything with ``dtype`` and ``shape``.

        Returns:
            Its metadata.

        Raises:
            MetadataError: a dtype vLLM's NCCL receiver cannot take (not in
                ``WIRE_DTYPES``).
        """
        try:
            dt = dtype_name(array.dtype)
        except TypeError:
            dt = str(array.dtype)
        if dt not in WIRE_DTYPES:
            raise MetadataError(
                f"{name!r} has dtype {array.dtype}, which vLLM's NCCL receiver cannot take "
                f"(supported: {', '.join(WIRE_DTYPES)}); cast it in the transform")
        return cls(name, dt, tuple(int(d) for d in array.shape))

    def check(self, array) -> None:
        """Raise unless a transform's output ``array`` is what was declared.

        Args:
            array: the transform's output for this tensor.

        Raises:
            MetadataError: its dtype or shape differs from this metadata, or
                its dtype cannot go on the wire.
        """
        got = TensorMeta.of(self.name, array)
        if got != self:
            raise MetadataError(f"{self.name!r}: the transform gave {got.dtype} {got.shape}, "
                                f"but {self.dtype} {self.shape} was declared")


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Tensors ``[start, stop)`` laid end to end; ``offsets`` are byte offsets in the chunk.

    Attributes:
        start: the index of its first tensor (in the order planned).
        stop: one past the index of its last tensor.
        nbytes: the chunk's bytes, which the workers receive in one broadcast.
        offsets: each tensor's byte offset in the chunk, in order.
    """

    start: int
    stop: int
    nbytes: int
    offsets: tuple[int, ...]

    @property
    def single(self) -> bool:
        """Whether the chunk holds one tensor only (broadcast from that
        tensor's own buffer, with no copy)."""
        return self.stop - self.start == 1


def plan_chunks(metas: Sequence[TensorMeta], buffer_size: int) -> list[Chunk]:
    """Chunk boundaries exactly as vLLM's ``packed_nccl_broadcast_consumer`` cuts them.

    A chunk ends right after the tensor that takes its bytes strictly past
    ``buffer_size``; no tensor is split, so a chunk may exceed the buffer.

    Args:
        metas: the tensors, in the order they are sent.
        buffer_size: ``packed_buffer_size_bytes``, the workers' chunk size.

    Returns:
        The chunks, in order, covering every tensor once (none for no tensors).

    Raises:
        ValueError: ``buffer_size`` below 1.
    """
    if buffer_size < 1:
        raise ValueError(f"buffer size must be positive, got {buffer_size}")
    chunks: list[Chunk] = []
    start, total, offsets = 0, 0, []
    for i, m in enumerate(metas):
        offsets.append(total)
        total += m.nbytes
        if total > buffer_size:
            chunks.append(Chunk(start=start, stop=i + 1, nbytes=total, offsets=tuple(offsets)))
            start, total, offsets = i + 1, 0, []
    if start < len(metas):
        chunks.append(Chunk(start=start, stop=len(metas), nbytes=total, offsets=tuple(offsets)))
    return chunks


def check_alignment(metas: Sequence[TensorMeta], chunks: Sequence[Chunk]) -> None:
    """vLLM's consumer views each tensor in place at its offset in the chunk
    (``uint8 -> dtype``), which torch allows only at an offset divisible by the
    dtype's size; a misaligned tensor makes the worker raise mid-stream."""
    for c in chunks:
        for m, off in zip(metas[c.start:c.stop], c.offsets):
            size = NCCL_TYPES[m.dtype][1]
            if off % size:
                raise MetadataError(
                    f"packed mode would place {m.name!r} ({m.dtype}) at byte {off} of its "
                    f"chunk, not a multiple of {size}: vLLM's packed consumer cannot view it "
                    "there and would fail mid-transfer (the sender orders its tensors by "
                    "decreasing dtype size to avoid this)")


def wire_order(metas: Sequence[TensorMeta], buffer_size: int) -> list[int]:
    """The order a packed push sends ``metas`` in, as indices; vLLM loads by
    name, so the order is the sender's to choose.

    Tensors larger than the buffer go first (each is a chunk of its own):
    the receiver loads the last chunk after the last broadcast, so ending on
    a large tensor (``lm_head`` comes last in checkpoint order) lengthens the
    push by its load. The rest keep their order, unless that would put a
    tensor at a chunk offset its dtype cannot be viewed at (vLLM's consumer
    would fail mid-stream): then they go by decreasing dtype size, which
    aligns every offset (each tensor's bytes are a multiple of every smaller
    power-of-two size).

    Args:
        metas: the tensors, in checkpoint (tree) order.
        buffer_size: ``packed_buffer_size_bytes``, the workers' chunk size.

    Returns:
        A permutation of ``range(len(metas))``: the indices in wire order.

    Raises:
        ValueError: ``buffer_size`` below 1.
    """
    big = [i for i, m in enumerate(metas) if m.nbytes > buffer_size]
    rest = [i for i, m in enumerate(metas) if m.nbytes <= buffer_size]
    order = big + rest
    ordered = [metas[i] for i in order]
    if not aligned(ordered, plan_chunks(ordered, buffer_size)):
        rest.sort(key=lambda i: -NCCL_TYPES[metas[i].dtype][1])
        order = big + rest
    return order


def aligned(metas: Sequence[TensorMeta], chunks: Sequence[Chunk]) -> bool:
    return all(off % NCCL_TYPES[m.dtype][1] == 0 for c in chunks
               for m, off in zip(metas[c.start:c.stop], c.offsets))


def check_unique(metas: Sequence[TensorMeta]) -> None:
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise MetadataError(f"tensor name {m.name!r} appears twice")
        seen.add(m.name)


def check_against(expected: Sequence[TensorMeta], actual: Sequence[TensorMeta]) -> None:
    """Refuse arrays that disagree with declared metadata, naming the first mismatch."""
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            raise MetadataError(
                f"metadata disagrees with the arrays at index {i}: declared {e.name!r} "
                f"{e.dtype} {e.shape}, got {a.name!r} {a.dtype} {a.shape}. Both must list "
                "the same tensors in the same order, or the receiver hangs or loads garbage")
    if len(expected) != len(actual):
        raise MetadataError(f"metadata declares {len(expected)} tensors but {len(actual)} "
                            "arrays were given; the receiver would wait for the rest")


class LoadPlan:
    """The manifest of ``use_load_plan``: every tensor the workers may receive.

    vLLM plans its loading from the metadata sent at init, so every later
    update must only send tensors declared there, with the declared dtype and
    shape (a subset is fine). The trainer checks before contacting the
    workers; the workers check again, for trainers that drive them out of band.

    Args:
        metas: every tensor the workers may receive.

    Raises:
        MetadataError: a name that appears twice.
    """

    def __init__(self, metas: Sequence[TensorMeta]):
        check_unique(metas)
        self.metas = list(metas)
        self._declared = {m.name: (m.dtype, m.shape) for m in metas}

    @classmethod
    def from_payload(cls, metadata: Sequence[Sequence[Any]]) -> LoadPlan:
        """From ``init_info["metadata"]``: ``[[name, dtype_name, shape], ...]``.

        Args:
            metadata: one ``[name, dtype_name, shape]`` triple per tensor.

        Returns:
            The plan.

        Raises:
            MetadataError: an entry that is not such a triple, or a name
                that appears twice.
        """
        try:
            return cls([TensorMeta(str(n), str(d), tuple(int(x) for x in s))
                        for n, d, s in metadata])
        except (TypeError, ValueError) as e:
            raise MetadataError(f"load-plan metadata must be [name, dtype, shape] "
                                f"triples: {e}") from e

    def to_payload(self) -> list[list[Any]]:
        """``init_info["metadata"]``, as ``InitInfo.metadata`` carries it.

        Returns:
            One ``[name, dtype_name, shape]`` list per tensor, JSON types only.
        """
        return [[m.name, m.dtype, list(m.shape)] for m in self.metas]

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """vLLM's ``_check_manifest``, with its message.

        Args:
            metas: what a push would send.

        Raises:
            MetadataError: a tensor not declared in the plan, or declared
                with another dtype or shape.
        """
        for m in metas:
            declared = self._declared.get(m.name)
            if declared == (m.dtype, m.shape):
                continue
            problem = ("was not declared in the metadata sent at init" if declared is None
                       else f"was declared at init as ({declared[0]}, {list(declared[1])})")
            raise MetadataError(f"NCCL weight transfer: {m.name!r} sent as ({m.dtype}, "
                                f"{list(m.shape)}) {problem}; with use_load_plan, re-init "
                                "the engine to re-plan")
