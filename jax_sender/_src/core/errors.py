"""The root of this package's errors, and its branches.

Which class tells the caller what state things are in: ``MetadataError``
(nothing was sent), ``UpdateIncomplete`` (the push ended on the servers, the
sender is usable, the next push repairs it), ``SendError`` (the push ended
badly; ``sender.broken`` says whether ``reconnect()`` is needed).
"""


class TransferError(RuntimeError):
    """The root of ``jax_sender``'s errors. The cause, when there is one (an
    NCCL error, an HTTP answer, a deadline), is chained as ``__cause__``."""


class MetadataError(TransferError, ValueError):
    """Arrays, metadata or arguments a push cannot take: refused before
    anything reached a server, so the transfer group is intact."""


class SendError(TransferError):
    """A push failed after it started. If the communicator had to be given
    up (a peer gone, a deadline passed, a second Ctrl-C), the sender is
    broken until ``reconnect()``; otherwise it is usable."""


class UpdateIncomplete(SendError):
    """The push failed on the trainer's side after the servers had started
    the update; it was completed (the missing bytes as zeros) and finished
    on the servers, which now hold an incomplete update. The sender is
    usable, and its next push sends every tensor (no metadata reuse), which
    repairs it."""


class GatherTimeout(SendError, TimeoutError):
    """A parameter's other owners (processes) did not join its gather in time."""


class SenderClosed(TransferError):
    """The sender was closed; build a new one with ``connect``."""
