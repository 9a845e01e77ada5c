"""One run's figures as typed rows, read from and written to the JSON a run saves.

Why typed: the report reads well over a hundred figures of a run; as dict
keys, a misspelt or misplaced one fails only when its table is drawn (or
draws the wrong column), while a row's field is checked where it is made
and where it is read. The JSON stays what runs have always written, so a
committed run loads and saves back unchanged: a row's keys are its fields,
in order (a ``Job`` field's keys come first, flattened); a field that is
``None`` is absent from the JSON, as older runs lack some figures (the
report then says less rather than guess). Reading refuses a key no field
holds.

Times are in seconds, one per timed repetition; sizes in bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from workloads import Job

R = TypeVar("R", bound="JsonRow")

# Field metadata: a Job whose keys are the row's own; rows nested under a key.
FLAT = {"flat": True}


def nested(cls: type[JsonRow]) -> Any:
    """An optional field holding a ``cls`` row, or a list of them."""
    return field(default=None, metadata={"row": cls})


class JsonRow:
    """``to_json``/``from_json`` of a dataclass whose fields are JSON values,
    ``Job``s (``FLAT``) or rows (``nested``)."""

    def to_json(self) -> dict[str, Any]:
        """The row's JSON: a key per field that is not None, in field order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("flat"):
                out.update(value.to_json())
            elif isinstance(value, JsonRow):
                out[f.name] = value.to_json()
            elif isinstance(value, list) and "row" in f.metadata:
                out[f.name] = [r.to_json() for r in value]
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls: type[R], obj: dict[str, Any]) -> R:
        """The row a run wrote as ``obj``.

        Raises:
            ValueError: ``obj`` has a key that no field holds.
            TypeError: it lacks a figure the row cannot do without.
        """
        rest = dict(obj)
        args: dict[str, Any] = {}
        for f in fields(cls):
            if f.metadata.get("flat"):
                keys = [g.name for g in fields(Job)]
                args[f.name] = Job.from_json({k: rest.pop(k) for k in keys if k in rest})
            elif f.name in rest:
                value, kind = rest.pop(f.name), f.metadata.get("row")
                if kind is not None:
                    value = ([kind.from_json(v) for v in value] if isinstance(value, list)
                             else kind.from_json(value))
                args[f.name] = value
        if rest:
            raise ValueError(f"{cls.__name__} has no field for {sorted(rest)}")
        return cls(**args)


@dataclass(kw_only=True)
class PushRow(JsonRow):
    """A job of our sender (or of a floor): ``reps`` pushes, and their figures
    (``SendStats``'s, per push). ``update``, ``link``, ``link_bytes``,
    ``wall``, ``start`` and ``finish``: None in runs that predate them."""

    job: Job = field(metadata=FLAT)
    transfer: list[float]  # posting /update_weights -> every server answered
    update: list[float] | None = None  # the /update_weights call, timed in its thread
    broadcast: list[float]  # first broadcast launched -> last done (host clock)
    total: list[float]
    prepare: list[float]
    host: list[float]  # the sender's host work inside transfer
    start: list[float] | None = None
    finish: list[float] | None = None
    link: list[float] | None = None  # GPU time, end of the first broadcast -> end of the last
    link_bytes: int | None = None  # the bytes sent in ``link``
    wall: list[float] | None = None  # the whole send() call
    bytes: int
    tensors: int
    chunks: int  # packed: chunks; unpacked: broadcasts
    largest: int  # the largest tensor
    held: int  # device memory held after the pushes, over what was before them
    peak: int  # the process's peak over that (meaningful for its first job only)

    @property
    def span(self) -> list[float]:
        """Our ``/update_weights`` calls timed inside their threads, as torch's
        engine is timed; runs that predate it have the push thread's span
        (posting to the answer seen there, two thread handoffs more)."""
        return self.update or self.transfer


@dataclass(kw_only=True)
class TorchRow(JsonRow):
    """A job of vLLM's torch engine (``send_weights()``), over our HTTP client
    that times its calls; over vLLM's own client (``fixed_shipped``) only the
    whole calls are known, and ``transfer``, ``start``, ``finish`` are None."""

    job: Job = field(metadata=FLAT)
    transfer: list[float] | None = None  # the /update_weights call
    total: list[float]
    wall: list[float] | None = None  # the whole send_weights() call
    start: list[float] | None = None
    finish: list[float] | None = None
    bytes: int
    tensors: int


