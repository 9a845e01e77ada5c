"""The metadata group's store, without torch: what rank 0 hosts
(``StoreServer``, torch c10d ``TCPStore``'s classic protocol, which vLLM's
workers join with torch's own client) and how the other trainer ranks join
it (``StoreClient``). Both offer ``KeyValueStore``'s calls on the keys
torch's client sees; see docs/rendezvous.md, "The M2N metadata group".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from nccl_cffi.waiting import Deadline

from ..errors import StoreError, StoreTimeout
from .client import StoreClient
from .server import StoreLimits, StoreServer

__all__ = ["KeyValueStore", "StoreClient", "StoreError", "StoreLimits", "StoreServer", "StoreTimeout"]


class KeyValueStore(Protocol):
    """The calls the metadata group makes. ``StoreServer`` (in process, for
    the rank that hosts) and ``StoreClient`` (over a socket) both offer
    them, on the same keys: torch's client's, each with ``/`` in front.
    Every call ends by its deadline (the calls other than ``get`` have a
    default one)."""

    def set(self, key: str, value: bytes, deadline: Deadline | None = None) -> None:
        """Store ``value`` at ``key``."""

    def get(self, key: str, deadline: Deadline) -> bytes:
        """The value at ``key``, waiting for it until ``deadline``."""

    def add(self, key: str, delta: int, deadline: Deadline | None = None) -> int:
        """Add ``delta`` to the integer at ``key``; the new value."""

    def delete(self, key: str, deadline: Deadline | None = None) -> bool:
        """Delete ``key``; whether it was there."""

    def check(self, keys: Sequence[str], deadline: Deadline | None = None) -> bool:
        """Whether every key is set, without waiting."""

    def joined(self, deadline: Deadline | None = None) -> int:
        """How many ranks joined the store (torch's ``init/`` count)."""

    def troubles(self) -> str:
        """What the store refused that may explain a group that did not
        form, in one clause ("" if nothing, or on a client)."""

    def close(self, turn_away_s: float = 0.0) -> None:
        """Close (the server: stop serving, turning the ranks still on
        their way away for ``turn_away_s``; the client: disconnect)."""
