"""``SendStats``: what one push moved and where its time went."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SendStats:
    """What one push moved and where its time went (seconds).

    Attributes:
        bytes: the bytes of every tensor pushed.
        tensors: how many tensors.
        chunks: broadcasts made (packed chunks, or one per tensor).
        packed: whether the push was packed.
        reused_metadata: whether every ``/update_weights`` posted empty lists
            (vLLM's "same as last time").
        prepare_s: ``send()`` called -> the first HTTP call (validation, planning).
        start_s: ``/start_weight_update`` (and the wait for the arrays to be
            computed).
        transfer_s: posting ``/update_weights`` -> every server answered.
        update_s: the ``/update_weights`` calls themselves, timed inside
            their threads (the slowest server's).
        finish_s: ``/finish_weight_update``.
        broadcast_s: the first broadcast launched -> the last one done (host
            clock).
        host_s: host time getting and packing tensors, inside ``transfer_s``.
        link_s: GPU time from the end of each round's first broadcast to its last.
        link_bytes: the bytes sent in ``link_s``.
        returned_s: ``send()`` called -> it returned (all of it when blocking).
    """

    bytes: int
    tensors: int
    chunks: int
    packed: bool
    reused_metadata: bool
    prepare_s: float = 0.0
    start_s: float = 0.0
    transfer_s: float = 0.0  # posting /update_weights -> every server answered
    # the /update_weights calls themselves, timed inside their threads (the
    # slowest server's), as vLLM's torch engine is timed: transfer_s less handoffs
    update_s: float = 0.0
    finish_s: float = 0.0
    broadcast_s: float = 0.0  # first broadcast launched -> last one done (host clock)
    host_s: float = 0.0  # host time getting and packing tensors, inside transfer_s
    link_s: float = 0.0  # GPU time from the end of each round's first broadcast to its last
    link_bytes: int = 0  # the bytes sent in link_s
    returned_s: float = 0.0  # send() called -> it returned (all of it when blocking)

    @property
    def total_s(self) -> float:
        """The push from ``send()`` to its end: prepare, start, transfer and finish."""
        return self.prepare_s + self.start_s + self.transfer_s + self.finish_s

    @property
    def transfer_gbps(self) -> float:
        """``bytes`` over ``transfer_s``, in GB/s (1e9 bytes a second); 0.0 when untimed."""
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0

    def __str__(self) -> str:
        return (f"{self.bytes / 1e9:.3f} GB, {self.tensors} tensors, {self.chunks} "
                f"{'chunks' if self.packed else 'broadcasts'}: prepare {self.prepare_s:.3f}s, "
                f"start {self.start_s:.3f}s, transfer {self.transfer_s:.3f}s "
                f"({self.transfer_gbps:.1f} GB/s; broadcasts {self.broadcast_s:.3f}s), "
                f"finish {self.finish_s:.3f}s")
