"""One route on many servers at once, within one deadline.

Why: a trainer feeds 8 to 256 servers, and a push makes each of vLLM's
routes on all of them; one after another, a phase costs a round trip per
server. Here a phase is one handoff to the HTTP loop (``transport.py``),
which makes every server's call at once, each bounded by the phase's
deadline; the caller waits on one future, however many servers there are,
and sees the first failure as soon as it happens (``raise_first``, which
looks at one attribute, not at every call).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from nccl_cffi.waiting import Check, Deadline, await_future, no_check

from ..errors import RendezvousTimeout
from . import transport
from .client import VLLMClient, VLLMConnectionError

T = TypeVar("T")

# How long past its deadline a phase is waited for before it is given up:
# every call ends by the deadline on the loop; this only covers the handoffs.
GRACE_S = 1.0
# How long a phase given up waits for the HTTP loop to run a no-op, to say
# in its error whether the loop itself was blocked.
PROBE_S = 0.5


def loop_lag(wait_s: float = PROBE_S) -> float | None:
    """Seconds the HTTP loop took to run a no-op handed to it now, or None
    if it did not within ``wait_s``.

    Why: a phase outlives its grace only if the loop did not end its calls
    at their own deadlines (each call's timer runs on the loop). The error
    says whether the loop is blocked now, or ran again once the stall
    (a whole-process pause, say) was over.
    """
    ran = threading.Event()
    t = time.monotonic()
    transport.loop().call_soon_threadsafe(ran.set)
    return time.monotonic() - t if ran.wait(wait_s) else None



class Calls(Generic[T]):
    """One call per server, all in flight at once on the HTTP loop.

    Args:
        clients: the servers.
        call: ``call(i, timeout)`` makes server ``i``'s call (a coroutine),
            ``timeout`` being what is left of ``deadline`` when it starts
            (None: none, the route's own default applies).
        deadline: bounds every call.

    Attributes:
        results: each call's result (None until it succeeded).
        errors: each call's failure (None unless it failed).
        times: each call's own duration, measured on the loop.
        done: whether each call ended.
        first: the first failure, in time; None while none failed.
        ended: resolved once every call ended.
        settled: resolved once every call succeeded, or one failed.
    """

    def __init__(self, clients: Sequence[VLLMClient],
                 call: Callable[[int, float | None], Awaitable[T]], *, deadline: Deadline):
        self.clients = list(clients)
        self.deadline = deadline
        n = len(self.clients)
        self.results: list[T | None] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self.times = [0.0] * n
        self.done = [False] * n
        self.first: BaseException | None = None
        self.ended: Future[None] = Future()
        self.settled: Future[None] = Future()
        self._left = n
        self._tasks: list[asyncio.Task[None]] = []
        self._made = time.monotonic()
        self._started: float | None = None  # when the loop started the calls
        if n:
            transport.loop().call_soon_threadsafe(self._start, call)
        else:
            self.ended.set_result(None)
            self.settled.set_result(None)

    # On the loop.
    def _start(self, call: Callable[[int, float | None], Awaitable[T]]) -> None:
        self._started = time.monotonic()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._one(i, call)) for i in range(len(self.clients))]

    async def _one(self, i: int, call: Callable[[int, float | None], Awaitable[T]]) -> None:
        t = time.perf_counter()
        try:
            left = self.deadline.left()
            if left is not None and left <= 0:
                raise RendezvousTimeout(f"{self.clients[i].base_url}: the deadline passed "
                                        "before the call was made")
            self.results[i] = await call(i, left)
        except BaseException as e:  # the waiter's to raise (cancelled: given up by it)
            self.errors[i] = e
            if self.first is None:
                self.first = e
                self.settled.set_result(None)
        self.times[i] = time.perf_counter() - t
        self.done[i] = True
        self._left -= 1
        if not self._left:
            # Dropped here: a task freed on the caller's thread costs it a
            # call per server (asyncio's registry of tasks is a WeakSet).
            self._tasks = []
            if not self.settled.done():
                self.settled.set_result(None)
            self.ended.set_result(None)

    # On the caller's thread.
    def raise_first(self) -> None:
        """Raise the first failure, if any: a check to poll while waiting.

        Raises:
            BaseException: the first call that failed, its error.
        """
        if self.first is not None:
            raise self.first

    def wait(self, check: Check = no_check) -> None:
        """Wait until every call ended (each bounded by the deadline); an
        interrupt or what ``check`` raises gives up those still in flight.

        Args:
            check: polled while waiting.

        Raises:
            RendezvousTimeout: calls still in flight past the deadline
                (given up; they are named).
            BaseException: what ``check`` raised.
        """
        at = None if self.deadline.at is None else self.deadline.at + GRACE_S
        try:
            ended = await_future(self.ended, at, check)
        except BaseException:
            self.cancel()
            raise
        if not ended:
            self.cancel()
            raise RendezvousTimeout(f"{self.named(self.pending())}: no answer by the deadline "
                                    f"({self._stalled()})")

    def _stalled(self) -> str:
        """What a phase given up past its grace says about the HTTP loop:
        how long it waited, when the loop started its calls, and whether
        the loop runs now (a call that outlived its own deadline means the
        loop, or the whole process, did not run for a while)."""
        waited = time.monotonic() - self._made
        started = ("its calls never started on the HTTP loop" if self._started is None
                   else f"its calls started {self._started - self._made:.3f} s after it")
        lag = loop_lag()
        now = (f"the loop is blocked (a no-op did not run within {PROBE_S:g} s)" if lag is None
               else f"the loop runs now (a no-op ran in {lag * 1e3:.0f} ms)")
        return f"given up after {waited:.1f} s; {started}; {now}"

    def outcome(self) -> list[T]:
        """Every result, in order, once every call ended.

        Raises:
            BaseException: the first failure.
        """
        self.raise_first()
        return self.results  # type: ignore[return-value]

    def cancel(self) -> None:
        """Give up the calls still in flight (their connections are closed;
        what a server already took stays taken)."""
        def stop() -> None:
            for task in self._tasks:
                task.cancel()
        if self._left:
            transport.loop().call_soon_threadsafe(stop)

    def succeeded(self) -> list[VLLMClient]:
        """The servers whose call was answered with success."""
        return [c for c, e, d in zip(self.clients, self.errors, self.done) if d and e is None]

    def pending(self) -> list[VLLMClient]:
        """The servers whose call has not ended."""
        return [c for c, d in zip(self.clients, self.done) if not d]

    def unanswered(self) -> list[VLLMClient]:
        """The servers whose call was made but not answered (a connection
        that failed or timed out, a call given up, or still in flight): what
        it asked may still happen there."""
        return [c for c, e, d in zip(self.clients, self.errors, self.done)
                if not d or isinstance(e, (VLLMConnectionError, asyncio.CancelledError))]

    @staticmethod
    def named(clients: Sequence[VLLMClient], route: str = "") -> str:
        """The servers' URLs (each followed by ``route``), for a message: the
        first four, and how many more."""
        urls = [c.base_url + route for c in clients]
        return ", ".join(urls[:4]) + (f" and {len(urls) - 4} more" if len(urls) > 4 else "")


def on_each(clients: Sequence[VLLMClient], route: Callable[..., Any], *args: Any,
            deadline: Deadline, timeout: float | None = None, **kwargs: Any) -> Calls[Any]:
    """``route`` (a ``VLLMClient`` route, e.g. ``VLLMClient.start_weight_update``)
    with the same arguments on every server, all at once.

    Args:
        clients: the servers.
        route: the route.
        *args, **kwargs: its arguments.
        deadline: bounds every call.
        timeout: each call's own deadline in seconds (the phase's, as its
            errors will say); None: what is left of ``deadline`` as it starts.

    Returns:
        The calls, in flight.
    """
    coroutine = route.coroutine  # type: ignore[attr-defined]
    return Calls(clients, lambda i, left: coroutine(
        clients[i], *args, timeout=left if timeout is None else timeout, **kwargs),
        deadline=deadline)


def call_all(clients: Sequence[VLLMClient], route: Callable[..., Any], *args: Any,
             deadline: Deadline, **kwargs: Any) -> list[Any]:
    """``on_each``, waited for: every server's answer, in order.

    Args:
        clients, route, args, kwargs, deadline: as ``on_each``.

    Returns:
        Each server's result.

    Raises:
        RendezvousError: the first failure, once every call ended (or the
            deadline passed).
    """
    calls = on_each(clients, route, *args, deadline=deadline, **kwargs)
    calls.wait()
    return calls.outcome()


__all__ = ["Calls", "call_all", "on_each"]
