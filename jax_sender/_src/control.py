"""The servers' side of one push: vLLM's weight-update routes, in order.

A push may go to several servers (one broadcast feeds them all). Each route
is posted to every server, each call within the push's deadline as a whole
call; when one server refuses, the others are not left inside an open
update session: a session that started on A is finished there before the
error propagates, and a pause is undone.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from nccl_cffi import in_background
from uniqueid import RendezvousError, VLLMClient, VLLMConnectionError


class ControlPlane:
    """The update routes of ``clients`` (none on trainer processes that only
    broadcast), each call bounded by ``timeout_s``."""

    def __init__(self, clients: Sequence[VLLMClient], timeout_s: float):
        self.clients = list(clients)
        self.timeout_s = timeout_s
        self.left_open = False  # a failed start may have left a server inside a session
        self.late_pause: list[VLLMClient] = []  # paused without answering: may pause late

    def pause(self, mode: str) -> None:
        done: list[VLLMClient] = []
        try:
            for c in self.clients:
                c.pause(mode, timeout=self.timeout_s)
                done.append(c)
        except BaseException as e:
            if isinstance(e, VLLMConnectionError):  # unanswered: it may pause all the same
                done.append(c)
                self.late_pause.append(c)
            best_effort(functools.partial(c.resume, timeout=self.timeout_s) for c in done)
            raise

    def resume(self) -> None:
        errors = []
        for c in self.clients:
            try:
                c.resume(timeout=self.timeout_s)
            except RendezvousError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def start(self) -> None:
        """``/start_weight_update`` everywhere; on a failure, the sessions
        that started are finished again. ``left_open`` says whether a server
        may still be inside one: a start that went unanswered (it may land
        late), or a finish of the cleanup that failed."""
        started: list[VLLMClient] = []
        try:
            for c in self.clients:
                c.start_weight_update(timeout=self.timeout_s)
                started.append(c)
        except BaseException as e:  # no server is left inside an open session
            self.left_open = isinstance(e, VLLMConnectionError)
            for s in started:
                try:
                    s.finish_weight_update(timeout=self.timeout_s)
                except RendezvousError:
                    self.left_open = True
            raise

    def update(self, payload: dict[str, Any], timeout_s: float) -> list[Future[float]]:
        """``/update_weights`` on every server, each in flight in the background
        (the workers receive inside the call, while the trainer broadcasts).
        Each future's result is the call's own time, measured inside its
        thread (as vLLM's torch engine is timed), so the handoffs between
        threads are not counted in it."""
        return [in_background(_timed, functools.partial(c.update_weights, payload,
                                                        timeout=timeout_s),
                              name="vllm-update") for c in self.clients]

    def finish(self, weight_version: str | None) -> None:
        for c in self.clients:
            c.finish_weight_update(weight_version, timeout=self.timeout_s)


def _timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def best_effort(calls: Iterable[Callable[[], Any]]) -> None:
    """Make each call, whatever the servers answer: cleanup after a first
    failure, which is the one to report."""
    for call in calls:
        with contextlib.suppress(RendezvousError):
            call()
