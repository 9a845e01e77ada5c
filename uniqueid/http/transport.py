"""HTTP/1.1 to vLLM servers: one event loop for every call of the process.

Why one loop: a push to a fleet of servers has every ``/update_weights``
in flight at once, for as long as the broadcasts run (the workers receive
inside the call), and every other route is worth making on all servers at
once too. A thread per call in flight is a thread per server per call;
here every call of every client runs on one asyncio loop, on one kept
daemon thread (``vllm-http``), started on the first call. A blocking call
hands its coroutine to the loop and waits (``run``); many calls at once
(``fleet.Calls``) cost one handoff.

A connection is an ``asyncio.Protocol`` over h11, httpcore's own HTTP/1.1
state machine, so framing (lengths, chunks, the end of a body) is h11's,
and nothing here is read unbounded: the body counts against a limit as it
arrives, and reading pauses until the call has taken what came. Kept
connections are reused while the server keeps them (one it closed, or
idle past ``KEEP_ALIVE_S``, is dialled again); an https connection's TLS
context is its client's (``settings.tls_context``: one per CA source).

What a call may end in, besides an answer: ``Expired`` (its deadline, see
``within``), ``PeerClosed``, ``Malformed``, ``TooBig``, or an ``OSError``
from the socket (``Untrusted``: an https certificate that did not verify);
``client.py`` turns each into the error it reports.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import h11

T = TypeVar("T")

# Kept connections idle longer than this are dialled again (uvicorn, under
# vLLM, closes them after 5 s of idling).
KEEP_ALIVE_S = 5.0
MAX_IDLE = 4  # kept connections per server
READ_BYTES = 1 << 16


class Expired(Exception):
    """The call's deadline passed."""


class PeerClosed(Exception):
    """The server closed the connection before its answer was complete."""


class Malformed(Exception):
    """The server answered something that is not valid HTTP/1.1."""


class Untrusted(ConnectionError):
    """An https server's certificate did not verify (an ``OSError``, as the
    socket's other failures: its message says what to give)."""


class TooBig(Exception):
    """The answer's body is over the call's limit (``status``: its status)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


# -- the loop ------------------------------------------------------------------

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


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
    """A forked child has no loop thread: it starts its own on its first call."""
    global _loop, _thread, _lock
    _loop, _thread, _lock = None, None, threading.Lock()


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


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    """``awaitable``, given up once ``seconds`` have passed.

    Why not ``asyncio.wait_for``: it runs the awaitable as a task of its
    own, one more per call; this cancels the caller's own task instead.

    Raises:
        Expired: the seconds passed (the awaitable was cancelled).
    """
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not expired:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancel was ours, not the caller's
            task.uncancel()
        raise Expired() from None
    finally:
        timer.cancel()


# -- a connection ----------------------------------------------------------------

class Connection(asyncio.Protocol):
    """One kept connection to a server, one exchange at a time."""

    def __init__(self) -> None:
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.closed = False  # either side closed it, or it cannot be reused
        self.peer_closed = False
        self.idle_since = time.monotonic()
        self._arrived: asyncio.Future[None] | None = None  # woken by data or EOF
        self._unread = 0  # bytes given to h11 that the exchange has not asked for yet
        self._paused = False

    # The loop's calls.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._arrived is None:  # nothing was asked: a server that talks out of turn
            self.close()
            return
        try:
            self.h11.receive_data(data)
        except RuntimeError:  # after an error h11 takes nothing more; the exchange reports it
            return
        self._unread += len(data)
        if self._unread > READ_BYTES and not self._paused:  # until the exchange took it
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.peer_closed = True
        self.h11.receive_data(b"")
        self._wake()
        self.closed = True
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.peer_closed:
            self.peer_closed = True
            try:
                self.h11.receive_data(b"")
            except RuntimeError:  # h11 refuses data after an error: nothing is waited for
                pass
        self._wake()

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    def close(self) -> None:
        """Close it now (a call that did not end cleanly leaves it unusable)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def recycle(self) -> bool:
        """Make it ready for the next exchange, if both sides are done and the
        server keeps the connection; whether it is."""
        if self.closed or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        return True

    # The exchange.
    async def exchange(self, request: h11.Request, body: bytes | None,
                       max_body: int) -> tuple[int, list[tuple[bytes, bytes]], bytearray]:
        """Send ``request`` (and ``body``), read the answer.

        Returns:
            The status, the headers and the raw body (at most ``max_body`` bytes).

        Raises:
            PeerClosed, Malformed, TooBig: see the module docstring.
        """
        self._arrived = asyncio.get_running_loop().create_future()
        try:
            head = self.h11.send(request)
            data = self.h11.send(h11.Data(data=body)) if body else b""
            end = self.h11.send(h11.EndOfMessage())
            if len(data) > READ_BYTES:  # a large body goes as it is, not copied into one
                for part in (head, data, end):
                    self.transport.write(part)
            else:
                self.transport.write(head + data + end)  # one write: one syscall
            response = await self._next(h11.Response)
            raw = bytearray()
            while not isinstance(event := await self._next((h11.Data, h11.EndOfMessage)),
                                 h11.EndOfMessage):
                raw += event.data
                if len(raw) > max_body:
                    raise TooBig(response.status_code)
            return response.status_code, list(response.headers), raw  # not copied: up to max_body
        except h11.ProtocolError as e:
            raise (PeerClosed() if self.peer_closed else Malformed(str(e))) from None
        finally:
            self._arrived = None
            self.idle_since = time.monotonic()

    async def _next(self, kinds: Any) -> Any:
        """The next event of one of ``kinds`` (an interim answer skipped)."""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if self.peer_closed:
                    raise PeerClosed()
                self._arrived = asyncio.get_running_loop().create_future()
                self._unread = 0
                if self._paused:
                    self._paused = False
                    self.transport.resume_reading()
                await self._arrived
            elif isinstance(event, kinds):
                return event
            elif isinstance(event, h11.ConnectionClosed):
                raise PeerClosed()
            elif not isinstance(event, h11.InformationalResponse):
                raise Malformed(f"unexpected {type(event).__name__}")


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
        self._pid = os.getpid()

    async def exchange(self, request: h11.Request, body: bytes | None, *, connect_timeout: float,
                       max_body: int) -> tuple[int, list[tuple[bytes, bytes]], bytearray]:
        """One exchange on a kept connection, or a new one.

        Raises:
            Expired: the connection was not made within ``connect_timeout``.
            OSError: it could not be made, or failed while sending.
            PeerClosed, Malformed, TooBig: see ``Connection.exchange``.
        """
        conn = self._kept() or await self._dial(connect_timeout)
        status = 0
        try:
            status, headers, raw = await conn.exchange(request, body, max_body)
        finally:
            self._done(conn, status)
        return status, headers, raw

    def _kept(self) -> Connection | None:
        if self._pid != os.getpid():  # a forked child: the parent's connections are not its own
            self.idle, self._pid = [], os.getpid()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and time.monotonic() - conn.idle_since < KEEP_ALIVE_S:
                return conn
            conn.close()
        return None

    async def _dial(self, seconds: float) -> Connection:
        try:
            _, conn = await within(seconds, asyncio.get_running_loop().create_connection(
                Connection, self.host, self.port, ssl=self.tls,
                server_hostname=self.host if self.tls else None))
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
