"""HTTP/1.1 to vLLM servers: one event loop for every call of the process.

Why one loop: a push to a fleet of servers has every ``/update_weights``
in flight at once, for as long as the broadcasts run (the workers receive
inside the call), and every other route is worth making on all servers at
once too. A thread per call in flight is a thread per server per call;
here every call of every client runs on one asyncio loop, on one kept
daemon thread (``vllm-http``), started on the first call. A blocking call
hands its coroutine to the loop and waits (``run``); many calls at once
(``fleet.Calls``) cost one handoff.

A connection is an ``asyncio.Protocol`` that reads each answer as it
arrives (``answer.py``: the status line, the fields, where the body ends),
and nothing is read unbounded: the body counts against the call's limit
as it arrives. Kept connections are reused while the server keeps them
(one it closed, or idle past ``KEEP_ALIVE_S``, is dialled again); an
https connection's TLS context is its client's (``settings.tls_context``:
one per CA source).

What a call may end in, besides an answer: ``Expired`` (its deadline, see
``within``), ``PeerClosed``, ``Malformed``, ``TooBig``, or an ``OSError``
from the socket (``Untrusted``: an https certificate that did not verify);
``client.py`` turns each into the error it reports.
"""

from __future__ import annotations

import asyncio
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from .answer import Answer, Malformed, TooBig

T = TypeVar("T")

# Kept connections idle longer than this are dialled again (uvicorn, under
# vLLM, closes them after 5 s of idling).
KEEP_ALIVE_S = 5.0
MAX_IDLE = 4  # kept connections per server
WRITE_COPIED = 1 << 16  # a body up to this size goes out in one write with its head


class Expired(Exception):
    """The call's deadline passed."""


class PeerClosed(Exception):
    """The server closed the connection before its answer was complete."""


class Untrusted(ConnectionError):
    """An https server's certificate did not verify (an ``OSError``, as the
    socket's other failures: its message says what to give)."""


# -- the loop ------------------------------------------------------------------

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_forks = 0  # how many forks this process is down from the one that made its pools
_expiries: dict[float, _Expiry] = {}  # the calls' deadlines by instant (see within); the loop's only


def loop() -> asyncio.AbstractEventLoop:
    """The process's HTTP loop, running on its kept thread (started here the first time).

    Returns:
        The loop.
    """
    global _loop, _thread
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="vllm-http", daemon=True)
            _thread.start()
        return _loop


def _after_fork_in_child() -> None:
    """A forked child has no loop thread: it starts its own on its first call,
    and no connection of its parent's is its own (see ``Pool``)."""
    global _loop, _thread, _lock, _forks
    _loop, _thread, _lock = None, None, threading.Lock()
    _expiries.clear()
    _forks += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def on_loop() -> bool:
    """Whether the caller runs on the HTTP loop's thread."""
    return _thread is not None and threading.current_thread() is _thread


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the HTTP loop and wait for it. Its own deadline bounds
    it (each call's is set inside, see ``within``); an interrupt while
    waiting (Ctrl-C) cancels it.

    Args:
        coro: the call.

    Returns:
        What ``coro`` returned.

    Raises:
        BaseException: what ``coro`` raised.
        RuntimeError: called from the loop's own thread, or the loop's
            thread is gone.
    """
    if on_loop():
        coro.close()
        raise RuntimeError("a blocking vLLM call was made on the HTTP loop's own thread")
    future = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        while True:
            try:
                future.exception(timeout=0.5)  # raises FutureTimeout only while it runs
                break
            except FutureTimeout:
                if _thread is None or not _thread.is_alive():
                    raise RuntimeError("the HTTP loop's thread is gone") from None
    except BaseException:
        future.cancel()
        raise
    return future.result()


def call(fn: Callable[[], None]) -> None:
    """Call ``fn`` on the HTTP loop and wait for it, 10 s at most (at once
    where no loop was started, or on the loop's own thread: nothing else
    runs there then).

    Args:
        fn: what touches the loop's objects (a pool's connections).
    """
    if _loop is None or on_loop():
        fn()
        return
    done: Future[None] = Future()

    def step() -> None:
        try:
            fn()
        finally:
            done.set_result(None)

    _loop.call_soon_threadsafe(step)
    try:
        done.result(timeout=10.0)
    except FutureTimeout:  # a loop that no longer runs holds nothing worth waiting for
        pass


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Start ``coro`` on the HTTP loop; its future.

    Args:
        coro: the call.

    Returns:
        Its future (cancelling it cancels the call).
    """
    return asyncio.run_coroutine_threadsafe(coro, loop())


