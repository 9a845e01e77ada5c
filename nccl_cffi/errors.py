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
    code. Picklable: they cross process boundaries in multi-process trainers."""

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
    code = 1


class NcclSystemError(NcclError):
    code = 2


class InternalError(NcclError):
    code = 3


class InvalidArgumentError(NcclError, ValueError):
    code = 4


class InvalidUsageError(NcclError):
    code = 5


class RemoteError(NcclError):
    code = 6


class NcclTimeoutError(NcclError, TimeoutError):
    """NCCL reported a timeout, or one of this package's deadlines expired."""

    code = 8


BY_CODE: dict[int, type[NcclError]] = {cls.code: cls for cls in (
    UnhandledCudaError, NcclSystemError, InternalError, InvalidArgumentError,
    InvalidUsageError, RemoteError, NcclTimeoutError)}
"""The error class of each ``ncclResult_t`` this package names (others: ``NcclError``)."""
