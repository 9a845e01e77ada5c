"""A torch-free client of torch c10d ``TCPStore``'s protocol: how trainer
ranks other than 0 join the metadata group's store.

It opens as torch's client does (``VALIDATE``, then ``PING`` with a nonce
the server must echo; a world size adds 1 to ``init/``) and names keys as
torch's client does (``KEY_PREFIX`` in front), so its keys are the keys
vLLM's workers see. Unlike torch's client, every call ends by one
``Deadline`` for the whole call (the lock, the send, every read), and a
``set`` is confirmed (a ``PING`` follows it in the same send): a store
that refused the value (full, over a limit) closes the connection, and
the caller learns it from that ``set``, not from the next call.

A ``get`` keeps ``CANCEL_GRACE`` of its deadline for cancelling its wait
the way torch's client does, so the connection stays usable after a
timeout. A connection left inside a half-read answer (a deadline that
passed mid-answer, a server that broke the protocol) is closed, and every
later call says so.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from nccl_cffi.waiting import Deadline

from ..errors import StoreError, StoreTimeout
from .wire import (
    DEFAULT_IO_TIMEOUT,
    I64,
    JOIN_KEY,
    MAGIC,
    U32,
    U64,
    CheckAnswer,
    Query,
    Request,
    WaitAnswer,
    WireLimits,
    checked_delta,
    checked_value,
    encode_request,
    wire_key,
)

__all__ = ["CANCEL_GRACE", "StoreClient"]

CANCEL_GRACE = 1.0


class _Broken(Exception):
    """The connection is no longer in step with the server."""


class StoreClient:
    """A connection to a c10d ``TCPStore`` (``StoreServer`` or torch's own),
    with ``store.KeyValueStore``'s calls.

    Args:
        host: the store's address.
        port: its port.
        deadline: bounds connecting (retried while refused, as torch's
            client retries) and the handshake.
        world_size: if given, counts this process as joined (``init/`` += 1),
            as torch's client given a world size does.
        io_timeout: the deadline of a call given none (all but ``get``).
        limits: the longest key and value accepted (answers included).

    Raises:
        StoreTimeout: the store did not answer within the deadline.
        StoreError: it answered, but not as a ``TCPStore``.
    """

    def __init__(self, host: str, port: int, *, deadline: Deadline, world_size: int | None = None,
                 io_timeout: float = DEFAULT_IO_TIMEOUT, limits: WireLimits | None = None) -> None:
        self.address = (host, port)
        self.limits = limits or WireLimits()
        self._io_timeout = io_timeout
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._sock = _connect(host, port, deadline)
        nonce = os.getpid() & 0xFFFFFFFF
        try:
            with self._call(deadline):
                self._send(encode_request(Request(query=Query.VALIDATE, number=MAGIC))
                           + encode_request(Request(query=Query.PING, number=nonce)), deadline)
                if self._number(U32, deadline) != nonce:
                    raise _Broken("its PING answer is not the nonce sent")
                if world_size is not None:
                    self._send(encode_request(Request(query=Query.ADD, keys=(JOIN_KEY,), number=1)),
                               deadline)
                    self._number(I64, deadline)
        except BaseException:
            self.close()
            raise

    def set(self, key: str, value: bytes, deadline: Deadline | None = None) -> None:
        """Store ``value`` at ``key`` and wait until the store confirms it.

        Args:
            key: the key, without the prefix.
            value: the bytes.
            deadline: the whole call's; ``io_timeout`` by default.

        Raises:
            StoreError: the store refused it (the connection is then closed).
            StoreTimeout: no confirmation within the deadline.
        """
        raw, value = wire_key(key, self.limits), checked_value(value, self.limits)
        with self._call(deadline) as deadline:
            self._send(encode_request(Request(query=Query.SET, keys=(raw,), values=(value,)))
                       + encode_request(Request(query=Query.PING, number=1)), deadline)
            if self._number(U32, deadline) != 1:
                raise _Broken("its PING answer is not the nonce sent")

    def get(self, key: str, deadline: Deadline) -> bytes:
        """The value at ``key``, waiting for it to be set (``WAIT``, then ``GET``).

        Args:
            key: the key.
            deadline: the whole call's.

        Returns:
            The value.

        Raises:
            StoreTimeout: not set within the deadline (the wait is cancelled
                as torch cancels it; the connection stays usable).
            StoreError: the store closed the connection.
        """
        raw = wire_key(key, self.limits)
        with self._call(deadline):
            self._send(encode_request(Request(query=Query.WAIT, keys=(raw,))), deadline)
            left = deadline.left()
            waiting = Deadline(None if left is None else max(left - min(CANCEL_GRACE, left / 2), 0.0))
            answer = self._answer_within(waiting)
            if answer is None:
                self._cancel_wait(deadline)
                raise StoreTimeout(f"store key {key!r} was not set within the deadline")
            if answer != WaitAnswer.STOP_WAITING:
                raise _Broken(f"it answered a WAIT with {answer}")
            self._send(encode_request(Request(query=Query.GET, keys=(raw,))), deadline)
            return self._blob(deadline)

    def add(self, key: str, delta: int, deadline: Deadline | None = None) -> int:
        """Add ``delta`` to the integer at ``key`` (0 if unset).

        Args:
            key: the key.
            delta: what to add.
            deadline: the whole call's; ``io_timeout`` by default.

        Returns:
            The new value.

        Raises:
            StoreError: the value is not an integer (the store closes the
                connection, as torch's does).
        """
        return self._add(wire_key(key, self.limits), delta, deadline)

    def delete(self, key: str, deadline: Deadline | None = None) -> bool:
        """Delete ``key``.

        Args:
            key: the key.
            deadline: the whole call's; ``io_timeout`` by default.

        Returns:
            Whether it was there.
        """
        raw = wire_key(key, self.limits)
        with self._call(deadline) as deadline:
            self._send(encode_request(Request(query=Query.DELETE_KEY, keys=(raw,))), deadline)
            return self._number(I64, deadline) == 1

    def check(self, keys: Sequence[str], deadline: Deadline | None = None) -> bool:
        """Whether every key is set, without waiting.

        Args:
            keys: the keys.
            deadline: the whole call's; ``io_timeout`` by default.

        Returns:
            True when all are set.
        """
        raws = tuple(wire_key(k, self.limits) for k in keys)
        with self._call(deadline) as deadline:
            self._send(encode_request(Request(query=Query.CHECK, keys=raws)), deadline)
            answer = self._recv(1, deadline)[0]
            if answer not in (CheckAnswer.READY, CheckAnswer.NOT_READY):
                raise _Broken(f"it answered a CHECK with {answer}")
            return answer == CheckAnswer.READY

    def joined(self, deadline: Deadline | None = None) -> int:
        """How many ranks joined (the ``init/`` count).

        Args:
            deadline: the whole call's; ``io_timeout`` by default.

        Returns:
            The count.
        """
        return self._add(JOIN_KEY, 0, deadline)

    def troubles(self) -> str:
        """What the store refused (only its host knows).

        Returns:
            "".
        """
        return ""

    def close(self, turn_away_s: float = 0.0) -> None:
        """Close the connection. Idempotent; later calls raise ``StoreError``.

        Args:
            turn_away_s: unused (only the host turns late ranks away).
        """
        self._broken = self._broken or "it was closed"
        self._sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, raw: bytes, delta: int, deadline: Deadline | None) -> int:
        delta = checked_delta(delta)
        with self._call(deadline) as deadline:
            self._send(encode_request(Request(query=Query.ADD, keys=(raw,), number=delta)), deadline)
            return self._number(I64, deadline)

    @contextmanager
    def _call(self, deadline: Deadline | None) -> Iterator[Deadline]:
        """One call within ``deadline`` (``io_timeout`` if None), which it
        yields: the lock within it; a broken connection refused; a timeout
        or a break mid-answer leaves it closed."""
        deadline = deadline or Deadline(self._io_timeout)
        left = deadline.left()
        if not self._lock.acquire(timeout=-1 if left is None else left):
            raise StoreTimeout(f"the store connection to {self._where()} stayed busy past the deadline")
        try:
            if self._broken:
                raise StoreError(f"the connection to the metadata store at {self._where()} is closed "
                                 f"({self._broken}); join the group again")
            yield deadline
        except StoreError:
            raise
        except TimeoutError:
            self._break("a call timed out inside an answer")
            raise StoreTimeout(f"the metadata store at {self._where()} did not answer within "
                               "the deadline") from None
        except (OSError, _Broken) as e:
            self._break(str(e) or type(e).__name__)
            raise StoreError(f"the connection to the metadata store at {self._where()} failed: "
                             f"{self._broken}") from None
        finally:
            self._lock.release()

    def _break(self, why: str) -> None:
        self._broken = self._broken or why  # the first reason (a close() from another thread)
        self._sock.close()

    def _where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _send(self, data: bytes, deadline: Deadline) -> None:
        self._sock.settimeout(_left(deadline))
        self._sock.sendall(data)

    def _recv(self, size: int, deadline: Deadline) -> bytes:
        out = bytearray()
        while len(out) < size:
            self._sock.settimeout(_left(deadline))
            chunk = self._sock.recv(min(size - len(out), 2**20))
            if not chunk:
                raise _Broken("the store closed the connection")
            out += chunk
        return bytes(out)

    def _number(self, codec: struct.Struct, deadline: Deadline) -> int:
        return codec.unpack(self._recv(codec.size, deadline))[0]

    def _blob(self, deadline: Deadline) -> bytes:
        size = self._number(U64, deadline)
        if size > self.limits.max_value_bytes:
            raise _Broken(f"it answered with a value of {size} bytes")
        return self._recv(size, deadline)

    def _answer_within(self, deadline: Deadline) -> int | None:
        """One byte of answer, or None if none came before the deadline."""
        left = deadline.left()
        self._sock.settimeout(None if left is None else max(left, 1e-3))
        try:
            data = self._sock.recv(1)
        except TimeoutError:
            return None
        if not data:
            raise _Broken("the store closed the connection")
        return data[0]

    def _cancel_wait(self, deadline: Deadline) -> None:
        """Torch's way out of a wait: ``CANCEL_WAIT``, answered with
        ``WAIT_CANCELED`` (after a ``STOP_WAITING`` already on its way)."""
        self._send(encode_request(Request(query=Query.CANCEL_WAIT)), deadline)
        answer = self._recv(1, deadline)[0]
        if answer == WaitAnswer.STOP_WAITING:
            answer = self._recv(1, deadline)[0]
        if answer != WaitAnswer.WAIT_CANCELED:
            raise _Broken(f"it answered CANCEL_WAIT with {answer}")


def _left(deadline: Deadline) -> float | None:
    """Seconds for a socket timeout; a passed deadline times out at once."""
    left = deadline.left()
    if left is not None and left <= 0:
        raise TimeoutError
    return left


def _connect(host: str, port: int, deadline: Deadline) -> socket.socket:
    """Connect, retrying while refused (the host may not listen yet)."""
    pause = 0.05
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=_left(deadline))
        except (ConnectionRefusedError, ConnectionResetError) as e:
            left = deadline.left()
            if left is not None and left <= pause:
                raise StoreTimeout(f"the metadata store at {host}:{port} refused connections until "
                                   f"the deadline ({e}); check that trainer rank 0 hosts it there") from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
        except TimeoutError:
            raise StoreTimeout(f"could not reach the metadata store at {host}:{port} within the "
                               "deadline; check the address and that nothing blocks the port") from None
        except OSError as e:
            raise StoreError(f"cannot connect to the metadata store at {host}:{port}: {e}") from None
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock

