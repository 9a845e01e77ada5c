"""torch c10d ``TCPStore``'s wire format, both directions, to the byte.

Why our own: vLLM's ``nccl_m2n`` workers join their metadata group with
torch's ``TCPStore`` client, and a torch-free trainer has to host (and
join) that store without torch. What torch's client sends, read from
``TCPStore.cpp`` and the classic (non-libuv) ``TCPStoreBackend.cpp``:

* every request is one byte of ``QueryType`` then its fields; integers are
  the sender's native byte order (little-endian on every host vLLM runs
  on), a string or a byte vector is a u64 length then the bytes;
* a connection's first request is ``VALIDATE`` with ``MAGIC`` (the server
  drops a connection that opens with anything else), then ``PING`` with a
  nonce the server echoes;
* every key the client's public calls name gets ``KEY_PREFIX`` in front;
  the one exception is ``JOIN_KEY``, which a client given a world size
  increments on connect (``waitForWorkers``);
* ``get`` is ``WAIT`` for the key, then ``GET``; a ``WAIT`` not answered
  within the client's timeout is followed by ``CANCEL_WAIT``, which the
  server answers with ``WAIT_CANCELED`` (after a ``STOP_WAITING`` already
  on its way, if the key arrived meanwhile).

The codes are those of torch 2.8 through 2.13 (torch only ever appended
new ones). Requests this module has no shape for (the libuv backend's
queues, ``LIST_KEYS``, ``BARRIER``) are refused, as the classic backend
refuses what it does not know.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "DEFAULT_IO_TIMEOUT", "I64", "JOIN_KEY", "KEY_PREFIX", "MAGIC", "U32", "U64", "CheckAnswer",
    "Query", "Request", "Scanner", "WaitAnswer", "WireError", "WireLimits", "blob", "checked_delta",
    "checked_value", "encode_request", "i64", "parse_request", "wire_key",
]

MAGIC = 0x3C85F7CE
KEY_PREFIX = b"/"
JOIN_KEY = b"init/"
# The deadline of a store call (client or server side) given none of its own.
DEFAULT_IO_TIMEOUT = 30.0


class Query(IntEnum):
    """``c10d::detail::QueryType``."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


class CheckAnswer(IntEnum):
    """``CheckResponseType``: one byte."""

    READY = 0
    NOT_READY = 1


class WaitAnswer(IntEnum):
    """``WaitResponseType``: one byte."""

    STOP_WAITING = 0
    WAIT_CANCELED = 1


# Each request's fields, in order: "u32" and "i64" fill ``Request.number``;
# "key" and "value" take the next of ``keys`` / ``values`` (a u64 size, then
# the bytes); "keys" is a u64 count and that many keys; "pairs" an i64 count
# and that many key, value.
_SHAPES: dict[Query, tuple[str, ...]] = {
    Query.VALIDATE: ("u32",),
    Query.PING: ("u32",),
    Query.SET: ("key", "value"),
    Query.COMPARE_SET: ("key", "value", "value"),
    Query.GET: ("key",),
    Query.ADD: ("key", "i64"),
    Query.CHECK: ("keys",),
    Query.WAIT: ("keys",),
    Query.GETNUMKEYS: (),
    Query.DELETE_KEY: ("key",),
    Query.APPEND: ("key", "value"),
    Query.MULTI_GET: ("keys",),
    Query.MULTI_SET: ("pairs",),
    Query.CANCEL_WAIT: (),
}
# The integers on the wire (little-endian, see the module docstring).
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
_NUMBERS = {"u32": U32, "i64": I64}
# How a scan reads each header: a key or value is a u64 size, then its bytes.
_SIZED = {"key": "key_size", "value": "value_size"}
_HEADERS = {**_NUMBERS, "keys": U64, "pairs": I64, "key_size": U64, "value_size": U64}


class WireError(ValueError):
    """A peer sent what torch's client never sends: an unknown code, a size
    over the limits, a count that does not fit."""