@dataclass(kw_only=True)
class SeqRow(JsonRow):
    """One job pushed to several servers by one sender each, in turn: the
    pushes' transfers summed, and the whole turn."""

    job: Job = field(metadata=FLAT)
    transfer: list[float]
    total: list[float]
    bytes: int  # of one server's copy
    tensors: int


@dataclass(kw_only=True)
class SparseRow(JsonRow):
    """``SparseSender.send`` with ``fraction`` of each tensor's elements changed;
    ``bytes`` on the wire against ``dense`` bytes of the tensors. ``host``:
    None in runs that predate it."""

    fraction: float
    transfer: list[float]
    total: list[float]
    prepare: list[float]
    broadcast: list[float]
    host: list[float] | None = None  # building the patches, waits included
    bytes: int
    dense: int
    tensors: int


@dataclass(kw_only=True)
class TrainRow(JsonRow):
    """A training loop pushing (``mode``) after each step: per step its time,
    how long the push held the trainer, the push's transfer. ``none``: the
    same process's steps without the raw broadcast beside them (mode
    ``beside`` only); ``max_ctas``: the NCCL CTA cap every rank ran with."""

    mode: str  # none, blocking, torch, async, snapshot, beside
    step: list[float]
    none: list[float] | None = None
    blocked: list[float]
    transfer: list[float]
    bytes: int
    tensors: int
    max_ctas: int | None = None


@dataclass(kw_only=True)
class InitTimes(JsonRow):
    """Init + warm-up of a 2-rank group, no HTTP, per round (the slower rank)."""

    ours: list[float]  # uniqueid.handshake
    vllm: list[float] | None = None  # PyNcclCommunicator.from_unique_id_bytes


@dataclass(kw_only=True)
class BlockMedians(JsonRow):
    """The fixed-cost push's median whole call in each block, per sender."""

    ours: list[float]
    torch: list[float] | None = None
    shipped: list[float] | None = None  # torch's engine over vLLM's own client


@dataclass(kw_only=True)
class Run(JsonRow):
    """One run of ``bench.py``: what each stage measured (None: not run).
    ``*_error``: why a stage failed (the others still ran)."""

    reps: int
    raw: list[float]  # one 1 GiB broadcast, 2 ranks (mean of 10 per repetition)
    target: str  # the receiving server
    init: InitTimes | None = nested(InitTimes)
    ours: list[PushRow] | None = nested(PushRow)
    torch: list[TorchRow] | None = nested(TorchRow)
    torch_error: str | None = None
    fixed_blocks: int | None = None
    fixed_block_medians: BlockMedians | None = nested(BlockMedians)
    fixed_shipped: TorchRow | None = nested(TorchRow)
    fixed_error: str | None = None
    raw4: list[float] | None = None  # the raw broadcast with 4 ranks
    servers_one: list[PushRow] | None = nested(PushRow)
    servers_seq: list[SeqRow] | None = nested(SeqRow)
    sparse_target: str | None = None
    sparse: list[SparseRow] | None = nested(SparseRow)
    slow_link: str | None = None  # the NCCL settings of the slow link
    slow_dense: list[PushRow] | None = nested(PushRow)
    slow_sparse: list[SparseRow] | None = nested(SparseRow)
    slow_error: str | None = None
    train: list[TrainRow] | None = nested(TrainRow)
    beside_error: str | None = None
    train_error: str | None = None

    def failed(self, stage: str, why: str) -> None:
        """Record that ``stage`` (fixed, slow, beside, train) failed, and why."""
        name = f"{stage}_error"
        if name not in {f.name for f in fields(self)}:
            raise ValueError(f"no stage {stage!r} records its failure")
        setattr(self, name, why)


# A row of one job, which ``merged`` joins.
J = TypeVar("J", PushRow, TorchRow, SeqRow)


def merged(rows: Sequence[J]) -> J:
    """One job's figures from several runs of it (blocks): the per-repetition
    lists joined, ``reps`` summed, the rest from the first run."""
    first = rows[0]
    joined: dict[str, Any] = {f.name: [x for r in rows for x in getattr(r, f.name)]
                              for f in fields(first) if isinstance(getattr(first, f.name), list)}
    joined["job"] = dataclasses.replace(first.job, reps=sum(r.job.reps for r in rows))
    return dataclasses.replace(first, **joined)