# Calls whose deadlines fall within one step of this share one timer: a
# phase starts a call on every server within milliseconds, each with the
# same timeout, and a timer each was a tenth of a fleet's push. A call may
# so end up to this much past its deadline, never before it.
DEADLINE_STEP_S = 0.01


class _Expiry:
    """One instant, its timer, and the calls that expire at it: ``with``
    it, a block of a call's task is given up at the instant (see
    ``within``); a task is counted once for each block it is in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, at: float):
        self.at = at
        self.tasks: dict[asyncio.Task[Any], int] = {}
        self.fired = False
        self.timer = loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self.fired = True
        _expiries.pop(self.at, None)
        for task in self.tasks:
            task.cancel()

    def __enter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks[task] = self.tasks.get(task, 0) + 1

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        task = asyncio.current_task()
        left = self.tasks.pop(task) - 1
        if left:
            self.tasks[task] = left
        elif not self.tasks and not self.fired:
            self.timer.cancel()
            if _expiries.get(self.at) is self:
                del _expiries[self.at]
        if kind is not None and issubclass(kind, asyncio.CancelledError) and self.fired:
            if hasattr(task, "uncancel"):  # Python 3.11+: this cancel was ours, not the caller's
                task.uncancel()
            raise Expired() from None


def within(seconds: float) -> _Expiry:
    """A block of the running task given up once ``seconds`` have passed
    (up to ``DEADLINE_STEP_S`` later, never sooner): ``with within(s):``.

    Why not ``asyncio.wait_for`` (a task more per call) nor
    ``asyncio.timeout`` (a timer per call): this cancels the caller's own
    task, from the one timer of every call that expires in the same step,
    and makes no object per call.

    Raises:
        Expired: on leaving the block, the seconds passed (it was cancelled).
    """
    loop = asyncio.get_running_loop()
    at = math.ceil((loop.time() + seconds) / DEADLINE_STEP_S) * DEADLINE_STEP_S
    expiry = _expiries.get(at)
    if expiry is None:
        expiry = _expiries[at] = _Expiry(loop, at)
    return expiry


# -- a connection ----------------------------------------------------------------

class Connection(asyncio.Protocol):
    """One kept connection to a server, one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False  # either side closed it, or it cannot be reused
        self.idle_since = time.monotonic()
        self._answer: Answer | None = None  # the exchange's, while it reads
        self._arrived: asyncio.Future[Answer] | None = None  # the answer whole, or failed
        self._reusable = False  # the last exchange ended cleanly on a kept connection

    # The loop's calls.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None:  # nothing was asked: a server that talks out of turn
            self.close()
            return
        try:
            if answer.feed(data):
                self._wake(None)
        except (Malformed, TooBig) as e:
            self._answer = None  # nothing more is read: what follows closes it
            self._wake(e)

    def eof_received(self) -> bool:
        self._ended()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        self.closed = True
        answer = self._answer
        if answer is not None and not answer.done:
            self._wake(None if answer.end() else PeerClosed())

    def _wake(self, error: BaseException | None) -> None:
        arrived = self._arrived
        if arrived is not None and not arrived.done():
            if error is None:
                arrived.set_result(self._answer)
            else:
                arrived.set_exception(error)

    def close(self) -> None:
        """Close it now (a call that did not end cleanly leaves it unusable)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def recycle(self) -> bool:
        """Whether it can carry the next exchange: its last answer was
        complete, the server keeps the connection, and sent nothing more."""
        return self._reusable and not self.closed

    # The exchange.
    def send(self, head: bytes, body: bytes | None, max_body: int) -> asyncio.Future[Answer]:
        """Send the request (``head``: its line and fields; ``body``); the
        answer, once read (at most ``max_body`` bytes of body), then ``done``.

        Raises:
            PeerClosed, Malformed, TooBig: see the module docstring (the
            last two, and the first once sent, from the future).
        """
        if self.closed:
            raise PeerClosed()
        self._answer = Answer(max_body)
        self._arrived = asyncio.get_running_loop().create_future()
        self._reusable = False
        if body and len(body) > WRITE_COPIED:  # a large body goes as it is, not copied
            self.transport.write(head)
            self.transport.write(body)
        else:
            self.transport.write(head + body if body else head)  # one write: one syscall
        return self._arrived

    def done(self) -> None:
        """The exchange ended, however: what follows from the server is out of turn."""
        if self._answer is not None and self._answer.done:
            self._reusable = self._answer.keep
        self._answer = self._arrived = None
        self.idle_since = time.monotonic()


# -- one server's connections ------------------------------------------------------

class Pool:
    """The kept connections to one server; touched on the HTTP loop only.

    Args:
        host, port: the server.
        tls: https's context (``settings.tls_context``), or None for http.
    """

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None):
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[Connection] = []
        self.closed = False
        self._forks = _forks

    async def exchange(self, head: bytes, body: bytes | None, *, connect_timeout: float,
                       max_body: int) -> tuple[int, list[tuple[bytes, bytes]], bytearray]:
        """One exchange on a kept connection, or a new one.

        Raises:
            Expired: the connection was not made within ``connect_timeout``.
            OSError: it could not be made, or failed while sending.
            PeerClosed, Malformed, TooBig: see ``Connection.send``.
        """
        conn = self._kept() or await self._dial(connect_timeout)
        status = 0
        try:
            answer = await conn.send(head, body, max_body)
            status = answer.status
        finally:
            conn.done()
            self._done(conn, status)
        return status, answer.headers, answer.body  # not copied: up to max_body

    def _kept(self) -> Connection | None:
        if self._forks != _forks:  # a forked child: the parent's connections are not its own
            self.idle, self._forks = [], _forks
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and time.monotonic() - conn.idle_since < KEEP_ALIVE_S:
                return conn
            conn.close()
        return None

    async def _dial(self, seconds: float) -> Connection:
        try:
            with within(seconds):
                _, conn = await asyncio.get_running_loop().create_connection(
                    Connection, self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls else None)
        except ssl.SSLCertVerificationError as e:
            raise Untrusted(f"the server's TLS certificate did not verify ({e.verify_message}): "
                            "give the client verify= the CA bundle that signed it (or set "
                            "SSL_CERT_FILE), and a URL whose host the certificate names") from None
        return conn

    def _done(self, conn: Connection, status: int) -> None:
        """Keep ``conn`` if it ended cleanly. Not after a 5xx, nor any kept
        before it: a server whose handler raised (uvicorn, under vLLM's
        routes) answers 500 and closes the connection a moment later, and
        the next call on it would meet the reset (seen on vLLM 0.33.0's
        engine after a refused ``/shutdown_weight_transfer_engine``)."""
        if status >= 500:
            conn.close()
            self.close_idle()
        elif status and not self.closed and len(self.idle) < MAX_IDLE and conn.recycle():
            self.idle.append(conn)
        else:
            conn.close()

    def close_idle(self) -> None:
        """Close the kept connections no call is using."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Close the kept connections; those in use close when their call ends."""
        self.closed = True
        self.close_idle()
