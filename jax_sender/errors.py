"""The root of this package's errors, and its two branches."""


class TransferError(RuntimeError):
    """The root of ``jax_sender``'s errors. The cause, when there is one (an
    NCCL error, an HTTP answer, a deadline), is chained as ``__cause__``."""


class MetadataError(TransferError, ValueError):
    """Arrays and metadata disagree, or a tensor cannot travel: refused before
    anything was sent, so the transfer group is intact."""


class SendError(TransferError):
    """A push failed after it started; the communicator was given up and the
    sender is broken until ``reconnect()``."""


class GatherTimeout(SendError, TimeoutError):
    """A parameter's other owners (processes) did not join its gather in time."""
