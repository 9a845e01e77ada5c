"""The metadata group's store without torch: a host that torch's own
``TCPStore`` client joins, and rank 0's in-process access to it.

Why: vLLM's ``nccl_m2n`` workers agree with the trainer over a c10d
``TCPStore`` that trainer rank 0 hosts (``StatelessProcessGroup``); the
workers connect with torch's client (``is_master=False``, a world size,
300 s, no libuv). ``StoreServer`` is that host, speaking the classic
backend's protocol (``store_wire``), and offers rank 0 the same calls as
``StoreClient`` (``store.KeyValueStore``) on the same keys, in process.

Torch's own server promises nothing against another process that reaches
its port: no authentication, a blocking read per request (one half-sent
request stalls it whole), every idle connection kept. This one outlives
its peers' mistakes, and bounds what any local process can make it hold:

* one selector thread and non-blocking sockets (no thread per peer), and
  answers streamed from the stored values (``peer``), one per connection
  at a time;
* every byte it holds for its peers in one budget (``table``), each size
  checked before its bytes arrive;
* what does not belong to the group is reaped: a connection that does not
  validate in time, whose request does not arrive whole within
  ``stall_timeout``, that leaves its answer unread, or that never joined
  and sits idle or waiting past ``idle_timeout``; with ``max_joins`` (the
  group's ranks) a connection must join (``init/`` += 1, what torch's
  client given a world size sends right after its handshake) before it
  may do anything else, and joins past the group's ranks are refused;
* at ``max_connections`` a newcomer takes the place of the connection
  that never joined and was quiet the longest; only when every one joined
  is the newcomer closed (torch's client retries until its timeout).

Where torch's server closes a connection (a ``GET`` of a missing key, an
``ADD`` to a value that is no number) this one does too, so a torch client
sees the same thing. ``close()`` stops accepting, closes every connection,
wakes every wait and ends the thread within a bound; ``close(turn_away_s)``
is how a group that did not form lets the ranks still on their way go:
the connections are closed at once, and for that long a rank that arrives
is answered its handshake and then closed at its next request, which ends
torch's client at once, where a closed port makes it retry for twice its
timeout and a backoff (631 s measured with vLLM's 300 s).
"""

from __future__ import annotations

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
from .peer import Peer
from .table import Refused, Table
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
    wire_key,
)

__all__ = ["StoreLimits", "StoreServer"]

CLOSE_TIMEOUT = 5.0
_TICK = 0.1  # how often the server's thread looks for connections to reap
_RECV_BYTES = 2**18


@dataclass(frozen=True, kw_only=True)
class StoreLimits(WireLimits):
    """What the server holds and how long it waits for a peer.

    Args:
        max_connections: open connections at once; past it a newcomer takes
            the place of the one that never joined and was quiet longest.
        max_joins: the group's ranks: joins (``init/`` += 1) past it are
            refused, and a connection must join before anything but its
            handshake; None: anyone may use the store, and join.
        max_keys: keys stored at once.
        max_total_bytes: every byte held for the peers: keys and values
            stored, the keys pending waits name, requests being received,
            values unread answers still hold.
        max_output_bytes: the largest answer one request may have.
        handshake_timeout: seconds a new connection has to send
            ``VALIDATE`` (and, with ``max_joins``, to join).
        stall_timeout: seconds a request may take to arrive whole, and an
            answer may sit unread without progress.
        idle_timeout: seconds a connection that never joined may sit quiet,
            or wait; a rank that joined is never closed for idling (the
            trainer ranks keep theirs between pushes).
    """

    max_connections: int = 512
    max_joins: int | None = None
    max_keys: int = 65536
    max_total_bytes: int = 256 * 2**20
    max_output_bytes: int = 64 * 2**20
    handshake_timeout: float = 30.0
    stall_timeout: float = 30.0
    idle_timeout: float = 300.0


@dataclass(kw_only=True)
class _Refusals:
    """What the store refused that may explain a group that did not form."""

    at_capacity: int = 0  # connections closed at max_connections, none to make room
    joins: int = 0  # joins past max_joins
    turned_away: int = 0  # ranks that arrived while it turned them away


