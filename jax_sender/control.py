"""The servers' side of one push: vLLM's weight-update routes, in order.

A push may go to several servers (one broadcast feeds them all). Each
route is posted to every server; when one of them refuses, the others must
not be left inside an open update session: a session that started on A is
finished there before the error propagates (or, if that fails too, A's
engine is shut down), and a pause is undone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from uniqueid import VLLMClient, VLLMConnectionError, VLLMHTTPError, in_background


class ControlPlane:
    """The update routes of ``clients`` (none on trainer processes that only broadcast)."""

    def __init__(self, clients: Sequence[VLLMClient]):
        self.clients = list(clients)

    def pause(self, mode: str) -> None:
        done: list[VLLMClient] = []
        try:
            for c in self.clients:
                c.pause(mode)
                done.append(c)
        except BaseException:
            _best_effort(c.resume for c in done)
            raise

    def resume(self) -> None:
        errors = []
        for c in self.clients:
            try:
                c.resume()
            except (VLLMHTTPError, VLLMConnectionError) as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def start(self) -> None:
        started: list[VLLMClient] = []
        try:
            for c in self.clients:
                c.start_weight_update()
                started.append(c)
        except BaseException:
            for c in started:  # no server is left inside an open session
                try:
                    c.finish_weight_update()
                except (VLLMHTTPError, VLLMConnectionError):
                    _best_effort([c.shutdown_weight_transfer_engine])
            raise

    def update(self, payload: dict[str, Any], read_timeout: float) -> list[Future[float]]:
        """``/update_weights`` on every server, each in flight in the background
        (the workers receive inside the call, while the trainer broadcasts).
        Each future's result is the call's own time, measured inside its
        thread (as vLLM's torch engine is timed), so the handoffs between
        threads are not counted in it."""
        return [in_background(_timed, c.update_weights, payload, read_timeout,
                              name="vllm-update") for c in self.clients]

    def finish(self, weight_version: str | None) -> None:
        for c in self.clients:
            c.finish_weight_update(weight_version)


def _timed(call: Callable[..., Any], *args: Any) -> float:
    t = time.perf_counter()
    call(*args)
    return time.perf_counter() - t


def _best_effort(calls) -> None:
    for call in calls:
        with contextlib.suppress(VLLMHTTPError, VLLMConnectionError):
            call()
