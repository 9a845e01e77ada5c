"""``SendConfig``: every setting of a sender, in one frozen, checked object."""

from __future__ import annotations

from dataclasses import dataclass

from uniqueid import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS

from .errors import MetadataError

# Per-wait deadline of a push when none is set: a floor, plus the time the
# bytes of one wait take at a slow 1 GB/s.
TIMEOUT_FLOOR_S = 60.0
SLOW_BYTES_PER_S = 1e9


@dataclass(frozen=True)
class SendConfig:
    """How a sender joins the workers and pushes to them.

    The wire geometry (``packed``, ``buffer_size_bytes``, ``num_buffers``)
    is sent to the workers at init, so both sides cut chunks alike; vLLM's
    defaults are 1 GiB x 2. Deadlines are in seconds: ``init_timeout_s``
    bounds init and warm-up; ``send_timeout_s`` bounds each wait of a push
    (a broadcast, a copy, the servers' answer after the last broadcast), by
    default 60 s plus the bytes of that wait at 1 GB/s; ``reconnect_timeout_s``
    bounds ``reconnect()``. ``staging_bytes`` bounds the device memory an
    asynchronous send (``send(wait=False)``) may take to snapshot what it
    sends; a push larger than that runs blocking instead (``None``: no
    bound, one extra copy of the pushed bytes, which a packed sender keeps
    for its next asynchronous push).
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
            raise MetadataError(f"packed must be a bool, got {self.packed!r}")
        for name in ("buffer_size_bytes", "num_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MetadataError(f"{name} must be a positive int, got {value!r}")
        for name in ("init_timeout_s", "send_timeout_s", "reconnect_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise MetadataError(f"{name} must be a positive number of seconds, "
                                    f"got {value!r}")
        if self.staging_bytes is not None and self.staging_bytes < 0:
            raise MetadataError(f"staging_bytes must be >= 0, got {self.staging_bytes!r}")

    def wait_timeout_s(self, nbytes: int) -> float:
        """The deadline of one wait that moves ``nbytes``."""
        if self.send_timeout_s is not None:
            return self.send_timeout_s
        return TIMEOUT_FLOOR_S + nbytes / SLOW_BYTES_PER_S
