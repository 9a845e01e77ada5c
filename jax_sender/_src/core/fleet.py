"""The servers a sender pushes to (its *fleet*), and changing them while it runs.

NCCL fixes a group's world size at its init, so no server can join a
running group or leave it: every change of the fleet forms a new group,
exactly as ``reconnect()`` does (every server released at once, a new id,
every server's init), within ``reconnect_timeout_s``. Only the set of
servers differs:

* ``reconnect(drop_dead=True)``: a server that cannot be released (gone:
  its connection fails; or stuck: its engine does not answer, and it needs
  a restart) is left out of the new group and named (``DroppedServer``);
  the sender goes on with the rest.
* ``drop_server(url)``: leave one out, gone or not (it is released if it
  answers, so it is ready for another trainer).
* ``add_server(url)``: take one in, or back once it returns. Its world size
  is asked first, so a server that cannot join leaves the running group as
  it was.

A multi-process sender (``connect_group``) drops dead servers on process 0
(``reconnect(drop_dead=True)`` on every process, together); adding and
dropping by name are for a single trainer process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from uniqueid import (
    RendezvousError,
    ServerStuck,
    VLLMClient,
    VLLMConnectionError,
)
from uniqueid.http.url import server_key, shown

from .errors import TransferError
from .routes import ProcessGroup, Route, SingleProcess

log = logging.getLogger("jax_sender")

GONE_HINT = ("if a server is gone or stuck, reconnect(drop_dead=True) goes on without it "
             "(add_server() takes it back once it is up)")


@dataclass(frozen=True, kw_only=True)
class DroppedServer:
    """A server ``reconnect(drop_dead=True)`` left out of the new group.

    Attributes:
        url: its URL (``add_server(url)`` takes it back).
        reason: why it could not be released, in its error's words.
    """

    url: str
    reason: str


def fleet_of(route: Route) -> list[VLLMClient]:
    """The servers this process talks to: the route's own list, changed in
    place (process 0's in a group; none on the other processes)."""
    return route.group.clients if isinstance(route, ProcessGroup) else route.clients


def single(route: Route, what: str) -> SingleProcess:
    """``route``, refused unless it is one trainer process's.

    Raises:
        TransferError: a multi-process sender.
    """
    if not isinstance(route, SingleProcess):
        raise TransferError(f"{what} needs a single-process sender (connect): a group's "
                            "processes form their group together; call reconnect(drop_dead=True) "
                            "on every process, or connect_group() again with the new servers")
    return route


def find(route: Route, server: str | VLLMClient) -> VLLMClient:
    """The client of ``server`` (a URL however spelled, or a client of the
    same server), called in the sender's turn: a fleet change made
    meanwhile by another thread is seen.

    Raises:
        TransferError: a multi-process sender.
        ValueError: a URL ``check_base_url`` refuses, no such server in the
            fleet, or it is the last one.
    """
    clients = single(route, "drop_server()").clients
    key = server.server_key if isinstance(server, VLLMClient) else server_key(server)
    found = [c for c in clients if c.server_key == key]
    name = server.base_url if isinstance(server, VLLMClient) else shown(server)
    if not found:
        raise ValueError(f"{name} is not one of this sender's servers "
                         f"({', '.join(c.base_url for c in clients)})")
    if len(clients) == 1:
        raise ValueError(f"{name} is this sender's last server: close() the sender instead")
    return found[0]


def refuse_known(route: SingleProcess, client: VLLMClient) -> None:
    """Refuse to add ``client`` where the fleet has its server (in the
    sender's turn, so two threads adding one server cannot both pass).

    Raises:
        ValueError: the fleet has that server, however its URL is spelled.
    """
    same = [c for c in route.clients if c.server_key == client.server_key]
    if same:
        spelled = "" if same[0].base_url == client.base_url else f" (as {same[0].base_url})"
        raise ValueError(f"{client.base_url} is already one of this sender's servers{spelled}")


def leave_out(route: Route, gone: Sequence[VLLMClient]) -> None:
    """Take ``gone`` out of the fleet (and the worker counts given for it),
    and close their clients."""
    fleet = fleet_of(route)
    keep = [i for i, c in enumerate(fleet) if all(c is not g for g in gone)]
    if isinstance(route, SingleProcess) and route.workers is not None:
        route.workers = [route.workers[i] for i in keep]
    fleet[:] = [fleet[i] for i in keep]
    for client in gone:
        client.close()


def settle(route: Route, released: Sequence[tuple[VLLMClient, RendezvousError | None]], *,
           drop_dead: bool, leaving: VLLMClient | None = None) -> list[DroppedServer]:
    """The fleet once every server of the old group was released: ``leaving``
    left out (released or not); with ``drop_dead``, each server that could
    not be released too.

    Returns:
        The servers dropped as dead, each named with its reason.

    Raises:
        RendezvousError: a server that stays could not be released (its
            own error, which names it and, when it is gone or stuck, says
            how to go on without it); or every server would be dropped.
    """
    if leaving is not None:
        _leave(route, leaving, dict((id(c), p) for c, p in released).get(id(leaving)))
    failed = [(c, p) for c, p in released if p is not None and c is not leaving]
    if failed and not drop_dead:
        for _, problem in failed[1:]:
            log.warning("%s", problem)
        raise hinted(failed[0][1])
    if failed and len(failed) == len(fleet_of(route)):
        raise RendezvousError(f"no server could be released, so none is left to form a group "
                              f"with (the first: {failed[0][1]}); restart them and reconnect()")
    dropped = [DroppedServer(url=c.base_url, reason=str(p)) for c, p in failed]
    for d in dropped:
        log.warning("dropped %s from the fleet: %s; add_server(%r) takes it back once it is "
                    "up", d.url, d.reason, d.url)
    leave_out(route, [c for c, _ in failed])
    return dropped


def _leave(route: Route, leaving: VLLMClient, problem: RendezvousError | None) -> None:
    """``leaving`` out of the fleet, with a warning where it was not released."""
    if problem is not None:
        log.warning("%s left without being released (%s): restart it before another "
                    "trainer uses it", leaving.base_url, problem)
    leave_out(route, [leaving])


def hinted(problem: RendezvousError) -> RendezvousError:
    """``problem``, of the same type, saying how to go on without its server
    where it is gone or stuck."""
    if isinstance(problem, ServerStuck):
        return ServerStuck(f"{problem}; or {GONE_HINT}")
    if isinstance(problem, VLLMConnectionError):
        return type(problem)(f"{problem}; {GONE_HINT}", problem.route)
    return problem
