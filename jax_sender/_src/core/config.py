"""``SendConfig``: every setting of a sender, in one frozen, checked object.

Checked when it is built, so that a setting that cannot work (a deadline of
``None``, ``inf`` or NaN, or so long that a timed wait would overflow; a
buffer of 0 bytes, or larger than any GPU holds) is refused before anything
reaches a server, not found out in the middle of a push.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from uniqueid import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS

from .errors import MetadataError

# Per-wait deadline of a push when none is set: a floor, plus the time the
# bytes of one wait take at a slow 1 GB/s.
TIMEOUT_FLOOR_S = 60.0
SLOW_BYTES_PER_S = 1e9
# The most each setting may be, so that nothing overflows later. Deadlines:
# Python's timed waits raise OverflowError past about 9.2e9 s, and a push's
# whole bound adds one wait per chunk (an /update_weights call waits for all
# of them), so a wait's deadline stays far below a whole call's.
MAX_WAIT_S = 1e4  # send_timeout_s: 2.8 hours
MAX_CALL_S = 1e6  # init_timeout_s, reconnect_timeout_s: 11.6 days
# A packed chunk: 1 TiB, more than any GPU holds (a wait's default deadline
# is derived from it, at 1 GB/s).
MAX_BUFFER_BYTES = 2**40
# Chunks in flight: each is a CUDA stream, and up to a chunk of memory, on
# every worker (vLLM makes all the streams when an update starts).
MAX_NUM_BUFFERS = 64


def _seconds(name: str, value: Any, at_most: float, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= at_most):
        allowed = (f"a number of seconds above 0 and at most {at_most:g}"
                   + (" or None" if optional else ""))
        raise MetadataError(f"SendConfig.{name} must be {allowed}, got {value!r}")


def _count(name: str, value: Any, minimum: int, maximum: int | None = None, *,
           optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        span = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise MetadataError(f"SendConfig.{name} must be an int {span}"
                            f"{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SendConfig:
    """How a sender joins the workers and pushes to them.

    Attributes:
        packed: pack tensors into chunks of ``buffer_size_bytes`` (vLLM's
            packed mode), or send one broadcast per tensor.
        buffer_size_bytes: the packed chunk size the workers cut by (vLLM's
            default: 1 GiB; at most 1 TiB).
        num_buffers: chunks in flight at once (vLLM's default: 2; at most 64).
        init_timeout_s: bounds ``connect`` as a whole (world size, init,
            warm-up, the servers' answers); at most 1e6 s.
        send_timeout_s: bounds each wait of a push (a broadcast, a copy, an
            HTTP call, the servers' answer after the last broadcast); None:
            60 s plus the bytes of that wait at 1 GB/s; at most 1e4 s.
        reconnect_timeout_s: bounds ``reconnect()`` as a whole (and a change
            of the servers: ``add_server``, ``drop_server``); the servers'
            release takes at most half of it, so a stuck server is named (or
            dropped) with time left to form the group with the others; at
            most 1e6 s.
        staging_bytes: the device memory an asynchronous send
            (``send(wait=False)``) may take to snapshot what it sends; a push
            larger than that runs blocking instead. None: no bound (one extra
            copy of the pushed bytes, kept for the next asynchronous push).

    Raises:
        MetadataError: a setting that cannot work, or past its bound (each
            would overflow a timed wait, or a worker's memory, later): one
            sentence naming it.
    """

    packed: bool = True
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    init_timeout_s: float = 300.0
    send_timeout_s: float | None = None
    reconnect_timeout_s: float = 300.0
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.packed, bool):
            raise MetadataError(f"SendConfig.packed must be a bool, got {self.packed!r}")
        _count("buffer_size_bytes", self.buffer_size_bytes, 1, MAX_BUFFER_BYTES)
        _count("num_buffers", self.num_buffers, 1, MAX_NUM_BUFFERS)
        _seconds("init_timeout_s", self.init_timeout_s, MAX_CALL_S, optional=False)
        _seconds("send_timeout_s", self.send_timeout_s, MAX_WAIT_S, optional=True)
        _seconds("reconnect_timeout_s", self.reconnect_timeout_s, MAX_CALL_S, optional=False)
        _count("staging_bytes", self.staging_bytes, 0, optional=True)

    def wire(self) -> dict[str, Any]:
        """The geometry the workers are told at init (``InitInfo``'s keys), so
        both sides cut chunks alike: derived here alone.

        Returns:
            ``packed``, ``packed_buffer_size_bytes`` and ``packed_num_buffers``,
            as keyword arguments of ``InitInfo`` and ``uniqueid.connect``.
        """
        return {"packed": self.packed, "packed_buffer_size_bytes": self.buffer_size_bytes,
                "packed_num_buffers": self.num_buffers}

    def wait_timeout_s(self, nbytes: int) -> float:
        """The deadline of one wait of a push that moves ``nbytes``.

        Args:
            nbytes: the bytes the wait is for.

        Returns:
            ``send_timeout_s``, or 60 s plus ``nbytes`` at 1 GB/s.
        """
        if self.send_timeout_s is not None:
            return self.send_timeout_s
        return TIMEOUT_FLOOR_S + nbytes / SLOW_BYTES_PER_S
