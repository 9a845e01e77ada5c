"""``M2NRoute``: this process's rank in an NCCL M2N group (the ``Route``
the session drives for ``M2NSender``): process 0 forms the group with the
server, every other process joins it (``uniqueid.m2n``)."""

from __future__ import annotations

from dataclasses import dataclass

from uniqueid import VLLMClient
from uniqueid.m2n.agreement import M2NWireParam
from uniqueid.m2n.join import M2N_JOIN, M2NConnection, M2NJoiner, connect_m2n, join_m2n

from ..core.config import SendConfig
from ..core.group import Share


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
    store_port: int = 0
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
                               store_host=self.store_host, store_port=self.store_port,
                               max_cta=self.max_cta, joiner=self.joiner)
        return join_m2n(self.params, rank=self.process, device=self.device, timeout=timeout_s,
                        share=self.share, joiner=self.joiner)
