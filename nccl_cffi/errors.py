"""Typed NCCL errors: one subclass per ``ncclResult_t``, with NCCL's own text.

Each error carries the result code, ``ncclGetErrorString`` and, where the
library has it, ``ncclGetLastError`` (the detailed reason NCCL logged, e.g.
"Mismatched NCCL version detected"). Two failures that users hit at init get
a hint that says what to do.
"""

from __future__ import annotations

from ._ffi import ffi

SUCCESS = 0
IN_PROGRESS = 7


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


_BY_CODE = {cls.code: cls for cls in (
    UnhandledCudaError, NcclSystemError, InternalError, InvalidArgumentError,
    InvalidUsageError, RemoteError, NcclTimeoutError)}

# Substrings of NCCL's last-error text -> what the user should do about them.
_HINTS = (
    ("Mismatched NCCL version",
     "every rank must load the same libnccl build: point NCCL_LIBRARY (or "
     "VLLM_NCCL_SO_PATH) at the libnccl.so.2 your vLLM server loads, or install "
     "the same nvidia-nccl-cu* wheel version on both sides; see `library_info()`"),
    ("Duplicate GPU",
     "two ranks are on the same GPU: give the trainer a GPU that no vLLM worker "
     "uses (CUDA_VISIBLE_DEVICES on either side)"),
)


def error_string(code: int) -> str:
    from .library import load_library
    return ffi.string(load_library().ncclGetErrorString(code)).decode(errors="replace")


def last_error(comm=None) -> str:
    from .library import has_symbol, load_library
    if not has_symbol("ncclGetLastError"):
        return ""
    text = load_library().ncclGetLastError(comm if comm is not None else ffi.NULL)
    return ffi.string(text).decode(errors="replace") if text != ffi.NULL else ""


def make_error(code: int, call: str, comm=None) -> NcclError:
    """The typed error for result ``code`` returned by ``call``."""
    detail = last_error(comm)
    msg = f"{call} failed: {error_string(code)} (ncclResult_t {code})"
    if detail:
        msg += f": {detail}"
    for needle, hint in _HINTS:
        if needle in detail:
            msg += f". Fix: {hint}"
    cls = _BY_CODE.get(code, NcclError)
    return cls(msg, code=code, last_error=detail)


def check(code: int, call: str, comm=None) -> int:
    """Raise the typed error for a failed result; pass success and in-progress through."""
    if code not in (SUCCESS, IN_PROGRESS):
        raise make_error(code, call, comm)
    return code
