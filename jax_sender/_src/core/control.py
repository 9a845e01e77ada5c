"""The servers' side of one push: vLLM's weight-update routes, in order.

A push may go to many servers (one broadcast feeds them all). Each route is
a *phase*: posted to every server at once (``uniqueid.http.fleet``), the phase
as a whole within one deadline, so a push costs the same few round trips
whether it feeds one server or 256. A phase ends once every server's call
ended; when one server refused, the others are not left inside an open
update session: a session that started on A is finished there before the
error propagates, a pause is undone, and the first failure (in time) is
the one raised, naming its server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nccl_cffi import Deadline
from uniqueid import RendezvousError, VLLMClient
from uniqueid.http.client import Encoded
from uniqueid.http.fleet import Calls, on_each


class ControlPlane:
    """The update routes of ``clients`` (none on trainer processes that only
    broadcast), each phase bounded by ``timeout_s``."""

    def __init__(self, clients: Sequence[VLLMClient], timeout_s: float):
        self.clients = list(clients)
        self.timeout_s = timeout_s
        self.left_open = False  # a failed start may have left a server inside a session
        self.late_pause: list[VLLMClient] = []  # paused without answering: may pause late

    def _calls(self, route: Callable[..., Any], *args: Any,
               clients: Sequence[VLLMClient] | None = None) -> Calls[Any]:
        """``route`` on every server (or ``clients``) at once, in flight: a
        phase, ``timeout_s`` for every call, all made at once."""
        return on_each(self.clients if clients is None else clients, route, *args,
                       deadline=Deadline(self.timeout_s), timeout=self.timeout_s)

    def _settle(self, calls: Calls[Any]) -> None:
        """Wait for every call of ``calls``, then raise its first failure."""
        calls.wait()
        calls.raise_first()

    def _undo(self, route: Callable[..., Any], clients: Sequence[VLLMClient],
              *args: Any) -> bool:
        """Cleanup after a phase failed (whose first failure is the one to
        report): ``route`` on ``clients`` at once, whatever they answer;
        whether every one answered with success."""
        if not clients:
            return True
        calls = self._calls(route, *args, clients=clients)
        with contextlib.suppress(RendezvousError):
            calls.wait()
        return calls.first is None and not calls.pending()

    def pause(self, mode: str) -> None:
        """``/pause`` on every server at once; on a failure, those that
        paused (or may have: unanswered, kept in ``late_pause``) are resumed.

        Raises:
            RendezvousError: the first server that failed, once all answered.
        """
        calls = self._calls(VLLMClient.pause, mode)
        try:
            self._settle(calls)
        except BaseException:
            unanswered = calls.unanswered()  # it may pause all the same
            self.late_pause += unanswered
            self._undo(VLLMClient.resume, calls.succeeded() + unanswered)
            raise

    def resume(self, clients: Sequence[VLLMClient] | None = None) -> None:
        """``/resume`` on every server (or ``clients``) at once.

        Raises:
            RendezvousError: the first server that failed, once all answered.
        """
        self._settle(self._calls(VLLMClient.resume, clients=clients))

    def start(self) -> None:
        """``/start_weight_update`` everywhere; on a failure, the sessions
        that started are finished again. ``left_open`` says whether a server
        may still be inside one: a start that went unanswered (it may land
        late), or a finish of the cleanup that failed."""
        calls = self._calls(VLLMClient.start_weight_update)
        try:
            self._settle(calls)
        except BaseException:  # no server is left inside an open session
            self.left_open = bool(calls.unanswered())
            if not self._undo(VLLMClient.finish_weight_update, calls.succeeded()):
                self.left_open = True
            raise

    def update(self, payload: dict[str, Any], timeout_s: float) -> Calls[Any]:
        """``/update_weights`` on every server, in flight at once (the workers
        receive inside the call, while the trainer broadcasts), each call
        within ``timeout_s``. ``Calls.times`` holds each call's own time,
        measured where it is made (as vLLM's torch engine is timed), so no
        handoff between threads is counted in it. The payload is encoded
        once for every server."""
        return on_each(self.clients, VLLMClient.update_weights, Encoded(payload),
                       deadline=Deadline(timeout_s), timeout=timeout_s)

    def finish(self, weight_version: str | None) -> None:
        """``/finish_weight_update`` on every server at once.

        Raises:
            RendezvousError: the first server that failed, once all answered.
        """
        self._settle(self._calls(VLLMClient.finish_weight_update, weight_version))


def best_effort(calls: Iterable[Callable[[], Any]]) -> None:
    """Make each call, whatever the servers answer: cleanup after a first
    failure, which is the one to report."""
    for call in calls:
        with contextlib.suppress(RendezvousError):
            call()
