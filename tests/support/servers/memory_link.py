"""A whole push on CPU: the sender's real code over an in-memory wire.

The servers are ``memory_server.MemoryServer``: real HTTP on loopback, with
vLLM's routes, session rules and receiving, written from vLLM's code and
not from this library's. The group forms through the real
``uniqueid.connect`` (world sizes, init payloads, the servers' answers):
only the NCCL handshake is replaced (``MemoryJoin``), and only the
broadcasts go over memory (``MemoryBroadcaster``, which lays each
broadcast's bytes on every server's wire and, like NCCL, ends a broadcast
only once every receiver took it).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from jax_sender import SendConfig, SparseSender, WeightSender
from jax_sender._src.core.routes import SingleProcess
from jax_sender._src.core.session import Session
from nccl_cffi import NcclTimeoutError
from uniqueid import UniqueId, VLLMClient

from support.servers.memory_server import MemoryServer


class MemoryComm:
    """What a sender asks of its communicator outside the broadcasts."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.in_call_since = 0.0
        self.aborted = ""
        self.destroyed = False

    @property
    def state(self) -> str:
        return self.aborted or ("destroyed" if self.destroyed else "open")

    def abort(self, reason: str = "aborted") -> None:
        self.aborted = self.aborted or reason

    def destroy(self, timeout: float | None = None) -> None:
        self.destroyed = True


class MemoryJoin:
    """The trainer's side of a join with no GPU: nothing to check, and a
    ``MemoryComm`` once every server answered its init (which its workers do
    at once: there is no NCCL to wait in). ``joins`` records each join's
    arguments."""

    def __init__(self) -> None:
        self.joins: list[dict[str, Any]] = []
        self.comms: list[MemoryComm] = []

    def preflight(self, device: int) -> None:
        pass

    def mint(self) -> UniqueId:
        """A random id: NCCL's would open a bootstrap listener only a real init closes."""
        return UniqueId(os.urandom(128))

    def join(self, world_size: int, unique_id: Any, rank: int, device: int, *,
             timeout: float | None, check: Any) -> MemoryComm:
        self.joins.append(dict(world_size=world_size, unique_id=unique_id, rank=rank,
                               device=device, timeout=timeout))
        check()  # a server that refused init at once fails the join
        self.comms.append(MemoryComm(world_size))
        return self.comms[-1]


class _Tee:
    """One broadcast reaches the wire of every server of the group (by URL:
    ``follow`` a new group's servers after a change of the fleet)."""

    def __init__(self, wires: dict[str, queue.Queue]):
        self.by_url = wires
        self.urls = list(wires)

    def put(self, root: int, data: bytes) -> list[threading.Event]:
        taken = [threading.Event() for _ in self.urls]
        for url, e in zip(self.urls, taken):
            self.by_url[url].put((root, data, e))
        return taken


class MemoryBroadcaster:
    """Puts each broadcast's bytes on the wire; like NCCL's, a broadcast ends
    only once every receiver took it (``check`` polled meanwhile), and one
    not taken within the push's per-wait deadline raises ``NcclTimeoutError``.
    ``gate``: an event every broadcast of a pass but its first waits for
    (``check`` polled), so a test can keep a push going until it acted."""

    def __init__(self, wire: _Tee, delay_s: float = 0.0):
        self.wire = wire
        self.delay_s = delay_s
        self.started = 0.0
        self.host_s = 0.0
        self.link_s = 0.0
        self.link_bytes = 0
        self.closed = False
        self.launched = 0  # broadcasts of the current pass
        self.sent: list[tuple[int, int, float]] = []  # (root, nbytes, time issued)
        self.passes: list[str] = []  # per pass: "copies", "xla", "tensors", "scratch", "complete"
        self.gate: threading.Event | None = None

    def _begin(self, kind: str) -> None:
        self.started, self.launched = 0.0, 0
        self.passes.append(kind)

    def _put(self, root: int, data: bytes, check, timeout: float | None) -> None:
        self.started = self.started or time.perf_counter()
        time.sleep(self.delay_s)
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        while self.launched and self.gate is not None and not self.gate.wait(0.01):
            check()
            if time.monotonic() > deadline:
                raise NcclTimeoutError(f"the test's gate did not open within {timeout}s")
        self.sent.append((root, len(data), time.monotonic()))
        self.launched += 1
        taken = self.wire.put(root, data)
        while not all(e.wait(0.01) for e in taken):
            check()
            if time.monotonic() > deadline:
                raise NcclTimeoutError(f"broadcast did not complete within {timeout}s; a "
                                       "receiver did not take it")
        check()

    def packed(self, metas, chunks, get, root, *, timeout, check, temporaries=True) -> None:
        self._begin("copies")
        for c in chunks:
            data = b"".join(np.asarray(get(i)).tobytes() for i in range(c.start, c.stop))
            assert len(data) == c.nbytes
            self._put(root, data, check, timeout)

    def produced(self, chunks, make, root, *, timeout, check, reuse=False) -> None:
        self._begin("xla")
        for k, c in enumerate(chunks):
            data = np.asarray(make(k, None)).tobytes()
            assert len(data) == c.nbytes
            self._put(root, data, check, timeout)

    def unpacked(self, metas, get, root, *, timeout, check) -> None:
        self._begin("tensors")
        for i, m in enumerate(metas):
            self._put(root, np.asarray(get(i)).tobytes()[:m.nbytes], check, timeout)

    def scratch(self, parts, root, *, timeout, check, fill=None) -> None:
        self._begin("scratch")
        for k, (_, _, nbytes) in enumerate(parts):
            data = bytes(nbytes) if fill is None else np.asarray(fill(k)).tobytes()
            self._put(root, data, check, timeout)

    def complete(self, parts, root, *, timeout, check, fill=None) -> None:
        done = self.launched
        self.scratch(parts[done:], root, timeout=timeout, check=check,
                     fill=None if fill is None else lambda k: fill(done + k))
        self.passes[-1] = "complete"

    def close(self) -> None:
        self.closed = True

    def follow(self, conn: Any) -> MemoryBroadcaster:
        """This broadcaster for ``conn``'s group: its broadcasts reach that
        group's servers (a dropped one no more, one added too)."""
        self.wire.urls = [c.base_url for c in conn.clients]
        self.closed = False
        return self


