"""One connection to the store: the bytes it sent that no request took
yet, the answer it is owed, and what the store knows of it.

Why an answer is a queue of parts, stored values among them by
reference: an answer was once built whole before a byte of it went out,
so one 10 KB ``MULTI_GET`` naming a 1 MiB key 1,024 times made the store
build (and copy) 2 GiB while it held its lock. Now it queues, per value, an
8-byte size and the value itself (lent by the ``Table``, so its bytes stay
counted in the budget until sent), and the socket takes them as fast as
the peer reads. A connection owed an answer is not read from until the
answer is out (torch's client waits for each answer before its next
request), so one connection holds at most one answer.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable
from itertools import islice

from .wire import U64, Scanner, WireLimits

__all__ = ["Peer"]

_GATHER = 64  # parts handed to one sendmsg


class Peer:
    """One connection.

    Args:
        sock: its socket, non-blocking.
        limits: what one request may carry.
        now: when it was accepted (``time.monotonic()``).
    """

    __slots__ = ("sock", "inbuf", "scanner", "out", "sent", "events", "validated", "member",
                 "opened", "active", "request_since", "closed")

    def __init__(self, sock: socket.socket, limits: WireLimits, now: float) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.scanner = Scanner(limits)
        self.out: deque[tuple[bytes, bool]] = deque()  # the answer's parts; True: a lent value
        self.sent = 0  # bytes of out[0] already sent
        self.events = 0  # the selector events registered
        self.validated = False
        self.member = False  # it joined the group (init/ += 1)
        self.opened = now
        self.active = now  # its last request, or its answer's last progress
        self.request_since = 0.0  # when the request being received began (0: none)
        self.closed = False

    def queue(self, data: bytes, now: float) -> None:
        """Owe it ``data`` (the store's own bytes, not a stored value)."""
        if not self.out:
            self.active = now
        self.out.append((data, False))

    def queue_values(self, values: list[bytes], now: float) -> None:
        """Owe it each value as torch's wire has it (a u64 size, then the
        bytes), each value sent as it is stored (lent by the caller)."""
        if not self.out:
            self.active = now
        for value in values:
            self.out.append((U64.pack(len(value)), False))
            self.out.append((value, True))

    def write(self, give_back: Callable[[bytes], None], now: float) -> None:
        """Send what the socket takes now; each lent value fully sent is
        given back.

        Raises:
            OSError: the connection broke.
        """
        parts = [data for data, _ in islice(self.out, _GATHER)]
        parts[0] = memoryview(parts[0])[self.sent:]
        try:
            left = self.sock.sendmsg(parts)
        except BlockingIOError:
            return
        if left:
            self.active = now
        while self.out:
            data, lent = self.out[0]
            if left < len(data) - self.sent:
                self.sent += left
                return
            left -= len(data) - self.sent
            self.sent = 0
            self.out.popleft()
            if lent:
                give_back(data)

    def drop_answer(self, give_back: Callable[[bytes], None]) -> None:
        """Forget what it is owed, giving back every lent value."""
        for data, lent in self.out:
            if lent:
                give_back(data)
        self.out.clear()
        self.sent = 0
