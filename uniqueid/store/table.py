"""The store's keys and values, who waits for which key, and the one
budget every byte the store holds for its peers is counted in.

Why one budget (``StoreLimits.max_total_bytes``) for everything, not only
for what is stored: a peer makes the store hold memory in four ways, and
each was a way around a budget of stored values alone. Stored keys and
values; the keys a pending ``WAIT`` names (1,024 keys of 4 KiB each per
connection); the bytes of a request still being received (a 16 MiB
``SET`` sent but for its last byte); and a value an answer not yet read
still holds after the key was set again or deleted (answers are sent from
the stored values themselves, never copied, so a value outlives its key
while an answer holds it). Whatever would go past the budget is refused
(``Refused``), and the peer that asked is closed.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

__all__ = ["Refused", "Table"]

_INT64 = re.compile(rb"-?[0-9]{1,19}")


class Refused(Exception):
    """What the table cannot do; the server closes the connection that asked."""


class Table:
    """The keys and values within their budget, and which connection waits
    for which key (``waitingSockets_`` and ``keysAwaited_`` in torch).

    Args:
        max_bytes: the budget (``StoreLimits.max_total_bytes``).
        max_keys: the most keys stored at once.
    """

    def __init__(self, *, max_bytes: int, max_keys: int) -> None:
        self.max_bytes = max_bytes
        self.max_keys = max_keys
        self.data: dict[bytes, bytes] = {}
        self.used = 0
        self.full = 0  # how many times something was refused for want of room
        self.waiting: dict[bytes, dict[Hashable, None]] = {}
        self.awaited: dict[Hashable, set[bytes]] = {}
        # id(value) -> [value, answers holding it, times it left the table meanwhile]
        self._lent: dict[int, list] = {}

    def reserve(self, size: int, what: str) -> None:
        """Count ``size`` more bytes held, or refuse them.

        Raises:
            Refused: they do not fit (the store is full).
        """
        if self.used + size > self.max_bytes:
            self.full += 1
            raise Refused(f"the store is full ({self.max_bytes} bytes: {what})")
        self.used += size

    def release(self, size: int) -> None:
        """``size`` bytes counted by ``reserve`` are no longer held."""
        self.used -= size

    def put(self, key: bytes, value: bytes) -> list[Hashable]:
        """Store ``value``; the connections whose wait it ends."""
        old = self.data.get(key)
        if old is None and len(self.data) >= self.max_keys:
            self.full += 1
            raise Refused(f"the store holds its most keys ({self.max_keys})")
        freed = 0 if old is None or id(old) in self._lent else len(old)
        self.reserve(len(value) + (len(key) if old is None else 0) - freed, "a value")
        if old is not None:
            self._leave(old)
        self.data[key] = value
        return self._arrived(key)

    def add(self, key: bytes, delta: int) -> tuple[int, list[Hashable]]:
        """Add ``delta`` to the integer at ``key`` (0 if unset)."""
        old = self.data.get(key, b"0")
        if not _INT64.fullmatch(old):
            raise Refused("ADD to a value that is not an integer")
        total = int(old) + delta
        if not -(2**63) <= total < 2**63:
            raise Refused("ADD past int64")
        return total, self.put(key, str(total).encode())

    def delete(self, key: bytes) -> bool:
        """Delete ``key``; whether it was there."""
        value = self.data.pop(key, None)
        if value is not None:
            self.release(len(key) + self._leave(value))
        return value is not None

    def lend(self, value: bytes) -> None:
        """An answer will send ``value`` itself: it stays counted until
        ``give_back``, even if it leaves the table meanwhile."""
        self._lent.setdefault(id(value), [value, 0, 0])[1] += 1

    def give_back(self, value: bytes) -> None:
        """An answer sent ``value`` (or was dropped)."""
        entry = self._lent[id(value)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._lent[id(value)]
            self.release(len(value) * entry[2])

    def _leave(self, value: bytes) -> int:
        """``value`` leaves the table: the bytes this frees now (none while
        an answer holds it: those are freed when it is given back)."""
        entry = self._lent.get(id(value))
        if entry is None:
            return len(value)
        entry[2] += 1
        return 0

    def await_keys(self, conn: Hashable, keys: Sequence[bytes]) -> bool:
        """Whether every key is there; if not, ``conn`` waits for the rest
        (each key it waits for counted as held).

        Raises:
            Refused: the keys it would wait for do not fit.
        """
        missing = {key for key in keys if key not in self.data}
        self.reserve(sum(map(len, missing)), "the keys of a WAIT")
        for key in missing:
            self.waiting.setdefault(key, {})[conn] = None
        if missing:
            self.awaited[conn] = missing
        return not missing

    def waits(self, conn: Hashable) -> bool:
        """Whether ``conn`` waits for a key."""
        return conn in self.awaited

    def forget(self, conn: Hashable) -> None:
        """``conn`` waits for nothing any more."""
        for key in self.awaited.pop(conn, ()):
            conns = self.waiting[key]
            del conns[conn]
            if not conns:
                del self.waiting[key]
            self.release(len(key))

    def _arrived(self, key: bytes) -> list[Hashable]:
        woken = []
        for conn in self.waiting.pop(key, ()):
            missing = self.awaited[conn]
            missing.discard(key)
            self.release(len(key))
            if not missing:
                del self.awaited[conn]
                woken.append(conn)
        return woken
