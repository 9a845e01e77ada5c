"""The metadata group's store without torch: a host that torch's own
``TCPStore`` client joins, and rank 0's in-process access to it.

Why: vLLM's ``nccl_m2n`` workers agree with the trainer over a c10d
``TCPStore`` that trainer rank 0 hosts (``StatelessProcessGroup``); the
workers connect with torch's client (``is_master=False``, a world size,
300 s, no libuv). ``StoreServer`` is that host, speaking the classic
backend's protocol (``store_wire``), and offers rank 0 the same calls as
``StoreClient`` (``store.KeyValueStore``) on the same keys, in process.

The server outlives its peers' mistakes: one selector thread and
non-blocking sockets (no thread per peer); every size bounded before its
bytes arrive (a key, a value, a request, the store's total, the answer a
peer does not read); a connection that does not validate in time, stalls
inside a request or an answer, or breaks the protocol is closed, alone;
past ``max_connections`` a new connection is closed at once (torch's
client retries until its own timeout). Where torch's server closes a
connection (a ``GET`` of a missing key, an ``ADD`` to a value that is no
number) this one does too, so a torch client sees the same thing.
``close()`` stops accepting, closes every connection, wakes every wait and
ends the thread within a bound.
"""

from __future__ import annotations

import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from nccl_cffi.waiting import Deadline

from ..errors import StoreError, StoreTimeout
from .wire import (
    DEFAULT_IO_TIMEOUT,
    JOIN_KEY,
    MAGIC,
    U32,
    CheckAnswer,
    Query,
    Request,
    WaitAnswer,
    WireError,
    WireLimits,
    blob,
    checked_delta,
    checked_value,
    i64,
    parse_request,
    wire_key,
)

__all__ = ["StoreLimits", "StoreServer"]

CLOSE_TIMEOUT = 5.0
_TICK = 0.1  # how often the server's thread looks for stalled connections
_RECV_BYTES = 2**16
_INT64 = re.compile(rb"-?[0-9]{1,19}")


@dataclass(frozen=True, kw_only=True)
class StoreLimits(WireLimits):
    """What the server holds and how long it waits for a peer.

    Args:
        max_connections: open connections at once; more are closed at once.
        max_keys: keys stored at once.
        max_total_bytes: bytes of all keys and values stored at once.
        max_output_bytes: answers one connection may leave unread.
        handshake_timeout: seconds a new connection has to send
            ``VALIDATE``.
        stall_timeout: seconds a connection may sit inside a request, or
            leave an answer unread, without progress.
    """

    max_connections: int = 512
    max_keys: int = 65536
    max_total_bytes: int = 256 * 2**20
    max_output_bytes: int = 64 * 2**20
    handshake_timeout: float = 30.0
    stall_timeout: float = 30.0


class _Refused(Exception):
    """What the table cannot do; the server closes the connection that asked."""


class _Conn:
    """One peer's connection: its buffers and what it waits for."""

    __slots__ = ("sock", "inbuf", "outbuf", "validated", "awaiting", "opened", "progress", "closed")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.validated = False
        self.awaiting = 0  # keys its pending WAIT still needs
        self.opened = self.progress = now
        self.closed = False


