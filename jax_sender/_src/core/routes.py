"""How a trainer takes part in a push: a *route*.

``SingleProcess``: one trainer process sends every tensor. ``ProcessGroup``:
several processes of one JAX job, each parameter sent by its first owner
(see ``group.py``). A backend whose group forms otherwise brings a route of
its own (``m2n/route.py``: every trainer process sends its own blocks,
resharded by NCCL M2N). A route forms the
transfer group and plans who sends what; what differs between them is a
route's, never a ``None`` check in the sender.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import jax

from nccl_cffi import CudaError
from uniqueid import NCCL_JOIN, Connection, Joiner, VLLMClient, connect

from .config import SendConfig
from .errors import MetadataError, TransferError
from .group import TrainerGroup
from .tensors.plan import TensorMeta
from .turns import BroadcastPlan, broadcast_plan, owners_of

if TYPE_CHECKING:
    from .tensors.describe import Sources


def first_gpu() -> int:
    return jax.local_devices(backend="gpu")[0].local_hardware_id


def jax_device(ordinal: int) -> jax.Device:
    """JAX's device for CUDA ordinal ``ordinal``.

    Raises:
        TransferError: JAX has no such GPU (one sentence, with the fix).
    """
    try:
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    for d in gpus:
        if d.local_hardware_id == ordinal:
            return d
    raise TransferError(
        f"JAX has no local GPU with CUDA ordinal {ordinal!r} (it sees "
        f"{sorted(d.local_hardware_id for d in gpus) or 'none'}): pass one of those as device=, "
        "check CUDA_VISIBLE_DEVICES, or install JAX with CUDA (pip install "
        "'jax-vllm-nccl[cuda13]')")


def usable_device(ordinal: int | None) -> tuple[int, jax.Device]:
    """The trainer's GPU, checked before anything reaches a server: its CUDA
    ordinal (``ordinal``, or JAX's first GPU) and JAX's device for it.

    Raises:
        TransferError: JAX sees no such GPU, or the driver cannot use it.
    """
    ordinal = sender_device(ordinal)
    device = jax_device(ordinal)
    try:
        NCCL_JOIN.preflight(ordinal)
    except CudaError as e:
        raise TransferError(str(e)) from e
    return ordinal, device


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


@dataclass(kw_only=True)
class SingleProcess:
    """One trainer process, rank 0, sends every tensor to ``clients``' workers."""

    clients: list[VLLMClient]
    device: int
    config: SendConfig
    metadata: list[list[Any]] | None = None  # the load plan shipped at init
    workers: Sequence[int] | None = None
    joiner: Joiner = NCCL_JOIN  # the trainer's side of the join (tests pass their own)
    rank: int = 0
    group: None = None
    # Its plan depends only on the metadata, so it is kept while that stays the
    # same; a lone sender may push in the background and send sparse patches.
    stable_plan: ClassVar[bool] = True
    alone: ClassVar[bool] = True

    def form(self, timeout_s: float) -> Connection:
        """Join the servers' workers (``uniqueid.connect``) within ``timeout_s``."""
        return connect(self.clients, device=self.device, workers=self.workers,
                       timeout=timeout_s, use_load_plan=self.metadata is not None,
                       metadata=self.metadata, joiner=self.joiner, **self.config.wire())

    def plan(self, metas: list[TensorMeta], sources: Sources) -> BroadcastPlan:
        return BroadcastPlan.single(len(metas))


@dataclass(kw_only=True)
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


class Route(Protocol):
    """What the session asks of a route: its rank in the transfer group
    (None off it), its group of trainer processes (None: one process),
    whether it is one trainer process (``alone``: a push may run in the
    background, a failure posts no further round), and forming the group.
    ``SingleProcess`` and ``ProcessGroup`` here; a backend whose group forms
    otherwise brings its own (``m2n/route.py``)."""

    @property
    def rank(self) -> int | None: ...

    @property
    def group(self) -> TrainerGroup | None: ...

    @property
    def alone(self) -> bool: ...

    def form(self, timeout_s: float) -> Any: ...
