"""Typed NCCL errors: one subclass per ``ncclResult_t``.

The classes alone, importing nothing, so that every module (the library
loader among them) can raise them; ``results.py`` turns a failed call's
result code into one of them, with NCCL's own text.
"""

from __future__ import annotations


class NcclError(RuntimeError):
    """The root of this package's errors. For a failed NCCL call, ``code`` is
    its ``ncclResult_t`` and ``last_error`` NCCL's own detail; errors this
    package raises itself (a deadline, a missing library) keep their class's
    code. Picklable: they cross process boundaries in multi-process trainers.

    Args:
        message: what failed, and the fix where there is one.
        code: the ``ncclResult_t``; None: the class's ``code``.
        last_error: NCCL's ``ncclGetLastError`` text ("" where none).
    """

    code: int = -1

    def __init__(self, message: str, *, code: int | None = None, last_error: str = ""):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.last_error = last_error

    def __reduce__(self):
        return _rebuild, (type(self), str(self), self.code, self.last_error)


def _rebuild(cls: type, message: str, code: int, last_error: str) -> NcclError:
    return cls(message, code=code, last_error=last_error)


class NcclLibraryNotFound(NcclError, OSError):
    """No usable libnccl: an explicit choice that does not load, or nothing
    found at all; the message says what was tried and how to fix it."""


class CudaError(NcclError):
    """A CUDA driver call failed, or there is no driver or GPU to use."""


class UnhandledCudaError(NcclError):
    """``ncclUnhandledCudaError`` (1): a CUDA call inside NCCL failed."""

    code = 1


class NcclSystemError(NcclError):
    """``ncclSystemError`` (2): a system call inside NCCL failed (sockets,
    memory, shared memory)."""

    code = 2


class InternalError(NcclError):
    """``ncclInternalError`` (3): an internal check of NCCL failed (a bug in
    NCCL, or memory corruption); also an init that reported success but
    returned no handle."""

    code = 3


class InvalidArgumentError(NcclError, ValueError):
    """``ncclInvalidArgument`` (4): NCCL refused an argument (a bad pointer,
    rank, count or type); a ``ValueError`` too."""

    code = 4


class InvalidUsageError(NcclError):
    """``ncclInvalidUsage`` (5): a call NCCL refuses as used; also a call on
    a communicator that is closed (aborted or destroyed)."""

    code = 5


class RemoteError(NcclError):
    """``ncclRemoteError`` (6): a peer failed, most likely a network error or
    a remote process that exited early."""

    code = 6


class NcclTimeoutError(NcclError, TimeoutError):
    """NCCL reported a timeout, or one of this package's deadlines expired."""

    code = 8


BY_CODE: dict[int, type[NcclError]] = {cls.code: cls for cls in (
    UnhandledCudaError, NcclSystemError, InternalError, InvalidArgumentError,
    InvalidUsageError, RemoteError, NcclTimeoutError)}
"""The error class of each ``ncclResult_t`` this package names (others: ``NcclError``)."""
