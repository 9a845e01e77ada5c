"""Stand-ins for a C library (libnccl, libcuda) that cffi marshals like the real one.

Every function of ``c_library`` is a C function pointer (``ffi.callback``)
with the signature ``nccl_cffi/_cdef.py`` declares for that name, around a
Python function. So a call from the binding goes through the same argument
conversion as a call into the real library: a Python ``int`` where C takes a
pointer, a negative count where it takes a ``size_t``, a missing argument,
all raise as they would against libnccl. The Python side receives what C
would have received (pointers as cdata, integers as ints) and records it.

An exception inside a stand-in cannot cross into C: it is kept in
``errors`` (the tests assert it stays empty) and the C call returns an
error code instead.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

from nccl_cffi._cdef import CDEF
from nccl_cffi._ffi import ffi

# "ncclResult_t ncclBroadcast(const void *sendbuff, ...);" in CDEF: return type, name, parameters.
_DECLARATION = re.compile(r"^[ \t]*((?:const[ \t]+)?\w+[ \t]*\**)[ \t]*((?:nccl|cu)\w+)\(([^)]*)\);",
                          re.M)
SIGNATURES: dict[str, str] = {
    m.group(2): f"{m.group(1).strip()}({' '.join(m.group(3).split())})"
    for m in _DECLARATION.finditer(CDEF)
}
# What a stand-in that raised returns: ncclInternalError, a CUDA code no call returns, NULL.
_ON_ERROR = {"ncclResult_t": 3, "int": 999}


def address(pointer: Any) -> int:
    """A cdata pointer (``void *``, ``ncclComm_t``, ...) as the integer C holds."""
    return int(ffi.cast("uintptr_t", pointer))


def c_string(text: str, keep: list) -> Any:
    """``const char *`` to a NUL-terminated copy of ``text``, alive while ``keep`` is."""
    buf = ffi.new("char[]", text.encode())
    keep.append(buf)
    return ffi.cast("char *", buf)


def c_library(impls: dict[str, Callable[..., Any]], errors: list[BaseException]) -> Any:
    """A library object whose attribute ``name`` calls ``impls[name]`` through
    a C function pointer of ``name``'s declared signature; names not given
    are absent (as in an older libnccl). Exceptions go to ``errors``."""
    lib = types.SimpleNamespace()
    for name, fn in impls.items():
        ret, params = SIGNATURES[name].split("(", 1)
        ctype = ffi.typeof(f"{ret}(*)({params}")

        def onerror(exc_type, exc, tb, _name=name):
            errors.append(exc if exc is not None else exc_type())

        error = _ON_ERROR.get(ret.strip())
        cb = ffi.callback(ctype, fn, onerror=onerror) if error is None else \
            ffi.callback(ctype, fn, error=error, onerror=onerror)
        setattr(lib, name, cb)
    return lib
