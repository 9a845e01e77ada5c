"""How a trainer takes part in a push: a *route*.

``SingleProcess``: one trainer process sends every tensor. ``ProcessGroup``:
several processes of one JAX job, each parameter sent by its first owner
(see ``group.py``). ``M2NRoute``: every trainer process sends its own
blocks, resharded by NCCL M2N (see ``m2n_sender.py``). A route forms the
transfer group and plans who sends what; what differs between them is a
route's, never a ``None`` check in the sender.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from nccl_cffi import CudaError
from uniqueid import NCCL_JOIN, Connection, Joiner, VLLMClient, connect
from uniqueid.m2n import M2N_JOIN, M2NConnection, M2NJoiner, connect_m2n, join_m2n
from uniqueid.m2n_agreement import M2NWireParam

from .config import SendConfig
from .errors import MetadataError, TransferError
from .group import Share, TrainerGroup
from .plan import TensorMeta
from .turns import BroadcastPlan, broadcast_plan, owners_of

if TYPE_CHECKING:
    from .describe import Sources


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


@dataclass(kw_only=True)
class M2NRoute:
    """This process's rank in an M2N group: process ``p`` of ``processes``
    is trainer rank ``p``; process 0 talks to the server."""

    clients: list[VLLMClient]  # the server, on process 0; empty elsewhere
    device: int
    config: SendConfig
    params: list[M2NWireParam]  # the plan, identical on every process
    process: int
    processes: int
    share: Share
    store_host: str | None = None
    max_cta: int | None = None
    joiner: M2NJoiner = M2N_JOIN  # the data plane's side of the join (tests pass their own)
    group: None = None

    @property
    def rank(self) -> int:
        return self.process

    @property
    def alone(self) -> bool:
        """One trainer process: a push may run in the background."""
        return self.processes == 1

    def form(self, timeout_s: float) -> M2NConnection:
        """Form the group (process 0) or join it, within ``timeout_s``."""
        share = None if self.alone else self.share
        if self.process == 0:
            return connect_m2n(self.clients[0], self.params, device=self.device,
                               timeout=timeout_s, trainer_ranks=self.processes, share=share,
                               store_host=self.store_host, max_cta=self.max_cta,
                               joiner=self.joiner)
        return join_m2n(self.params, rank=self.process, device=self.device, timeout=timeout_s,
                        share=self.share, joiner=self.joiner)


Route = SingleProcess | ProcessGroup | M2NRoute
