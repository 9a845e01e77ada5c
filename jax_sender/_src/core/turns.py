"""Who broadcasts what: a push's *turns*, their order and their chunks.

With one trainer process there is one turn: rank 0 sends every tensor. With
several (``group.py``), a parameter's *owners* are the processes holding a
shard of it, in ascending process index, and its first owner broadcasts it
in its own turn (vLLM's "broadcasting ranks"). The rules are vLLM's, checked
identically on every process so every process raises alike: process 0 is
the first owner of whatever it owns (it gathers only in its own turn), a
process owns parameters of one broadcaster only (each broadcaster sends in
its own turn).

A turn as the workers see it (``TurnUpdate``) is its tensors in wire order,
the packed chunks cut from them alone (a worker cuts per
``/update_weights`` call), and the ``update_info`` process 0 posts for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from uniqueid import UpdateInfo

from .errors import MetadataError
from .tensors.plan import Chunk, TensorMeta, check_alignment, plan_chunks, wire_order


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One broadcaster's turn: its group rank, its process, its parameters (indices)."""

    src: int
    process: int
    params: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class BroadcastPlan:
    """Who broadcasts what, identical on every process."""

    group: tuple[int, ...]  # process index of each group rank
    turns: tuple[Turn, ...]  # in ascending group rank

    def group_rank(self, process: int) -> int | None:
        return self.group.index(process) if process in self.group else None

    @classmethod
    def single(cls, n: int) -> BroadcastPlan:
        """One process: rank 0 sends all ``n`` tensors."""
        return cls(group=(0,), turns=(Turn(src=0, process=0, params=tuple(range(n))),))


@dataclass(frozen=True, kw_only=True)
class TurnUpdate:
    """One turn as the workers see it: its tensors, the packed chunks cut from
    them alone (a worker cuts per ``/update_weights`` call), and the
    ``update_info`` process 0 posts for it."""

    turn: Turn
    metas: list[TensorMeta]
    chunks: list[Chunk]
    update: UpdateInfo


def turn_updates(plan: BroadcastPlan, metas: Sequence[TensorMeta], buffer_size: int | None,
                 sent: dict[int, list[TensorMeta]]) -> list[TurnUpdate]:
    """Every turn's update, checked before anything is sent. ``buffer_size``:
    packed mode's, None when unpacked; packed turns send their tensors in
    ``wire_order`` (so ``turn.params`` is reordered). ``sent``: per ``src``,
    the metadata the workers hold; an unchanged turn posts empty lists
    (vLLM's reuse, kept per ``src``)."""
    out = []
    for turn in plan.turns:
        params = turn.params
        if buffer_size:
            order = wire_order([metas[i] for i in params], buffer_size)
            turn = replace(turn, params=tuple(params[j] for j in order))
        sub = [metas[i] for i in turn.params]
        chunks = plan_chunks(sub, buffer_size) if buffer_size else []
        check_alignment(sub, chunks)
        update = UpdateInfo(src=turn.src) if sub == sent.get(turn.src) else UpdateInfo(
            names=[m.name for m in sub], dtype_names=[m.dtype for m in sub],
            shapes=[list(m.shape) for m in sub], src=turn.src)
        out.append(TurnUpdate(turn=turn, metas=sub, chunks=chunks, update=update))
    return out


def owners_of(array: Any) -> tuple[int, ...] | None:
    """Processes holding a shard of ``array``, ascending; None for host data
    (every process has it, so process 0 sends it)."""
    if not isinstance(array, jax.Array):
        return None
    return tuple(sorted({d.process_index for d in array.sharding.device_set}))


def broadcast_plan(metas: Sequence[TensorMeta],
                   owners: Sequence[tuple[int, ...] | None]) -> BroadcastPlan:
    """Group and turns from each parameter's owners, validated as vLLM does."""
    slices: dict[int, list[int]] = {}
    for i, o in enumerate(owners):
        slices.setdefault(0 if o is None else o[0], []).append(i)
    for m, o in zip(metas, owners):
        if o is not None and 0 in o[1:]:
            raise MetadataError(
                f"parameter {m.name!r} has owners {list(o)}: process 0 only gathers in its "
                "own turn, so it must be the first owner of every parameter it owns")
    if len(slices) > 1:
        broadcaster_of: dict[int, int] = {}
        for b, idx in sorted(slices.items()):
            for i in idx:
                if owners[i] is None:
                    raise MetadataError(
                        f"parameter {metas[i].name!r} is host data, so every process owns "
                        f"it, but processes {sorted(slices)} broadcast: put every parameter "
                        "on the devices of the processes that own it")
                for r in owners[i]:
                    if broadcaster_of.setdefault(r, b) != b:
                        raise MetadataError(
                            f"process {r} owns parameters broadcast by processes "
                            f"{broadcaster_of[r]} and {b}, but each broadcaster sends in its "
                            "own turn, so every parameter a process owns must share its first "
                            f"owner (first seen: {metas[i].name!r})")
    group = tuple(sorted({0, *slices}))
    return BroadcastPlan(group=group, turns=tuple(Turn(src=group.index(b), process=b, params=tuple(idx))
                                      for b, idx in sorted(slices.items())))