@dataclass(frozen=True, kw_only=True)
class WireLimits:
    """What one request may carry.

    Args:
        max_key_bytes: the longest key, prefix included.
        max_value_bytes: the longest value.
        max_keys_per_request: the most keys one ``CHECK``, ``WAIT``,
            ``MULTI_GET`` or ``MULTI_SET`` names.
        max_request_bytes: the most bytes one request takes, all fields.
    """

    max_key_bytes: int = 4096
    max_value_bytes: int = 16 * 2**20
    max_keys_per_request: int = 1024
    max_request_bytes: int = 32 * 2**20


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request as torch's client sends it.

    Args:
        query: its code.
        keys: the keys it names, as sent (prefix included).
        values: its byte vectors (``SET``'s value, ``COMPARE_SET``'s
            expected and desired, ``MULTI_SET``'s values).
        number: ``VALIDATE``'s magic, ``PING``'s nonce or ``ADD``'s delta.
    """

    query: Query
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0


class Scanner:
    """Finds the request at the front of one connection's bytes as they
    arrive, resuming where it stopped.

    Why resumable: a request comes in pieces (a read at a time), and parsing
    it again from its first byte at each piece costs the square of its size
    (a 31 MiB ``MULTI_SET`` of 1,024 pairs took 8 s so, where the same bytes
    as 1,024 small requests took 0.2 s). This looks at each header once,
    checks every declared size against the limits as soon as its header is
    there (before its bytes are), and copies nothing until the request is
    whole; then each key and value is copied once.

    Args:
        limits: what one request may carry.
    """

    def __init__(self, limits: WireLimits) -> None:
        self.limits = limits
        self.reset()

    def reset(self) -> None:
        """Forget the request scanned so far (the next byte starts one)."""
        self._query: Query | None = None
        self._todo: list[tuple[str, int]] = []  # the fields still to find, next last
        self._pos = 0
        self._spans: list[tuple[str, int, int]] = []  # ("key" or "value", start, end)
        self._number = 0

    @property
    def started(self) -> bool:
        """Whether a request's first byte was seen."""
        return self._query is not None

    def feed(self, buf: bytes | bytearray) -> tuple[Request, int] | None:
        """The request at the front of ``buf``, once it is all there.

        Args:
            buf: the connection's bytes not yet taken, the same buffer at
                every call (only grown at its end) until a request is returned.

        Returns:
            The request and how many bytes of ``buf`` it took (the scanner
            then starts on the next); None while ``buf`` ends inside it.

        Raises:
            WireError: an unknown code, or a size or count over the limits.
        """
        if self._query is None:
            if not buf:
                return None
            try:
                self._query = Query(buf[0])
            except ValueError:
                raise WireError(f"unknown query type {buf[0]}") from None
            self._todo = [(_SIZED.get(field, field), 0) for field in reversed(_SHAPES[self._query])]
            self._pos = 1
        while self._todo:
            if not self._step(buf):
                return None
        found = self._request(buf), self._pos
        self.reset()
        return found

    def _step(self, buf: bytes | bytearray) -> bool:
        """Take the next field if its bytes are there."""
        field, size = self._todo[-1]
        if field in ("key", "value"):
            return self._span(buf, field, size)
        codec = _HEADERS[field]
        if not self._have(buf, codec.size):
            return False
        value = codec.unpack_from(buf, self._pos)[0]
        self._pos += codec.size
        self._todo.pop()
        self._expand(field, value)
        return True

    def _expand(self, field: str, value: int) -> None:
        """What a number read means: a size, a count, or the request's number."""
        limits = self.limits
        if field in ("key_size", "value_size"):
            what = field.removesuffix("_size")
            limit = limits.max_key_bytes if what == "key" else limits.max_value_bytes
            if value > limit:
                raise WireError(f"a {what} of {value} bytes (at most {limit})")
            self._room(value)  # refused before its bytes come
            self._todo.append((what, value))
        elif field in ("keys", "pairs"):
            if not 0 <= value <= limits.max_keys_per_request:
                raise WireError(f"a request naming {value} keys (at most {limits.max_keys_per_request})")
            item = [("key_size", 0)] if field == "keys" else [("value_size", 0), ("key_size", 0)]
            self._todo += item * value
        else:
            self._number = value

    def _span(self, buf: bytes | bytearray, what: str, size: int) -> bool:
        if not self._have(buf, size):
            return False
        self._spans.append((what, self._pos, self._pos + size))
        self._pos += size
        self._todo.pop()
        return True

    def _have(self, buf: bytes | bytearray, size: int) -> bool:
        """Whether ``size`` more bytes are there (within the request's limit)."""
        self._room(size)
        return self._pos + size <= len(buf)

    def _room(self, size: int) -> None:
        if self._pos + size > self.limits.max_request_bytes:
            raise WireError(f"a request over {self.limits.max_request_bytes} bytes")

    def _request(self, buf: bytes | bytearray) -> Request:
        # Released on the way out, so the caller may cut the bytes it took
        # off a bytearray at once.
        with memoryview(buf) as view:
            keys = tuple(bytes(view[a:b]) for what, a, b in self._spans if what == "key")
            values = tuple(bytes(view[a:b]) for what, a, b in self._spans if what == "value")
        return Request(query=self._query, keys=keys, values=values, number=self._number)


def parse_request(buf: bytes | bytearray | memoryview, limits: WireLimits) -> tuple[Request, int] | None:
    """The request at the front of ``buf``, if it is all there.

    Args:
        buf: bytes received on one connection, not yet parsed.
        limits: what one request may carry.

    Returns:
        The request and how many bytes of ``buf`` it took; None while
        ``buf`` ends inside it.

    Raises:
        WireError: an unknown code, or a size or count over ``limits``,
            as soon as its header arrives (before its bytes do).
    """
    return Scanner(limits).feed(bytes(buf) if isinstance(buf, memoryview) else buf)


def encode_request(request: Request) -> bytes:
    """``request`` as torch's client sends it (the inverse of ``parse_request``).

    Args:
        request: what to send; it must hold as many keys and values as
            its query's fields take.

    Returns:
        The bytes of the request.
    """
    out = [bytes([request.query])]
    keys, values = iter(request.keys), iter(request.values)
    for field in _SHAPES[request.query]:
        if field in _NUMBERS:
            out.append(_NUMBERS[field].pack(request.number))
        elif field == "key":
            out.append(blob(next(keys)))
        elif field == "value":
            out.append(blob(next(values)))
        elif field == "keys":
            out.append(U64.pack(len(request.keys)) + b"".join(blob(k) for k in request.keys))
        else:  # "pairs"
            pairs = zip(request.keys, request.values)
            out.append(I64.pack(len(request.keys)) + b"".join(blob(k) + blob(v) for k, v in pairs))
    return b"".join(out)


def blob(data: bytes) -> bytes:
    """A string or byte vector on the wire: its u64 length, then its bytes.

    Args:
        data: the bytes.

    Returns:
        The encoded field.
    """
    return U64.pack(len(data)) + data


def i64(value: int) -> bytes:
    """An int64 on the wire (``ADD``'s, ``GETNUMKEYS``'s and ``DELETE_KEY``'s answers).

    Args:
        value: the number.

    Returns:
        Its 8 bytes.
    """
    return I64.pack(value)


def wire_key(key: str, limits: WireLimits) -> bytes:
    """``key`` as torch's client sends it: ``KEY_PREFIX`` + its UTF-8.

    Args:
        key: a key as torch's caller names it, e.g. ``broadcast_from/0/3``.
        limits: the longest key allowed.

    Returns:
        The stored key.

    Raises:
        TypeError: ``key`` is not a str.
        ValueError: it is longer than ``limits.max_key_bytes``.
    """
    if not isinstance(key, str):
        raise TypeError(f"a store key is a str, got {type(key).__name__}")
    raw = KEY_PREFIX + key.encode()
    if len(raw) > limits.max_key_bytes:
        raise ValueError(f"store key {key[:60]!r} is over {limits.max_key_bytes} bytes")
    return raw


def checked_value(value: bytes, limits: WireLimits) -> bytes:
    """``value`` as bytes, checked for type and size.

    Args:
        value: the value.
        limits: the longest value allowed.

    Returns:
        The bytes.

    Raises:
        TypeError: ``value`` is not bytes-like.
        ValueError: it is longer than ``limits.max_value_bytes``.
    """
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"a store value is bytes, got {type(value).__name__}")
    value = bytes(value)
    if len(value) > limits.max_value_bytes:
        raise ValueError(f"a store value of {len(value)} bytes is over {limits.max_value_bytes}")
    return value


def checked_delta(delta: int) -> int:
    """``delta`` as an ``ADD``'s int64 operand, checked for type.

    Args:
        delta: what to add.

    Returns:
        ``delta``.

    Raises:
        TypeError: ``delta`` is not an int (a bool is not one here).
    """
    if not isinstance(delta, int) or isinstance(delta, bool):
        raise TypeError(f"add takes an int, got {type(delta).__name__}")
    return delta