def memory_route(config: SendConfig = SendConfig(), *, servers: int = 1, workers: int = 1,
                 sparse: bool = False) -> tuple[SingleProcess, list[MemoryServer], _Tee]:
    """A single-process route (not formed yet) to ``servers`` memory servers
    of ``workers`` workers each, joined through ``MemoryJoin``, and the wire
    that feeds them all: for a test that forms the group itself (to hold an
    init past its deadline, say); ``sender_on`` makes the sender."""
    hosts = [MemoryServer(queue.Queue(), workers=workers, sparse=sparse) for _ in range(servers)]
    clients = [VLLMClient(h.url, timeout=20) for h in hosts]
    route = SingleProcess(clients=clients, device=0, config=config, joiner=MemoryJoin())
    return route, hosts, _Tee({h.url: h.wire for h in hosts})


def sender_on(route: SingleProcess, wire: _Tee, *, delay_s: float = 0.0,
              kind: type = WeightSender, **kwargs) -> tuple[Any, MemoryBroadcaster]:
    """A sender (``kind``) on JAX's first CPU device over ``route``, formed
    now within the config's ``init_timeout_s``."""
    caster = MemoryBroadcaster(wire, delay_s)
    session = Session(route, route.form(route.config.init_timeout_s), route.config,
                      broadcaster=caster.follow)
    return kind(session, device=jax.devices("cpu")[0], **kwargs), caster


def memory_sender(config: SendConfig = SendConfig(), *, servers: int = 1, workers: int = 1,
                  delay_s: float = 0.0, kind: type = WeightSender,
                  **kwargs) -> tuple[Any, list[MemoryServer], MemoryBroadcaster]:
    """A sender (``kind``) on JAX's first CPU device, joined through
    ``uniqueid.connect`` to ``servers`` memory servers of ``workers`` workers
    each, which one broadcast feeds (like one NCCL group); a
    ``SparseSender``'s servers run ``sparse_nccl``."""
    if kind is SparseSender:
        from dataclasses import replace
        config = replace(config, packed=False)
    route, hosts, wire = memory_route(config, servers=servers, workers=workers,
                                      sparse=kind is SparseSender)
    sender, caster = sender_on(route, wire, delay_s=delay_s, kind=kind, **kwargs)
    return sender, hosts, caster


class NullBroadcaster:
    """A data plane that moves nothing: each broadcast reads its arrays (the
    sender's own work) and ends at once. For the fleet bench and tests,
    whose do-nothing servers (``support.servers.idle_servers``) receive nothing."""

    started = host_s = link_s = 0.0
    link_bytes = 0

    def packed(self, metas, chunks, get, root, *, timeout, check, temporaries=True) -> None:
        for c in chunks:
            for i in range(c.start, c.stop):
                get(i)
            check()

    def produced(self, chunks, make, root, *, timeout, check, reuse=False) -> None:
        for k in range(len(chunks)):
            make(k, None)
            check()

    def unpacked(self, metas, get, root, *, timeout, check) -> None:
        for i in range(len(metas)):
            get(i)
            check()

    def scratch(self, parts, root, *, timeout, check, fill=None) -> None:
        check()

    def complete(self, parts, root, *, timeout, check, fill=None) -> None:
        check()

    def close(self) -> None:
        pass


def restarted(server: MemoryServer, wire: Any) -> MemoryServer:
    """``server`` stopped, and a fresh one (nothing held, no engine) serving
    on its URL, its wire taken by ``wire`` (the link's ``_Tee``): a vLLM
    restarted where it was."""
    server.close()
    port = int(server.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 10
    while True:
        try:
            fresh = MemoryServer(queue.Queue(), workers=server.workers, sparse=server.sparse,
                                 port=port)
            break
        except OSError:  # the old one's socket is still closing
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    wire.by_url[fresh.url] = fresh.wire
    return fresh


def null_sender(urls: list[str], config: SendConfig = SendConfig()) -> WeightSender:
    """A ``WeightSender`` on JAX's first CPU device, its group formed through
    the real ``uniqueid.connect`` with the servers at ``urls`` (their clients
    made here, as ``WeightSender.connect`` makes them), over ``MemoryJoin``
    and a ``NullBroadcaster``."""
    from uniqueid import as_clients
    route = SingleProcess(clients=as_clients(urls), device=0, config=config,
                          joiner=MemoryJoin())
    session = Session(route, route.form(config.init_timeout_s), config,
                      broadcaster=lambda _: NullBroadcaster())
    return WeightSender(session, device=jax.devices("cpu")[0])
