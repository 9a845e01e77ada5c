"""How a trainer takes part in a push: a *route*.

``SingleProcess``: one trainer process sends every tensor. ``ProcessGroup``:
several processes of one JAX job, each parameter sent by its first owner
(see ``group.py``). A route forms the transfer group and plans who
broadcasts what; what differs between the two is a route's, never a
``None`` check in the sender.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from uniqueid import Connection, VLLMClient, connect

from .config import SendConfig
from .errors import MetadataError, TransferError
from .group import BroadcastPlan, TrainerGroup, broadcast_plan, owners_of
from .plan import TensorMeta

if TYPE_CHECKING:
    from .base import Sources


def first_gpu() -> int:
    return jax.local_devices(backend="gpu")[0].local_hardware_id


def jax_device(ordinal: int) -> jax.Device:
    for d in jax.local_devices():
        if d.platform == "gpu" and d.local_hardware_id == ordinal:
            return d
    raise TransferError(
        f"JAX has no local GPU with CUDA ordinal {ordinal}: install the cuda13 extra "
        "(pip install 'jax-vllm-nccl[cuda13]') and check CUDA_VISIBLE_DEVICES")


def sender_device(device: int | None) -> int:
    """The trainer's GPU: ``device``, or JAX's first; a sentence where JAX has none."""
    if device is not None:
        return device
    try:
        return first_gpu()
    except RuntimeError as e:  # JAX's "Unknown backend: 'gpu' requested, ..."
        raise TransferError(
            "JAX sees no GPU here, and the sender broadcasts from one: install JAX with "
            "CUDA (pip install 'jax-vllm-nccl[cuda13]') on a machine with an NVIDIA GPU") from e


@dataclass
class SingleProcess:
    """One trainer process, rank 0, sends every tensor to ``clients``' workers."""

    clients: list[VLLMClient]
    device: int
    config: SendConfig
    metadata: list[list[Any]] | None = None  # the load plan shipped at init
    workers: Sequence[int] | None = None
    rank: int = 0
    group: None = None
    # Its plan depends only on the metadata, so it is kept while that stays the
    # same; a lone sender may push in the background and send sparse patches.
    stable_plan: ClassVar[bool] = True
    alone: ClassVar[bool] = True

    def form(self, timeout_s: float) -> Connection:
        c = self.config
        return connect(self.clients, device=self.device, workers=self.workers,
                       packed=c.packed, packed_buffer_size_bytes=c.buffer_size_bytes,
                       packed_num_buffers=c.num_buffers, timeout=timeout_s,
                       use_load_plan=self.metadata is not None, metadata=self.metadata)

    def plan(self, metas: list[TensorMeta], sources: Sources) -> BroadcastPlan:
        return BroadcastPlan.single(len(metas))


@dataclass
class ProcessGroup:
    """This process's part in a multi-process trainer (see ``group.py``)."""

    group: TrainerGroup
    # Owners come from the arrays' shardings, so every push plans again; the
    # gathers run in step on every process, so no push runs in the background,
    # and vLLM's sparse engine takes patches from rank 0 only.
    stable_plan: ClassVar[bool] = False
    alone: ClassVar[bool] = False

    @property
    def rank(self) -> int | None:
        return self.group.rank

    @property
    def device(self) -> int:
        return self.group.device

    def form(self, timeout_s: float) -> Connection | None:
        return self.group.form(timeout_s)

    def plan(self, metas: list[TensorMeta], sources: Sources) -> BroadcastPlan:
        plan = broadcast_plan(metas, [owners_of(a) for a in sources.arrays])
        if plan.group != self.group.plan.group:
            raise MetadataError(
                f"these arrays are broadcast by processes {list(plan.group)}, but the group "
                f"was formed with {list(self.group.plan.group)}: call reconnect() on every "
                "process with the new layout")
        return plan


Route = SingleProcess | ProcessGroup
