"""``SendConfig``: every setting of a sender, in one frozen, checked object.

Checked when it is built, so that a setting that cannot work (a deadline of
``None``, ``inf`` or NaN, a buffer of 0 bytes) is refused before anything
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


def _seconds(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        allowed = "a positive, finite number of seconds" + (" or None" if optional else "")
        raise MetadataError(f"SendConfig.{name} must be {allowed}, got {value!r}")


def _count(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MetadataError(f"SendConfig.{name} must be an int >= {minimum}"
                            f"{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SendConfig:
    """How a sender joins the workers and pushes to them.

    Attributes:
        packed: pack tensors into chunks of ``buffer_size_bytes`` (vLLM's
            packed mode), or send one broadcast per tensor.
        buffer_size_bytes: the packed chunk size the workers cut by (vLLM's
            default: 1 GiB).
        num_buffers: chunks in flight at once (vLLM's default: 2).
        init_timeout_s: bounds ``connect`` as a whole (world size, init,
            warm-up, the servers' answers).
        send_timeout_s: bounds each wait of a push (a broadcast, a copy, an
            HTTP call, the servers' answer after the last broadcast); None:
            60 s plus the bytes of that wait at 1 GB/s.
        reconnect_timeout_s: bounds ``reconnect()`` as a whole (and a change
            of the servers: ``add_server``, ``drop_server``); the servers'
            release takes at most half of it, so a stuck server is named (or
            dropped) with time left to form the group with the others.
        staging_bytes: the device memory an asynchronous send
            (``send(wait=False)``) may take to snapshot what it sends; a push
            larger than that runs blocking instead. None: no bound (one extra
            copy of the pushed bytes, kept for the next asynchronous push).

    Raises:
        MetadataError: a setting that cannot work.
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
        _count("buffer_size_bytes", self.buffer_size_bytes, 1)
        _count("num_buffers", self.num_buffers, 1)
        _seconds("init_timeout_s", self.init_timeout_s, optional=False)
        _seconds("send_timeout_s", self.send_timeout_s, optional=True)
        _seconds("reconnect_timeout_s", self.reconnect_timeout_s, optional=False)
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
