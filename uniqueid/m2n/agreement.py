"""The agreements vLLM 0.33.0's ``nccl_m2n`` ranks run over the metadata
group before (and right after) NCCL init, from the trainer's side, torch-free.

Why copies of vLLM's (``m2n_common.py``): every rank, trainer or worker,
publishes one envelope per agreement and decides from all of them, so
ours must be vLLM's envelopes to the key and decide as vLLM's checks
decide: then each agreement fails on every rank at once (a rank's local
error travels in its envelope) and no rank is left waiting for another
that gave up. The order is the engines': source plan, data plane, runtime
ready, (NCCL init; the first worker broadcasts the destination
placements: ``decode_destination_placements``), complete plan.

Each check here adds a deadline to vLLM's, and its error is one sentence:
vLLM's own message (what vLLM's ranks raise at the same point), with the
failing ranks and their errors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nccl_cffi.m2n import MAX_TENSOR_DIMS, MESH_NDIMS, REPLICATE
from nccl_cffi.waiting import Deadline

from .metadata import GroupError, MetadataGroup

__all__ = [
    "M2N_WIRE_SCHEMA_VERSION", "MAX_TENSOR_DIMS", "REPLICATE", "REPLICATED_ROW", "AgreementError",
    "M2NMesh", "M2NWireParam", "check_complete_plan_agreement", "check_data_plane_agreement",
    "check_runtime_ready_agreement", "check_source_plan_agreement", "complete_plan_digest",
    "decode_destination_placements", "described", "source_plan_digest",
]

M2N_WIRE_SCHEMA_VERSION = 2  # the placements and limits on the wire are the library's own
# What ``publish_destination_placements`` writes for a REPLICATED parameter.
REPLICATED_ROW = REPLICATE - 1

Placements = tuple[int, int]
_WIRE_FIELDS = ("name", "dtype_name", "shape", "src_mesh_dims", "src_placements")


class AgreementError(GroupError):
    """An agreement failed: every rank of the group (vLLM's workers
    included) raises at the same point.

    Args:
        message: the one-sentence message.
        errors: each failing rank's entry, as vLLM lists them
            (``"rank 2: ValueError: ..."``).
    """

    def __init__(self, message: str, errors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_placements(placements: Sequence[int], context: str = "placements") -> None:
    """vLLM's ``check_placements``: one mesh axis shards, the other replicates.

    Args:
        placements: one code per mesh axis: ``REPLICATE`` or a tensor dim.
        context: names them in errors.

    Raises:
        ValueError, TypeError: in vLLM's words.
    """
    if len(placements) != MESH_NDIMS:
        raise ValueError(f"{context} must have {MESH_NDIMS} entries")
    if not all(_is_int(code) for code in placements):
        raise TypeError(f"{context} must contain integer placement codes")
    invalid = [code for code in placements if code < REPLICATE]
    if invalid:
        raise ValueError(f"{context} contains invalid placement code {invalid[0]}; valid codes are "
                         f"{REPLICATE} (Replicate) and non-negative tensor dimensions")
    sharded = sum(code != REPLICATE for code in placements)
    if sharded == 0:
        raise ValueError(f"{context}: a fully replicated tensor is carried as REPLICATED, "
                         "not as two REPLICATE axes")
    if sharded == MESH_NDIMS:
        raise ValueError(f"{context}: nccl_m2n needs one REPLICATE mesh axis, but "
                         f"{tuple(placements)} shards both")


@dataclass(frozen=True, kw_only=True)
class M2NMesh:
    """One side's rank topology (vLLM's ``M2NMesh``): two axes over the
    ranks ``[start_rank, start_rank + dims[0] * dims[1])``.

    Args:
        dims: two positive ints.
        start_rank: the first rank (the workers': the number of trainer ranks).

    Raises:
        ValueError: in vLLM's words.
    """

    dims: tuple[int, int]
    start_rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if len(self.dims) != MESH_NDIMS or not all(_is_int(d) and d > 0 for d in self.dims):
            raise ValueError(f"mesh dims must be {MESH_NDIMS} positive ints")
        if not _is_int(self.start_rank) or self.start_rank < 0:
            raise ValueError(f"mesh start_rank must be non-negative, got {self.start_rank}")

    @property
    def size(self) -> int:
        """Its rank count."""
        return self.dims[0] * self.dims[1]


@dataclass(frozen=True, kw_only=True)
class M2NWireParam:
    """One parameter of the source plan, as vLLM's ``M2NWireParam`` checks
    it and as it travels in the init request (``to_dict``).

    Args:
        name: the checkpoint name.
        dtype_name: torch's dtype name (``"bfloat16"``).
        shape: the full shape, positive ints.
        src_mesh_dims: the trainer mesh's two dims.
        src_placements: one code per trainer mesh axis, or None (replicated).

    Raises:
        ValueError, TypeError: what vLLM's ``__post_init__`` refuses, in its words.
    """

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    src_mesh_dims: tuple[int, int]
    src_placements: Placements | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "src_mesh_dims", tuple(self.src_mesh_dims))
        if self.src_placements is not None:
            object.__setattr__(self, "src_placements", tuple(self.src_placements))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("M2N wire parameter name must not be empty")
        if not isinstance(self.dtype_name, str) or not self.dtype_name:
            raise ValueError(f"parameter '{self.name}' has an empty wire dtype name")
        if not self.shape or not all(_is_int(d) and d > 0 for d in self.shape):
            raise ValueError(f"parameter '{self.name}' shape must contain positive integers")
        M2NMesh(dims=self.src_mesh_dims, start_rank=0)
        if self.src_placements is not None:
            check_placements(self.src_placements, f"parameter '{self.name}' source placements")

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> M2NWireParam:
        """Parse one wire record, exactly its five fields.

        Args:
            value: the JSON-decoded mapping.

        Returns:
            The parameter.

        Raises:
            ValueError: a field missing or unexpected (vLLM's words).
        """
        missing = set(_WIRE_FIELDS) - value.keys()
        extra = value.keys() - set(_WIRE_FIELDS)
        if missing or extra:
            details = ([f"missing {sorted(missing)}"] if missing else []) + \
                      ([f"unexpected {sorted(extra)}"] if extra else [])
            raise ValueError(f"invalid M2N wire parameter: {', '.join(details)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """The record as the init request carries it (JSON values only).

        Returns:
            The five fields, tuples as lists.
        """
        return {
            "name": self.name,
            "dtype_name": self.dtype_name,
            "shape": list(self.shape),
            "src_mesh_dims": list(self.src_mesh_dims),
            "src_placements": None if self.src_placements is None else list(self.src_placements),
        }


def _digest(payload: dict[str, Any]) -> str:
    """vLLM's canonical JSON (sorted keys, no spaces), then SHA-256."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def source_plan_digest(params: Sequence[M2NWireParam | Mapping[str, Any]]) -> str:
    """vLLM's ``source_plan_digest``: the init request's ``source_digest``.

    Args:
        params: the ordered source plan: ``M2NWireParam``s, or their wire
            dicts (checked as vLLM's ``M2NWireParam.from_dict`` checks them).

    Returns:
        The hex SHA-256 of ``{"schema_version": 2, "params": [...]}``
        (sorted keys, no spaces).

    Raises:
        ValueError, TypeError: a wire dict vLLM would refuse, in its words.
    """
    wire = [p if isinstance(p, M2NWireParam) else M2NWireParam.from_dict(p) for p in params]
    return _digest({"schema_version": M2N_WIRE_SCHEMA_VERSION, "params": [p.to_dict() for p in wire]})


def complete_plan_digest(source_digest: str, dst_mesh: M2NMesh,
                         dst_placements: Sequence[Placements | None]) -> str:
    """vLLM's ``complete_plan_digest``: the source plan with the destination's.

    Args:
        source_digest: the agreed source digest.
        dst_mesh: the workers' mesh.
        dst_placements: one placement (or None) per parameter.

    Returns:
        The hex SHA-256.

    Raises:
        ValueError: ``source_digest`` is empty.
    """
    if not isinstance(source_digest, str) or not source_digest:
        raise ValueError("source digest must be a non-empty string")
    return _digest({
        "schema_version": M2N_WIRE_SCHEMA_VERSION,
        "source_digest": source_digest,
        "destination_mesh": {"dims": list(dst_mesh.dims), "start_rank": dst_mesh.start_rank},
        "destination_placements": [None if p is None else list(p) for p in dst_placements],
    })


def _local(error: str | None, fallback: str) -> str | None:
    """vLLM's rule for a rank's own error: None, or a non-empty str."""
    if error is not None and (not isinstance(error, str) or not error):
        return fallback
    return error


def described(exc: BaseException) -> str:
    """A failure as a rank's envelope carries it (vLLM's form), e.g.
    ``"ValueError: ..."``.

    Args:
        exc: the failure.

    Returns:
        Its type's name and its text.
    """
    return f"{type(exc).__name__}: {exc}"


def _fail(prefix: str, errors: list[str]) -> AgreementError:
    text = " ".join("; ".join(errors).split())  # one line, whatever a rank wrote
    return AgreementError(f"{prefix}: {text}", errors)


def _count_check(group: MetadataGroup, gathered: list[Any]) -> list[str]:
    if len(gathered) != group.world_size:
        return [f"control-plane all-gather returned {len(gathered)} records for world size "
                f"{group.world_size}"]
    return []


def _envelope(item: Any, fields: set[str], phase: str) -> bool:
    return isinstance(item, Mapping) and set(item) == fields and item.get("phase") == phase


def _rank_error(rank: int, item: Mapping[str, Any], what: str) -> str | None:
    """The entry for a rank whose envelope carries an error, or None."""
    error = item["error"]
    if error is None:
        return None
    if not isinstance(error, str) or not error:
        return f"rank {rank}: invalid {what} error"
    return f"rank {rank}: {error}"


def _source_record(params: Sequence[M2NWireParam | Mapping[str, Any]], expected_digest: str | None,
                   local_error: str | None) -> dict[str, Any]:
    error = _local(local_error, "TypeError: local source error must be a non-empty string")
    digest, declared = None, expected_digest
    if error is None:
        try:
            digest = source_plan_digest(params)
            declared = digest if expected_digest is None else expected_digest
            if not isinstance(declared, str) or not declared:
                raise ValueError("declared source digest must be a non-empty string")
        except Exception as exc:  # noqa: BLE001 - vLLM sends any failure to every rank
            error = described(exc)
    return {"phase": "source", "digest": digest, "declared_digest": declared, "error": error}


def _source_entries(group: MetadataGroup,
                    gathered: list[Any]) -> tuple[list[str], list[tuple[int, str, str]]]:
    errors, agreed = _count_check(group, gathered), []
    for rank, item in enumerate(gathered):
        if not isinstance(item, Mapping) or set(item) != {"phase", "digest", "declared_digest", "error"}:
            errors.append(f"rank {rank}: invalid source preflight envelope")
        elif item["phase"] != "source":
            errors.append(f"rank {rank}: invalid source preflight phase")
        elif (entry := _rank_error(rank, item, "source preflight")) is not None:
            errors.append(entry)
        elif not all(isinstance(item[k], str) and item[k] for k in ("digest", "declared_digest")):
            errors.append(f"rank {rank}: invalid source digest")
        else:
            agreed.append((rank, item["digest"], item["declared_digest"]))
    return errors, agreed


def _digest_mismatches(agreed: list[tuple[int, str, str]]) -> list[str]:
    errors = []
    for rank, computed, claimed in agreed:
        if computed != claimed:
            errors.append(f"rank {rank}: computed digest {computed} does not match declared "
                          f"digest {claimed}")
        if computed != agreed[0][1]:
            errors.append(f"rank {rank}: source digest disagrees with rank 0")
    return errors


def check_source_plan_agreement(group: MetadataGroup, params: Sequence[M2NWireParam | Mapping[str, Any]],
                                deadline: Deadline,
                                *, expected_digest: str | None = None,
                                local_error: str | None = None) -> str:
    """vLLM's ``check_source_plan_agreement``: every rank entered with the
    same source plan.

    Args:
        group: the metadata group.
        params: this rank's source plan (``M2NWireParam``s or wire dicts;
            one vLLM would refuse becomes this rank's error, sent to all).
        deadline: the whole agreement's.
        expected_digest: the digest this rank declared (the init
            request's ``source_digest``); the computed one by default.
        local_error: this rank's own failure (``"TypeError: ..."``), sent
            to every rank so that all fail here.

    Returns:
        The agreed digest (rank 0's).

    Raises:
        AgreementError: a rank failed or disagrees (vLLM's ranks raise too).
        GroupTimeout, GroupError: a rank did not publish in time, or sent
            what is not plain data.
    """
    gathered = group.all_gather_obj(_source_record(params, expected_digest, local_error), deadline,
                                    what="record of the source-plan agreement")
    prefix = "nccl_m2n source preflight rejected before NCCL init"
    errors, agreed = _source_entries(group, gathered)
    if errors:
        raise _fail(prefix, errors)
    errors = _digest_mismatches(agreed)
    if errors:
        raise _fail(prefix, errors)
    return agreed[0][1]


def check_data_plane_agreement(group: MetadataGroup, unique_id_bytes: bytes | None, deadline: Deadline,
                               *, local_error: str | None = None) -> None:
    """vLLM's ``check_data_plane_agreement``: every rank joins NCCL the same
    way (mode ``"uid"``: the SHA-256 of the same 128-byte id; ``"tcp"``).

    Args:
        group: the metadata group.
        unique_id_bytes: the id this rank will init with (None: TCP).
        deadline: the whole agreement's.
        local_error: this rank's own failure, sent to every rank.

    Raises:
        AgreementError: a rank failed or joins another way (vLLM's ranks raise too).
        GroupTimeout, GroupError: as ``check_source_plan_agreement``.
    """
    error = _local(local_error, "TypeError: local data-plane error must be non-empty")
    uid_digest = None
    if error is None and unique_id_bytes is not None:
        if isinstance(unique_id_bytes, bytes):
            uid_digest = hashlib.sha256(unique_id_bytes).hexdigest()
        else:
            error = "TypeError: NCCL unique id must decode to bytes"
    gathered = group.all_gather_obj(
        {"phase": "data_plane", "mode": "uid" if unique_id_bytes is not None else "tcp",
         "uid_digest": uid_digest, "error": error},
        deadline, what="record of the data-plane agreement")
    errors, valid = _count_check(group, gathered), []
    for rank, item in enumerate(gathered):
        if not _envelope(item, {"phase", "mode", "uid_digest", "error"}, "data_plane"):
            errors.append(f"rank {rank}: invalid data-plane preflight envelope")
        elif (entry := _rank_error(rank, item, "data-plane preflight")) is not None:
            errors.append(entry)
        elif item["mode"] not in {"tcp", "uid"} or (item["mode"] == "uid") != isinstance(
                item["uid_digest"], str):
            errors.append(f"rank {rank}: invalid data-plane identity")
        else:
            valid.append((rank, item["mode"], item["uid_digest"]))
    if not errors:
        errors = [f"rank {rank}: NCCL data-plane identity disagrees"
                  for rank, mode, uid in valid[1:] if (mode, uid) != valid[0][1:]]
    if errors:
        raise _fail("nccl_m2n data-plane preflight rejected before NCCL init", errors)


def check_runtime_ready_agreement(group: MetadataGroup, local_error: str | None, deadline: Deadline) -> None:
    """vLLM's ``check_runtime_ready_agreement``: every rank prepared its
    local resources (device, M2N handle) before NCCL init.

    Args:
        group: the metadata group.
        local_error: this rank's failure to prepare, or None.
        deadline: the whole agreement's.

    Raises:
        AgreementError: a rank failed (vLLM's ranks raise too).
        GroupTimeout, GroupError: as ``check_source_plan_agreement``.
    """
    error = _local(local_error, "TypeError: local runtime error must be a non-empty string")
    gathered = group.all_gather_obj({"phase": "runtime_ready", "error": error}, deadline,
                                    what="record of the runtime-ready agreement")
    errors = _count_check(group, gathered)
    for rank, item in enumerate(gathered):
        if not _envelope(item, {"phase", "error"}, "runtime_ready"):
            errors.append(f"rank {rank}: invalid runtime readiness envelope")
        elif (entry := _rank_error(rank, item, "runtime readiness")) is not None:
            errors.append(entry)
    if errors:
        raise _fail("nccl_m2n local runtime preflight failed before NCCL init", errors)


def check_complete_plan_agreement(group: MetadataGroup, source_digest: str, dst_mesh: M2NMesh,
                                  dst_placements: Sequence[Placements | None], deadline: Deadline,
                                  *, local_error: str | None = None) -> str:
    """vLLM's ``check_complete_plan_agreement``: every rank accepts the same
    source and destination plan, after the first worker published the
    destination placements.

    Args:
        group: the metadata group.
        source_digest: the agreed source digest.
        dst_mesh: the workers' mesh.
        dst_placements: the decoded placements (``decode_destination_placements``).
        deadline: the whole agreement's.
        local_error: this rank's failure (e.g. a placement row it refused,
            a plan it cannot send), sent to every rank.

    Returns:
        The agreed digest.

    Raises:
        AgreementError: a rank failed or disagrees (vLLM's ranks raise too).
        GroupTimeout, GroupError: as ``check_source_plan_agreement``.
    """
    error = _local(local_error, "TypeError: local plan error must be a non-empty string")
    digest = None
    if error is None:
        try:
            digest = complete_plan_digest(source_digest, dst_mesh, dst_placements)
        except Exception as exc:  # noqa: BLE001 - vLLM sends any failure to every rank
            error = described(exc)
    gathered = group.all_gather_obj({"phase": "complete_plan", "digest": digest, "error": error},
                                    deadline, what="record of the complete-plan agreement")
    errors, valid = _count_check(group, gathered), []
    for rank, item in enumerate(gathered):
        if not _envelope(item, {"phase", "digest", "error"}, "complete_plan"):
            errors.append(f"rank {rank}: invalid complete-plan envelope")
        elif (entry := _rank_error(rank, item, "complete-plan")) is not None:
            errors.append(entry)
        elif not isinstance(item["digest"], str) or not item["digest"]:
            errors.append(f"rank {rank}: invalid complete-plan digest")
        else:
            valid.append((rank, item["digest"]))
    if not errors:
        errors = [f"rank {rank}: complete-plan digest disagrees with rank 0"
                  for rank, other in valid[1:] if other != valid[0][1]]
    if errors:
        raise _fail("nccl_m2n complete-plan preflight rejected before first reshard", errors)
    return valid[0][1]


def decode_destination_placements(raw: bytes, num_parameters: int) -> list[Placements | None]:
    """The destination placements vLLM's first worker broadcasts over NCCL
    (``publish_destination_placements``): ``num_parameters`` rows of two
    int8 codes; a row of two ``REPLICATED_ROW`` (-2) is REPLICATED.

    Only rows vLLM would send are accepted: REPLICATED, or one axis a
    tensor dim below ``MAX_TENSOR_DIMS`` and the other ``REPLICATE``.
    A refusal here must still reach the other ranks: pass
    ``f"{type(e).__name__}: {e}"`` as ``check_complete_plan_agreement``'s
    ``local_error``, so every rank fails there together.

    Args:
        raw: the received bytes.
        num_parameters: the source plan's length.

    Returns:
        One placement (a pair of codes) or None per parameter.

    Raises:
        ValueError: a length or a row vLLM would not send.
    """
    if not _is_int(num_parameters) or num_parameters < 0:
        raise ValueError(f"num_parameters must be a non-negative int, got {num_parameters!r}")
    if len(raw) != num_parameters * MESH_NDIMS:
        raise ValueError(f"destination placements of {len(raw)} bytes, expected "
                         f"{num_parameters * MESH_NDIMS} for {num_parameters} parameters")
    codes = [b - 256 if b > 127 else b for b in bytes(raw)]
    placements: list[Placements | None] = []
    for index in range(num_parameters):
        row = (codes[2 * index], codes[2 * index + 1])
        if row == (REPLICATED_ROW, REPLICATED_ROW):
            placements.append(None)
            continue
        if REPLICATED_ROW in row or any(code >= MAX_TENSOR_DIMS for code in row):
            raise ValueError(f"destination placement row {index} is {row}, which vLLM never sends")
        check_placements(row, f"destination placement row {index}")
        placements.append(row)
    return placements
