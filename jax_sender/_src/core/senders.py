"""What every sender shares around the one ``Session`` it holds.

Senders differ only in how ``params`` become a push; their arguments'
checks, their verification result, the NCCL session the broadcast and
sparse senders open, and their lifetime (settings, state, fleet, close)
are the same. They are plain functions here, which each sender class takes
as its own members (``config = property(senders.config)``,
``close = senders.close``): a sender holds its session, it never inherits
one, and no backend imports another's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from nccl_cffi import Deadline
from uniqueid import VLLMClient, as_clients
from uniqueid.http.fleet import call_all

from .broadcaster import Broadcaster
from .config import SendConfig
from .errors import MetadataError, TransferError
from .fleet import DroppedServer, fleet_of
from .routes import Route
from .session import Session
from .tensors.plan import TensorMeta

Servers = Any  # a URL, a ``VLLMClient``, or a list of either
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """What ``verify`` found: tensors whose digest matches on every worker, those
    that differ somewhere, and those no server reports under their own name
    (fused or sharded at runtime, e.g. ``qkv_proj``), which it cannot check.

    Attributes:
        matched: the names whose digest matches everywhere it is reported.
        mismatched: the names whose digest differs on some worker.
        unchecked: the names no server reports.
    """

    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unchecked: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Nothing differs."""
        return not self.mismatched


def verdict(names: list[str], seen: dict[str, bool]) -> VerifyResult:
    """``names`` sorted by what the workers' digests said of them (``seen``:
    by name, whether every worker that reports it matches).

    Args:
        names: every tensor checked.
        seen: the names the servers report, each True when every digest matched.

    Returns:
        The ``VerifyResult``.
    """
    return VerifyResult(matched=tuple(n for n in names if seen.get(n) is True),
                        mismatched=tuple(n for n in names if seen.get(n) is False),
                        unchecked=tuple(n for n in names if n not in seen))


def checksums(clients: Sequence[VLLMClient], metas: Sequence[TensorMeta],
              get: Callable[[int], Any]) -> tuple[dict[str, str], dict[str, bool]]:
    """Each tensor's SHA-256 here (of ``get(i)``'s C-order bytes, vLLM's
    ``/weight_checker`` rule), and by name whether every worker of every
    server that reports it holds the same (the servers asked at once).

    Args:
        clients: the servers.
        metas: the tensors.
        get: tensor ``i`` as pushed.

    Returns:
        The digests here, by name; and by name, whether the workers' match.

    Raises:
        RendezvousError: a server did not answer as vLLM does.
    """
    want = {m.name: hashlib.sha256(np.asarray(get(i)).tobytes(order="C")).hexdigest()
            for i, m in enumerate(metas)}
    seen: dict[str, bool] = {}
    for answer in call_all(clients, VLLMClient.weight_checker, "checksum", deadline=Deadline(None)):
        for key, digest in answer["checksums"].items():
            name = key.split(":", 4)[-1]
            if name in want:
                seen[name] = seen.get(name, True) and digest == want[name]
    return want, seen


def one_server(servers: Servers, what: str) -> list[VLLMClient]:
    """The one server's client, for a sender that takes one deployment.

    Args:
        servers: a URL, a client, or a list of either.
        what: the sender, for the error (``"an M2N group"``).

    Returns:
        ``[client]``.

    Raises:
        TransferError: not one server (the clients made here are closed).
        ValueError: a URL that is not http(s).
    """
    clients = as_clients(servers)
    if len(clients) != 1:
        for c in clients:
            c.close()
        raise TransferError(f"{what} takes one vLLM server (one deployment), got {len(clients)}: "
                            "make one sender per server")
    return clients


def check_push(weight_version: Any, pause: Any, metadata: Any) -> None:
    """Refuse arguments a push cannot carry, before anything reaches a server.

    Args:
        weight_version: stamped on the servers by ``/finish_weight_update``.
        pause: vLLM's pause mode for the push, or None.
        metadata: what the caller declared, or None.

    Raises:
        MetadataError: ``weight_version`` not a str that JSON and UTF-8 can
            carry, ``pause`` not a vLLM mode, ``metadata`` not ``TensorMeta``\\ s.
    """
    if weight_version is not None:
        if not isinstance(weight_version, str):
            raise MetadataError(f"weight_version must be a str (vLLM stores it as one), got "
                                f"{type(weight_version).__name__} {weight_version!r}")
        try:
            weight_version.encode("utf-8")
        except UnicodeEncodeError as e:
            raise MetadataError(f"weight_version {weight_version!r} cannot travel as JSON "
                                f"text ({e.reason})") from None
    if pause is not None and pause not in PAUSE_MODES:
        raise MetadataError(f"pause must be one of {', '.join(PAUSE_MODES)} or None, got "
                            f"{pause!r}")
    if metadata is not None and not all(isinstance(m, TensorMeta) for m in metadata):
        raise MetadataError("metadata must be a sequence of TensorMeta")


