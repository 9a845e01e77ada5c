"""A failed NCCL call's result code as a typed error, with NCCL's own text.

Each error carries the result code, ``ncclGetErrorString`` and, where the
library has it, ``ncclGetLastError`` (the detailed reason NCCL logged, e.g.
"Mismatched NCCL version detected"). Two failures that users hit at init get
a hint that says what to do.
"""

from __future__ import annotations

from typing import Any

from ._ffi import ffi
from .errors import BY_CODE, NcclError
from .library import has_symbol, load_library

SUCCESS = 0
IN_PROGRESS = 7

__all__ = ["IN_PROGRESS", "SUCCESS", "check", "error_string", "last_error", "make_error"]

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
    """``ncclGetErrorString(code)``: NCCL's one-line name of a result code.

    Args:
        code: an ``ncclResult_t``.

    Returns:
        NCCL's text for it.
    """
    return ffi.string(load_library().ncclGetErrorString(code)).decode(errors="replace")


def last_error(comm: Any = None) -> str:
    """``ncclGetLastError``: the detail NCCL logged for its last failure.

    Args:
        comm: the raw ``ncclComm_t`` concerned, or None.

    Returns:
        NCCL's text, or "" where the library lacks the call.
    """
    if not has_symbol("ncclGetLastError"):
        return ""
    text = load_library().ncclGetLastError(comm if comm is not None else ffi.NULL)
    return ffi.string(text).decode(errors="replace") if text != ffi.NULL else ""


def make_error(code: int, call: str, comm: Any = None) -> NcclError:
    """The typed error for result ``code`` returned by ``call``.

    Args:
        code: the ``ncclResult_t`` the call returned.
        call: the NCCL function's name, for the message.
        comm: the raw ``ncclComm_t`` concerned, for ``ncclGetLastError``.

    Returns:
        An instance of the code's ``NcclError`` subclass, with a fix where
        the failure is one users cause.
    """
    detail = last_error(comm)
    msg = f"{call} failed: {error_string(code)} (ncclResult_t {code})"
    if detail:
        msg += f": {detail}"
    for needle, hint in _HINTS:
        if needle in detail:
            msg += f". Fix: {hint}"
    cls = BY_CODE.get(code, NcclError)
    return cls(msg, code=code, last_error=detail)


def check(code: int, call: str, comm: Any = None) -> int:
    """Raise the typed error for a failed result; pass success and in-progress through.

    Args:
        code: the ``ncclResult_t`` ``call`` returned.
        call: the NCCL function's name.
        comm: the raw ``ncclComm_t`` concerned.

    Returns:
        ``code`` (``SUCCESS`` or ``IN_PROGRESS``).

    Raises:
        NcclError: the code's subclass, for any other code.
    """
    if code not in (SUCCESS, IN_PROGRESS):
        raise make_error(code, call, comm)
    return code