class StoreServer:
    """A c10d ``TCPStore`` host that torch's own client joins, and rank 0's
    in-process access to it (``store.KeyValueStore``'s calls, no socket).

    Args:
        host: the address to listen on (never all interfaces unless given
            ``"0.0.0.0"`` or ``"::"``); the workers connect to it.
        port: the port; 0 picks a free one (see ``port``).
        limits: sizes and timeouts; ``StoreLimits()`` by default.
        joined: ranks of this process counted as joined from the first
            connection on (rank 0, hosting the group: 1), so no other
            process can take their place among ``max_joins``.

    Raises:
        StoreError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int = 0, *, limits: StoreLimits | None = None,
                 joined: int = 0) -> None:
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
        self._table = Table(max_bytes=self.limits.max_total_bytes, max_keys=self.limits.max_keys)
        if joined:
            self._table.add(JOIN_KEY, joined)
        self._conns: set[Peer] = set()
        self._dirty: set[Peer] = set()
        self._refusals = _Refusals()
        self._stopping = False
        self._stopped = False
        self._turn_away_until = 0.0  # while turning late ranks away (0: not)
        self._dismissed: list[Peer] = []  # connections the thread closes next
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

    def held_bytes(self) -> int:
        """Bytes held for the peers now, as ``max_total_bytes`` counts them
        (for tests and diagnostics).

        Returns:
            Their number.
        """
        with self._lock:
            return self._table.used

    def troubles(self) -> str:
        """What the store refused that may explain a group that did not
        form, in one clause.

        Returns:
            E.g. "the metadata store is full: ...", or "" when it refused nothing.
        """
        with self._lock:
            said, limits, refused = [], self.limits, self._refusals
            if self._table.full:
                said.append(f"is full: it refused {self._table.full} requests for want of room "
                            f"(it holds at most {limits.max_total_bytes} bytes and "
                            f"{limits.max_keys} keys)")
            if refused.at_capacity:
                said.append(f"turned {refused.at_capacity} connections away at its limit of "
                            f"{limits.max_connections}, every one held by a rank that joined")
            if refused.joins:
                said.append(f"refused {refused.joins} joins past the group's {limits.max_joins} "
                            "ranks: another process on this host joined it")
        return "the metadata store " + "; it ".join(said) if said else ""

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

        Raises:
            StoreError: the group's ranks all joined already.
        """
        return self._add(JOIN_KEY, 1, deadline)

    def close(self, turn_away_s: float = 0.0) -> None:
        """Stop serving. Idempotent.

        Args:
            turn_away_s: 0: stop accepting, close every connection, wake
                every wait, end the thread (within ``CLOSE_TIMEOUT``). More:
                the group will not form; close every connection and wake
                every wait now, and for that many seconds (or until every
                rank of ``max_joins`` joined or was turned away) answer a
                newcomer's handshake and close it at its next request, so a
                rank still on its way leaves at once; then stop. Returns at once.
        """
        with self._lock:
            if turn_away_s > 0 and not self._stopping:
                if not self._turn_away_until:
                    self._turn_away_until = time.monotonic() + turn_away_s
                    self._dismissed = list(self._conns)
                    self._changed.notify_all()
                    self._wake()
                return
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
            if raw == JOIN_KEY and delta > 0:
                self._check_join(delta)
            total, woken = self._table.add(raw, delta)
            self._wake_waiters(woken)
            return total

    def _check_join(self, delta: int) -> None:
        """Refuse a join past the group's ranks (``max_joins``)."""
        most = self.limits.max_joins
        if most is not None and int(self._table.data.get(JOIN_KEY, b"0")) + delta > most:
            self._refusals.joins += 1
            raise Refused(f"a join past the group's {most} ranks")

    @contextmanager
    def _locked(self, deadline: Deadline | None) -> Iterator[None]:
        wait = (deadline or Deadline(DEFAULT_IO_TIMEOUT)).left()
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise StoreTimeout("the metadata store stayed busy past the deadline")
        try:
            self._check_open()
            yield
        except Refused as e:
            raise StoreError(f"the metadata store refused the call: {e}") from None
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._stopping or self._stopped or self._turn_away_until:
            raise StoreError("the metadata store is closed")

    def _wake_waiters(self, woken: list[Peer]) -> None:
        """After a change: answer the connections whose wait it ended, wake
        local waiters, and the thread if the change came from another."""
        now = time.monotonic()
        for conn in woken:
            if not conn.closed:
                conn.queue(bytes([WaitAnswer.STOP_WAITING]), now)
                self._dirty.add(conn)
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
                    if self._stopping or self._turned_all_away(time.monotonic()):
                        return
                    for conn in self._dismissed:
                        self._drop(conn)
                    self._dismissed = []
                    for key, mask in events:
                        self._on_event(key.data, mask)
                    self._flush()
                    self._reap(time.monotonic())
        finally:
            self._shutdown()

    def _turned_all_away(self, now: float) -> bool:
        """Whether turning late ranks away is over: its time is up, or every
        rank of the group either joined (and was closed) or was turned away."""
        if not self._turn_away_until:
            return False
        most = self.limits.max_joins
        joined = int(self._table.data.get(JOIN_KEY, b"0"))
        return now >= self._turn_away_until or (
            most is not None and joined + self._refusals.turned_away >= most)

    def _on_event(self, what: object, mask: int) -> None:
        if what == "listen":
            self._accept()
        elif what == "wake":
            try:
                self._wake_end.recv(4096)
            except OSError:
                pass
        elif isinstance(what, Peer) and not what.closed:
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
            if len(self._conns) >= self.limits.max_connections and not self._make_room():
                self._refusals.at_capacity += 1
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Peer(sock, self.limits, time.monotonic())
            self._conns.add(conn)
            self._interest(conn)

    def _make_room(self) -> bool:
        """Close the connection that never joined and was quiet longest;
        whether there was one."""
        guests = [c for c in self._conns if not c.member]
        if not guests:
            return False
        self._drop(min(guests, key=lambda c: c.active))
        return True

    def _read(self, conn: Peer) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            self._table.reserve(len(data), "requests being received")
        except Refused:
            self._drop(conn)
            return
        conn.inbuf += data
        conn.active = time.monotonic()
        conn.request_since = conn.request_since or conn.active
        self._serve(conn)

    def _serve(self, conn: Peer) -> None:
        """Answer the requests ``conn`` sent, one answer at a time: a
        connection owed one is not read from until it is out."""
        try:
            while not conn.closed and not conn.out:
                parsed = conn.scanner.feed(conn.inbuf)
                if parsed is None:
                    conn.request_since = conn.request_since if conn.inbuf else 0.0
                    break
                request, used = parsed
                del conn.inbuf[:used]
                self._table.release(used)
                conn.request_since = time.monotonic() if conn.inbuf else 0.0
                self._answer(conn, request)
        except (WireError, Refused):
            self._drop(conn)
            return
        self._interest(conn)

    def _answer(self, conn: Peer, request: Request) -> None:
        if not conn.validated:
            if request.query != Query.VALIDATE or request.number != MAGIC:
                raise WireError("a connection that does not open with torch's VALIDATE")
            conn.validated = True
            return
        joining = request.query == Query.ADD and request.keys[0] == JOIN_KEY
        if self._turn_away_until and request.query != Query.PING:
            if joining and request.number > 0:
                self._refusals.turned_away += 1  # a rank that will not come again
            raise Refused("the group will not form")
        if self.limits.max_joins is not None:
            self._check_member(conn, request, joining)
        handler = self._handlers.get(request.query)
        if handler is None:
            raise WireError(f"query {request.query.name} after the handshake")
        reply = handler(self, conn, request)
        if reply is not None:
            conn.queue(reply, time.monotonic())
            self._dirty.add(conn)

    @staticmethod
    def _check_member(conn: Peer, request: Request, joining: bool) -> None:
        """In a group: a connection that did not join may only ping and add
        to ``init/`` (join, or ask how many did); no one may take from that
        count, or set it."""
        if not (conn.member or joining or request.query == Query.PING):
            raise WireError("a request from a connection that did not join the group")
        if JOIN_KEY in request.keys and not (joining and request.number >= 0):
            raise WireError("a request that would change the count of ranks that joined")

    def _answer_values(self, conn: Peer, values: list[bytes]) -> None:
        """Owe ``conn`` stored values, sent from the values themselves."""
        size = sum(8 + len(v) for v in values)
        if size > self.limits.max_output_bytes:
            raise Refused(f"an answer of {size} bytes (at most {self.limits.max_output_bytes})")
        for value in values:
            self._table.lend(value)
        conn.queue_values(values, time.monotonic())
        self._dirty.add(conn)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for conn in dirty:
            if not conn.closed:
                self._write(conn)

    def _write(self, conn: Peer) -> None:
        if conn.out:
            try:
                conn.write(self._table.give_back, time.monotonic())
            except OSError:
                self._drop(conn)
                return
        if conn.out:
            self._interest(conn)
        else:
            self._serve(conn)  # the requests it sent meanwhile

    def _interest(self, conn: Peer) -> None:
        """Read from ``conn`` while it is owed nothing; else write to it."""
        events = selectors.EVENT_WRITE if conn.out else selectors.EVENT_READ
        if conn.closed or events == conn.events:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _reap(self, now: float) -> None:
        for conn in list(self._conns):
            if self._overdue(conn, now):
                self._drop(conn)
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")

    def _overdue(self, conn: Peer, now: float) -> bool:
        """Whether ``conn`` overstayed: its handshake (and, in a group, its
        join), a request that does not arrive whole, an answer it does not
        read, or quiet (or waiting) without ever joining."""
        limits = self.limits
        joining = not conn.validated or (limits.max_joins is not None and not conn.member)
        return ((joining and now - conn.opened > limits.handshake_timeout)
                or bool(conn.request_since) and now - conn.request_since > limits.stall_timeout
                or bool(conn.out) and now - conn.active > limits.stall_timeout
                or not conn.member and now - conn.active > limits.idle_timeout)

    def _drop(self, conn: Peer) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._table.forget(conn)
        self._table.release(len(conn.inbuf))
        conn.inbuf.clear()
        conn.drop_answer(self._table.give_back)
        self._conns.discard(conn)
        self._dirty.discard(conn)
        if conn.events:
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

    def _on_ping(self, conn: Peer, request: Request) -> bytes:
        return U32.pack(request.number)

    def _on_set(self, conn: Peer, request: Request) -> None:
        self._wake_waiters(self._table.put(request.keys[0], request.values[0]))

    def _on_compare_set(self, conn: Peer, request: Request) -> bytes:
        key, (expected, desired) = request.keys[0], request.values
        current = self._table.data.get(key)
        if current is None and expected:
            return blob(expected)  # torch answers the expected value for a missing key
        if current is None or current == expected:
            # Torch's classic server wakes no waiter here; waking them is
            # what a key that now exists calls for.
            self._wake_waiters(self._table.put(key, desired))
            return blob(desired)
        self._answer_values(conn, [current])
        return None

    def _on_get(self, conn: Peer, request: Request) -> None:
        self._answer_values(conn, self._values(request.keys))

    def _values(self, keys: Sequence[bytes]) -> list[bytes]:
        values = [self._table.data.get(key) for key in keys]
        if None in values:
            raise Refused("GET of a missing key")  # torch's server drops the connection too
        return values  # type: ignore[return-value]

    def _on_add(self, conn: Peer, request: Request) -> bytes:
        key, delta = request.keys[0], request.number
        if key == JOIN_KEY and delta > 0:
            self._check_join(delta)
            conn.member = True
        total, woken = self._table.add(key, delta)
        self._wake_waiters(woken)
        return i64(total)

    def _on_check(self, conn: Peer, request: Request) -> bytes:
        ready = all(key in self._table.data for key in request.keys)
        return bytes([CheckAnswer.READY if ready else CheckAnswer.NOT_READY])

    def _on_wait(self, conn: Peer, request: Request) -> bytes | None:
        if self._table.waits(conn):
            raise WireError("a WAIT while another is pending")
        if self._table.await_keys(conn, request.keys):
            return bytes([WaitAnswer.STOP_WAITING])
        return None

    def _on_num_keys(self, conn: Peer, request: Request) -> bytes:
        return i64(len(self._table.data))

    def _on_delete(self, conn: Peer, request: Request) -> bytes:
        return i64(int(self._table.delete(request.keys[0])))

    def _on_append(self, conn: Peer, request: Request) -> None:
        key = request.keys[0]
        value = self._table.data.get(key, b"") + request.values[0]
        if len(value) > self.limits.max_value_bytes:
            raise Refused("APPEND past the largest value")
        self._wake_waiters(self._table.put(key, value))

    def _on_multi_get(self, conn: Peer, request: Request) -> None:
        self._answer_values(conn, self._values(request.keys))

    def _on_multi_set(self, conn: Peer, request: Request) -> None:
        for key, value in zip(request.keys, request.values):
            self._wake_waiters(self._table.put(key, value))

    def _on_cancel_wait(self, conn: Peer, request: Request) -> bytes:
        self._table.forget(conn)
        return bytes([WaitAnswer.WAIT_CANCELED])

    # Which method answers each query: fixed for the class, so read-only.
    _handlers: ClassVar[Mapping[Query, Callable[[StoreServer, Peer, Request], bytes | None]]] = (
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