def open_session(route: Route, config: SendConfig, device: jax.Device) -> Session:
    """Form ``route``'s NCCL group (within ``config.init_timeout_s``) and hold
    it in a session whose broadcasts go from ``device``; the HTTP clients
    made for it are closed if that fails.

    Args:
        route: how this trainer takes part.
        config: every setting.
        device: the JAX device the broadcasts go from.

    Returns:
        The session.

    Raises:
        RendezvousError: the group did not form (see ``uniqueid.connect``).
        NcclError: NCCL refused the trainer's init.
    """
    try:
        connection = route.form(config.init_timeout_s)
    except BaseException:
        for client in getattr(route, "clients", []):
            client.close()
        raise
    return Session(route, connection, config, broadcaster=lambda conn: Broadcaster(
        conn.comm, device, conn.init_info.packed_buffer_size_bytes,
        conn.init_info.packed_num_buffers))


# -- a sender's lifetime, taken by each sender class as its own members ------
def config(self: Any) -> SendConfig:
    """Every setting of this sender (the session's)."""
    return self.session.config


def broken(self: Any) -> str:
    """Why the transfer group is broken ("" when it is not)."""
    return self.session.broken


def servers(self: Any) -> tuple[str, ...]:
    """The URLs of the servers this sender pushes to (process 0's in a group)."""
    return tuple(c.base_url for c in fleet_of(self.session.route))


def reconnect(self: Any, *, drop_dead: bool = False) -> list[DroppedServer]:
    """Form the transfer group again after a failure (see ``Session.reconnect``).

    Finishes the servers' open update sessions, shuts their engines
    down (every server at once), and joins again, all within
    ``config.reconnect_timeout_s``. In a group, every process calls it
    together (servers are dropped on process 0).

    Args:
        drop_dead: a server that cannot be released (gone, or stuck:
            its engine does not answer) is left out of the new group,
            named in the result and in a warning, instead of failing
            the reconnect; ``add_server(url)`` takes it back.

    Returns:
        The servers left out, each with its reason (none without ``drop_dead``).

    Raises:
        SenderClosed: the sender is closed.
        SendError: a push in flight did not end by its deadlines.
        ServerStuck: a server's engine does not answer (restart it, or
            ``drop_dead=True``).
        RendezvousError: a server could not be released (``drop_dead``
            goes on without it), or the new group did not form
            (``RendezvousTimeout``).
        NcclError: NCCL refused the trainer's new init.
    """
    return self.session.reconnect(drop_dead=drop_dead)


def drop_server(self: Any, server: str | VLLMClient) -> None:
    """Stop pushing to ``server``: the group is formed again without it
    (NCCL's world size is fixed at init), like ``reconnect()``, within
    ``config.reconnect_timeout_s``. A server that is gone is left
    without a word to it (a warning says so); one that answers is
    released, ready for another trainer. Single-process senders only.
    Drops from several threads at once are made one after another, so
    the sender always keeps a server.

    Args:
        server: its URL (one of ``servers``, however spelled: see
            ``uniqueid.http.url.server_key``), or its client.

    Raises:
        ValueError: not one of ``servers``, or the last one (``close()``).
        TransferError: a multi-process sender.
        SenderClosed, SendError, ServerStuck, RendezvousError,
        NcclError: as ``reconnect``.
    """
    self.session.drop_server(server)


def add_server(self: Any, server: str | VLLMClient, *, workers: int | None = None) -> None:
    """Push to ``server`` too (a new one, or one dropped and back up):
    its world size is asked first, so a server that cannot join leaves
    the sender as it was; then the group is formed again with every
    server, like ``reconnect()``, within ``config.reconnect_timeout_s``.
    The next push sends every tensor with its metadata. Single-process
    senders only. A server is one server however its URL is spelled, and
    however many threads add it at once: it is taken in once.

    Args:
        server: its URL, or a ``VLLMClient``.
        workers: its worker count, asked when not given.

    Raises:
        ValueError: a URL that is not http(s), or already one of
            ``servers`` (however spelled).
        TransferError: a multi-process sender.
        RendezvousError: it cannot join (nothing changed), or the new
            group did not form.
        SenderClosed, SendError, ServerStuck, NcclError: as ``reconnect``.
    """
    self.session.add_server(server, workers=workers)


def close(self: Any) -> None:
    """Let a push in flight end on the servers (within its deadlines),
    release the servers and free everything (see ``Session.close``). A
    server that cannot be released is logged, not raised; calling it
    again does nothing."""
    self.session.close()


def enter(self: Any) -> Any:
    """``with sender:`` closes it on the way out."""
    return self


def exit_(self: Any, *exc: Any) -> None:
    """Closes the sender (``close``)."""
    self.close()
