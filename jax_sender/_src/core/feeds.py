"""How a round's broadcasts are produced: one object per way, chosen once
per push, each called on the lane as ``feed(broadcaster, timeout, check)``.

* ``Produced``: chunks XLA writes (``packing.py``): the asynchronous push's
  snapshot, or a blocking push through a transform.
* ``Copies``: the caller's arrays (or their transforms) copied into staging
  slots, chunk by chunk (packed).
* ``Tensors``: one broadcast per tensor, straight from its buffer (unpacked).
* ``Received``: another trainer rank's turn, taken part in and dropped (a
  group member must join every broadcast).

Why objects: the choice depends on the push (blocking or not, packed or
not, a transform or not, where the arrays are), never on the chunk, so it
is made once, up front, and what runs on the lane is straight-line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

from nccl_cffi.waiting import Check

from .broadcaster import Broadcaster, Fill, Make, Part
from .tensors.plan import Chunk, TensorMeta

Get = Callable[[int], jax.Array]


@dataclass(frozen=True, kw_only=True)
class Produced:
    """Chunks made by ``make(k, spare)`` (XLA, dispatched ahead of their
    broadcasts); with ``reuse``, a chunk buffer is written again once its
    broadcast is done."""

    chunks: Sequence[Chunk]
    make: Make
    root: int
    reuse: bool = False

    def __call__(self, b: Broadcaster, timeout: float, check: Check) -> None:
        b.produced(self.chunks, self.make, self.root, timeout=timeout, check=check,
                   reuse=self.reuse)


@dataclass(frozen=True, kw_only=True)
class Copies:
    """Packed chunks copied from the tensors ``get(i)`` returns (``temporaries``:
    they may be transform outputs nothing else holds, freed once copied)."""

    metas: Sequence[TensorMeta]
    chunks: Sequence[Chunk]
    get: Get
    root: int
    temporaries: bool

    def __call__(self, b: Broadcaster, timeout: float, check: Check) -> None:
        b.packed(self.metas, self.chunks, self.get, self.root, timeout=timeout, check=check,
                 temporaries=self.temporaries)


@dataclass(frozen=True, kw_only=True)
class Tensors:
    """One broadcast per tensor ``get(i)``, in its own dtype."""

    metas: Sequence[TensorMeta]
    get: Get
    root: int

    def __call__(self, b: Broadcaster, timeout: float, check: Check) -> None:
        b.unpacked(self.metas, self.get, self.root, timeout=timeout, check=check)


@dataclass(frozen=True, kw_only=True)
class Received:
    """Another trainer rank's broadcasts, received into scratch bytes and dropped."""

    parts: Sequence[Part]
    root: int

    def __call__(self, b: Broadcaster, timeout: float, check: Check) -> None:
        b.scratch(self.parts, self.root, timeout=timeout, check=check)


@dataclass(frozen=True, kw_only=True)
class Rest:
    """What the workers still expect of a pass that failed on the trainer's
    side, sent from scratch bytes or ``fill`` (``Broadcaster.complete``)."""

    parts: Sequence[Part]
    root: int
    fill: Fill | None = None

    def __call__(self, b: Broadcaster, timeout: float, check: Check) -> None:
        b.complete(self.parts, self.root, timeout=timeout, check=check, fill=self.fill)
