"""The root of this package's errors, kept apart so every module can use it."""


class RendezvousError(RuntimeError):
    """The root of ``uniqueid``'s errors: joining or talking to the workers
    failed (a bad id, an HTTP error, a server that cannot be reached, an
    init that was refused or timed out). After a failed join the trainer's
    communicator has been given up."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Joining the workers did not finish within the deadline."""


class ServerStuck(RendezvousTimeout):
    """A server's weight-transfer engine does not answer: its workers are
    most likely inside an NCCL call whose peer left, which vLLM gives no
    deadline; only a restart of that server frees them."""


class StoreError(RendezvousError):
    """The metadata store refused a call, went away, or a peer broke its
    protocol."""


class StoreTimeout(StoreError, RendezvousTimeout):
    """A metadata-store call did not finish within its deadline."""
