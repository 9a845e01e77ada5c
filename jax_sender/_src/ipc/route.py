"""``IPCRoute``: trainer processes pushing to one ``ipc`` server whose
workers share their GPUs (the ``Route`` the session drives for
``IPCSender``): one process, or a group of them on one node, process 0
posting every update with the handles of all (``uniqueid.ipc.group``).
Forming it is ``uniqueid.ipc.join.connect_ipc``: the checks, the empty
probe update, the init; no NCCL anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from uniqueid import VLLMClient
from uniqueid.ipc.group import GroupLink
from uniqueid.ipc.join import IPCConnection, Memory, connect_ipc

from ..core.config import SendConfig


@dataclass(kw_only=True)
class IPCRoute:
    """One trainer process, exporting from ``devices``, to ``clients[0]``;
    with ``link``, one process of a group.

    Attributes:
        clients: the server (one; none on a group's processes but 0).
        devices: the trainer's CUDA ordinals it may export from.
        config: every setting (``packed`` is sent at init).
        memory: the GPU's side (``nccl_cffi.ipc.CudaIPC``, or a stand-in).
        strict_devices: refuse a device no worker is on (the caller named them).
        link: the group's store, kept for the sender's life (None: alone).
    """

    clients: list[VLLMClient]
    devices: list[int]
    config: SendConfig
    memory: Memory
    strict_devices: bool = False
    link: GroupLink | None = None
    rank: int = 0
    group: None = None
    stable_plan: ClassVar[bool] = True

    @property
    def alone(self) -> bool:
        """One trainer process (a group's push runs in step on every one)."""
        return self.link is None

    def form(self, timeout_s: float) -> IPCConnection:
        """Join the server (``connect_ipc``) within ``timeout_s``; in a
        group, every process together, under a new generation of keys."""
        if self.link is not None:
            self.link.generation += 1
        return connect_ipc(self.clients[0] if self.clients else None, devices=self.devices,
                           packed=self.config.packed, memory=self.memory, timeout=timeout_s,
                           strict_devices=self.strict_devices, group=self.link)

    def close(self) -> None:
        """Close the group's store, if any (after the session's close)."""
        if self.link is not None:
            self.link.close()
