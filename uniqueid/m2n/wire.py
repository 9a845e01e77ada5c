"""The init payload of vLLM's ``nccl_m2n`` backend, as vLLM 0.33.0's own
M2N trainer sends it (``M2NTrainerWeightTransferEngine._worker_init_info``),
to the byte. The plan's records and digests are ``m2n_agreement.py``'s.

The whole plan travels once, at init: per parameter its name, dtype, shape
and the trainer's layout (``src_mesh_dims``, ``src_placements``), with a
SHA-256 digest of it that every rank recomputes. A round then names the
parameters only (``{"names": [...]}``), in the order every rank reshards
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..codec import UniqueId
from .agreement import M2N_WIRE_SCHEMA_VERSION, M2NWireParam, source_plan_digest

__all__ = ["M2NInitInfo", "M2NWireParam"]


@dataclass(kw_only=True)
class M2NInitInfo:
    """``init_info`` of ``/init_weight_transfer_engine`` for a server started
    with ``{"backend": "nccl_m2n"}`` (vLLM's ``M2NWeightTransferInitInfo``).

    Attributes:
        master_address, master_port: the metadata store (trainer rank 0's).
        unique_id: the NCCL group's id (sent as ``nccl_unique_id_b64``;
            left out of ``repr``).
        rank_offset: the trainer ranks; the workers are ranks
            ``[rank_offset, world_size)``.
        world_size: trainer ranks and workers.
        dst_mesh_dims: the workers as (replicas, shards): the shard axis is
            each replica's tensor-parallel ranks.
        params: the plan, in order.
        max_cta: the most CTAs a reshard kernel uses, or None.
    """

    master_address: str
    master_port: int
    unique_id: UniqueId = field(repr=False)
    rank_offset: int
    world_size: int
    dst_mesh_dims: tuple[int, int]
    params: list[M2NWireParam]
    max_cta: int | None = None

    @property
    def source_digest(self) -> str:
        """``source_plan_digest(params)``."""
        return source_plan_digest(self.params)

    def to_payload(self) -> dict[str, Any]:
        """The JSON object vLLM reads as ``init_info`` (None values left out,
        as vLLM's trainer leaves them).

        Returns:
            A dict of JSON types.
        """
        payload = {
            "schema_version": M2N_WIRE_SCHEMA_VERSION,
            "master_address": self.master_address,
            "master_port": self.master_port,
            "nccl_unique_id_b64": self.unique_id.to_b64(),
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "dst_mesh_dims": list(self.dst_mesh_dims),
            "source_digest": self.source_digest,
            "params": [p.to_dict() for p in self.params],
            "max_cta": self.max_cta,
        }
        return {k: v for k, v in payload.items() if v is not None}
