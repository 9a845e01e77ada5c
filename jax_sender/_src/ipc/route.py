"""``IPCRoute``: one trainer process pushing to one ``ipc`` server whose
workers share its GPUs (the ``Route`` the session drives for
``IPCSender``). Forming the group is ``uniqueid.ipc.join.connect_ipc``: the
checks, the empty probe update, the init; no NCCL anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from uniqueid import VLLMClient
from uniqueid.ipc.join import IPCConnection, Memory, connect_ipc

from ..core.config import SendConfig


@dataclass(kw_only=True)
class IPCRoute:
    """One trainer process, exporting from ``devices``, to ``clients[0]``.

    Attributes:
        clients: the server (one).
        devices: the trainer's CUDA ordinals it may export from.
        config: every setting (``packed`` is sent at init).
        memory: the GPU's side (``nccl_cffi.ipc.CudaIPC``, or a stand-in).
        strict_devices: refuse a device no worker is on (the caller named them).
    """

    clients: list[VLLMClient]
    devices: list[int]
    config: SendConfig
    memory: Memory
    strict_devices: bool = False
    rank: int = 0
    group: None = None
    alone: ClassVar[bool] = True
    stable_plan: ClassVar[bool] = True

    def form(self, timeout_s: float) -> IPCConnection:
        """Join the server (``connect_ipc``) within ``timeout_s``."""
        return connect_ipc(self.clients[0], devices=self.devices, packed=self.config.packed,
                           memory=self.memory, timeout=timeout_s,
                           strict_devices=self.strict_devices)