class _Table:
    """The keys and values within their budget, and which connection waits
    for which key (``waitingSockets_`` and ``keysAwaited_`` in torch)."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.data: dict[bytes, bytes] = {}
        self.used = 0
        self.waiting: dict[bytes, list[_Conn]] = {}

    def put(self, key: bytes, value: bytes) -> list[_Conn]:
        """Store ``value``; the connections whose wait it ends."""
        old = self.data.get(key)
        used = self.used + len(value) + (len(key) if old is None else -len(old))
        if used > self.limits.max_total_bytes:
            raise _Refused(f"the store is full ({self.limits.max_total_bytes} bytes)")
        if old is None and len(self.data) >= self.limits.max_keys:
            raise _Refused(f"the store holds its most keys ({self.limits.max_keys})")
        self.data[key] = value
        self.used = used
        woken = []
        for conn in self.waiting.pop(key, ()):
            conn.awaiting -= 1
            if conn.awaiting == 0:
                woken.append(conn)
        return woken

    def add(self, key: bytes, delta: int) -> tuple[int, list[_Conn]]:
        old = self.data.get(key, b"0")
        if not _INT64.fullmatch(old):
            raise _Refused("ADD to a value that is not an integer")
        total = int(old) + delta
        if not -(2**63) <= total < 2**63:
            raise _Refused("ADD past int64")
        return total, self.put(key, str(total).encode())

    def delete(self, key: bytes) -> bool:
        value = self.data.pop(key, None)
        if value is not None:
            self.used -= len(key) + len(value)
        return value is not None

    def await_keys(self, conn: _Conn, keys: Sequence[bytes]) -> bool:
        """Whether every key is there; if not, ``conn`` waits for the rest."""
        missing = [key for key in dict.fromkeys(keys) if key not in self.data]
        for key in missing:
            self.waiting.setdefault(key, []).append(conn)
        conn.awaiting = len(missing)
        return not missing

    def forget(self, conn: _Conn) -> None:
        """``conn`` waits for nothing any more."""
        if conn.awaiting:
            for key in [k for k, conns in self.waiting.items() if conn in conns]:
                self.waiting[key].remove(conn)
                if not self.waiting[key]:
                    del self.waiting[key]
        conn.awaiting = 0


class StoreServer:
    """A c10d ``TCPStore`` host that torch's own client joins, and rank 0's
    in-process access to it (``store.KeyValueStore``'s calls, no socket).

    Args:
        host: the address to listen on (never all interfaces unless given
            ``"0.0.0.0"`` or ``"::"``); the workers connect to it.
        port: the port; 0 picks a free one (see ``port``).
        limits: sizes and timeouts; ``StoreLimits()`` by default.

    Raises:
        StoreError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int = 0, *, limits: StoreLimits | None = None) -> None:
        if not isinstance(host, str) or not host:
            raise ValueError("StoreServer needs the host address to listen on")
        self.limits = limits or StoreLimits()
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise StoreError(f"cannot listen on {host}:{port} for the metadata store: {e}; "
                             "pick another port or an address of this host") from None
        self.host = host
        self._port = self._listener.getsockname()[1]
        self._listener.setblocking(False)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._table = _Table(self.limits)
        self._conns: set[_Conn] = set()
        self._dirty: set[_Conn] = set()
        self._stopping = False
        self._stopped = False
        self._paused_until = 0.0
        self._waker, self._wake_end = socket.socketpair()
        self._waker.setblocking(False)
        self._wake_end.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_end, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="uniqueid-store", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one picked for ``port=0``)."""
        return self._port

    def connections(self) -> int:
        """Open connections now (for tests and diagnostics).

        Returns:
            Their number.
        """
        with self._lock:
            return len(self._conns)

    # ---- in-process access (rank 0) ----

    def set(self, key: str, value: bytes, deadline: Deadline | None = None) -> None:
        """Store ``value`` at ``key`` (torch's ``set``) and wake its waiters.

        Args:
            key: the key, as torch's caller names it (without the prefix).
            value: the bytes.
            deadline: bounds taking the store's lock; 30 s by default.

        Raises:
            StoreError: the store is closed or full.
            StoreTimeout: the lock was not had within the deadline.
            TypeError, ValueError: a key or value of a wrong type or size.
        """
        raw, value = wire_key(key, self.limits), checked_value(value, self.limits)
        with self._locked(deadline):
            self._wake_waiters(self._table.put(raw, value))

    def get(self, key: str, deadline: Deadline) -> bytes:
        """The value at ``key``, waiting for it to be set (torch's ``get``).

        Args:
            key: the key.
            deadline: the whole wait's.

        Returns:
            The value.

        Raises:
            StoreTimeout: the key was not set within the deadline.
            StoreError: the store closed.
        """
        raw = wire_key(key, self.limits)
        with self._locked(deadline):
            while raw not in self._table.data:
                left = deadline.left()
                if left == 0:
                    raise StoreTimeout(f"store key {key!r} was not set within the deadline")
                self._changed.wait(0.25 if left is None else min(left, 0.25))
                self._check_open()
            return self._table.data[raw]

    def add(self, key: str, delta: int, deadline: Deadline | None = None) -> int:
        """Add ``delta`` to the integer at ``key`` (0 if unset; torch's ``add``).

        Args:
            key: the key.
            delta: what to add.
            deadline: bounds taking the lock.

        Returns:
            The new value.

        Raises:
            StoreError: the value is not an integer, or the store is closed.
        """
        return self._add(wire_key(key, self.limits), delta, deadline)

    def delete(self, key: str, deadline: Deadline | None = None) -> bool:
        """Delete ``key`` (torch's ``delete_key``).

        Args:
            key: the key.
            deadline: bounds taking the lock.

        Returns:
            Whether it was there.
        """
        raw = wire_key(key, self.limits)
        with self._locked(deadline):
            return self._table.delete(raw)

    def check(self, keys: Sequence[str], deadline: Deadline | None = None) -> bool:
        """Whether every key is set, without waiting (torch's ``check``).

        Args:
            keys: the keys.
            deadline: bounds taking the lock.

        Returns:
            True when all are set.
        """
        raws = [wire_key(k, self.limits) for k in keys]
        with self._locked(deadline):
            return all(raw in self._table.data for raw in raws)

    def joined(self, deadline: Deadline | None = None) -> int:
        """How many ranks joined: torch's ``init/`` count, which each torch
        client given a world size (and each ``StoreClient`` given one, and
        ``join()`` here) adds 1 to.

        Args:
            deadline: bounds taking the lock.

        Returns:
            The count.
        """
        return self._add(JOIN_KEY, 0, deadline)

    def join(self, deadline: Deadline | None = None) -> int:
        """Count this process as a rank that joined (``init/`` += 1).

        Args:
            deadline: bounds taking the lock.

        Returns:
            The count after it.
        """
        return self._add(JOIN_KEY, 1, deadline)

    def close(self) -> None:
        """Stop accepting, close every connection, wake every wait, end the
        thread (within ``CLOSE_TIMEOUT``). Idempotent."""
        with self._lock:
            self._stopping = True
            self._changed.notify_all()
        self._wake()
        self._thread.join(CLOSE_TIMEOUT)
        if self._thread.is_alive():  # never seen: the thread only does non-blocking I/O
            self._listener.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, raw: bytes, delta: int, deadline: Deadline | None) -> int:
        delta = checked_delta(delta)
        with self._locked(deadline):
            total, woken = self._table.add(raw, delta)
            self._wake_waiters(woken)
            return total

    @contextmanager
    def _locked(self, deadline: Deadline | None) -> Iterator[None]:
        wait = (deadline or Deadline(DEFAULT_IO_TIMEOUT)).left()
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise StoreTimeout("the metadata store stayed busy past the deadline")
        try:
            self._check_open()
            yield
        except _Refused as e:
            raise StoreError(f"the metadata store refused the call: {e}") from None
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._stopping or self._stopped:
            raise StoreError("the metadata store is closed")

    def _wake_waiters(self, woken: list[_Conn]) -> None:
        """After a change: answer the connections whose wait it ended, wake
        local waiters, and the thread if the change came from another."""
        for conn in woken:
            self._send(conn, bytes([WaitAnswer.STOP_WAITING]))
        self._changed.notify_all()
        if self._dirty and threading.current_thread() is not self._thread:
            self._wake()

    def _wake(self) -> None:
        try:
            self._waker.send(b"\0")
        except OSError:  # full (the thread will look anyway) or closed
            pass

    # ---- the selector thread ----

    def _run(self) -> None:
        try:
            while True:
                events = self._selector.select(_TICK)
                with self._lock:
                    if self._stopping:
                        return
                    for key, mask in events:
                        self._on_event(key.data, mask)
                    self._flush()
                    self._reap(time.monotonic())
        finally:
            self._shutdown()

    def _on_event(self, what: object, mask: int) -> None:
        if what == "listen":
            self._accept()
        elif what == "wake":
            try:
                self._wake_end.recv(4096)
            except OSError:
                pass
        elif isinstance(what, _Conn) and not what.closed:
            try:
                if mask & selectors.EVENT_READ:
                    self._read(what)
                if mask & selectors.EVENT_WRITE and not what.closed:
                    self._write(what)
            except Exception:  # noqa: BLE001 - whatever one peer caused ends its connection only
                self._drop(what)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of file descriptors: stop accepting for a moment
                self._selector.unregister(self._listener)
                self._paused_until = time.monotonic() + 0.1
                return
            if len(self._conns) >= self.limits.max_connections:
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, time.monotonic())
            self._conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.inbuf += data
        conn.progress = time.monotonic()
        try:
            while not conn.closed:
                parsed = parse_request(conn.inbuf, self.limits)
                if parsed is None:
                    return
                request, used = parsed
                del conn.inbuf[:used]
                self._answer(conn, request)
        except (WireError, _Refused):
            self._drop(conn)

    def _answer(self, conn: _Conn, request: Request) -> None:
        if not conn.validated:
            if request.query != Query.VALIDATE or request.number != MAGIC:
                raise WireError("a connection that does not open with torch's VALIDATE")
            conn.validated = True
            return
        handler = self._handlers.get(request.query)
        if handler is None:
            raise WireError(f"query {request.query.name} after the handshake")
        reply = handler(self, conn, request)
        if reply:
            self._send(conn, reply)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        if not conn.outbuf:
            conn.progress = time.monotonic()
        conn.outbuf += data
        if len(conn.outbuf) > self.limits.max_output_bytes:
            self._drop(conn)  # a peer that does not read its answers
        else:
            self._dirty.add(conn)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for conn in dirty:
            if not conn.closed:
                self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf) if conn.outbuf else 0
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn)
            return
        if sent:
            del conn.outbuf[:sent]
            conn.progress = time.monotonic()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._selector.modify(conn.sock, events, conn)

    def _reap(self, now: float) -> None:
        limits = self.limits
        for conn in list(self._conns):
            if not conn.validated and now - conn.opened > limits.handshake_timeout:
                self._drop(conn)
            elif (conn.inbuf or conn.outbuf) and now - conn.progress > limits.stall_timeout:
                self._drop(conn)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._table.forget(conn)
        self._conns.discard(conn)
        self._dirty.discard(conn)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            for conn in list(self._conns):
                self._drop(conn)
            self._changed.notify_all()
        self._selector.close()
        for sock in (self._listener, self._waker, self._wake_end):
            sock.close()

    # ---- the queries, as the classic backend answers them ----

    def _on_ping(self, conn: _Conn, request: Request) -> bytes:
        return U32.pack(request.number)

    def _on_set(self, conn: _Conn, request: Request) -> None:
        self._wake_waiters(self._table.put(request.keys[0], request.values[0]))

    def _on_compare_set(self, conn: _Conn, request: Request) -> bytes:
        key, (expected, desired) = request.keys[0], request.values
        current = self._table.data.get(key)
        if current is None and expected:
            return blob(expected)  # torch answers the expected value for a missing key
        if current is None or current == expected:
            # Torch's classic server wakes no waiter here; waking them is
            # what a key that now exists calls for.
            self._wake_waiters(self._table.put(key, desired))
            return blob(desired)
        return blob(current)

    def _on_get(self, conn: _Conn, request: Request) -> bytes:
        value = self._table.data.get(request.keys[0])
        if value is None:
            raise _Refused("GET of a missing key")  # torch's server drops the connection too
        return blob(value)

    def _on_add(self, conn: _Conn, request: Request) -> bytes:
        total, woken = self._table.add(request.keys[0], request.number)
        self._wake_waiters(woken)
        return i64(total)

    def _on_check(self, conn: _Conn, request: Request) -> bytes:
        ready = all(key in self._table.data for key in request.keys)
        return bytes([CheckAnswer.READY if ready else CheckAnswer.NOT_READY])

    def _on_wait(self, conn: _Conn, request: Request) -> bytes | None:
        if conn.awaiting:
            raise WireError("a WAIT while another is pending")
        if self._table.await_keys(conn, request.keys):
            return bytes([WaitAnswer.STOP_WAITING])
        return None

    def _on_num_keys(self, conn: _Conn, request: Request) -> bytes:
        return i64(len(self._table.data))

    def _on_delete(self, conn: _Conn, request: Request) -> bytes:
        return i64(int(self._table.delete(request.keys[0])))

    def _on_append(self, conn: _Conn, request: Request) -> None:
        key = request.keys[0]
        value = self._table.data.get(key, b"") + request.values[0]
        if len(value) > self.limits.max_value_bytes:
            raise _Refused("APPEND past the largest value")
        self._wake_waiters(self._table.put(key, value))

    def _on_multi_get(self, conn: _Conn, request: Request) -> bytes:
        return b"".join(self._on_get(conn, Request(query=Query.GET, keys=(key,))) for key in request.keys)

    def _on_multi_set(self, conn: _Conn, request: Request) -> None:
        for key, value in zip(request.keys, request.values):
            self._wake_waiters(self._table.put(key, value))

    def _on_cancel_wait(self, conn: _Conn, request: Request) -> bytes:
        self._table.forget(conn)
        return bytes([WaitAnswer.WAIT_CANCELED])

    # Which method answers each query: fixed for the class, so read-only.
    _handlers: ClassVar[Mapping[Query, Callable[[StoreServer, _Conn, Request], bytes | None]]] = (
        MappingProxyType({
            Query.PING: _on_ping,
            Query.SET: _on_set,
            Query.COMPARE_SET: _on_compare_set,
            Query.GET: _on_get,
            Query.ADD: _on_add,
            Query.CHECK: _on_check,
            Query.WAIT: _on_wait,
            Query.GETNUMKEYS: _on_num_keys,
            Query.DELETE_KEY: _on_delete,
            Query.APPEND: _on_append,
            Query.MULTI_GET: _on_multi_get,
            Query.MULTI_SET: _on_multi_set,
            Query.CANCEL_WAIT: _on_cancel_wait,
        }))
