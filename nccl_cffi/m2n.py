"""NCCL M2N's reshard (``libnccl_m2n``, from NVIDIA's ``nccl-extensions``),
bound with cffi over the libnccl this package loaded.

Why a binding of its own rather than the ``nccl.m2n`` package: a reshard
runs on a communicator, and the communicator must be this package's (its
deadlines, its aborts, the libnccl chosen by ``library.py``); ``nccl.m2n``
takes its communicators from nccl4py, which loads libnccl its own way and
pulls in ``cuda-core``. ``libnccl_m2n`` itself is the real library: this
module only finds it, checks that it runs over the same libnccl, and calls
its four functions (``ncclM2nInit``, ``ncclReshard``, ``ncclM2nFinalize``,
``ncclM2nGetLastError``).

Two rules of the library shape what follows. It imports NCCL's symbols by
the soname ``libnccl.so.2``, so the libnccl this package chose is loaded
first and the binding is checked afterwards (a process with a second
libnccl in its global scope would bind M2N to that one). And it is
"process-wide single-thread": every call into it, on any communicator, is
made under one lock, waited for within a deadline (a reshard into a peer
that is gone may never return, and holds the library for good).

Raw layer: integers (device pointers, stream handles, dtype codes,
placement codes) and ``DistTensor`` descriptors; ``Handle`` is the small
core over it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ._ffi import ffi
from .errors import InvalidUsageError, NcclLibraryNotFound, NcclTimeoutError
from .library import cut_short, library_info, load_library
from .results import SUCCESS, make_error

MIN_NCCL = (2, 30, 5)
API_VERSION = 2  # NCCL_M2N_API_VERSION of the structs declared in _cdef.py
_CONFIG_MAGIC = 0x4D324E32  # 'M2N2'
_UNDEF_INT = -(2**31)
REPLICATE = -1  # NCCL_RESHARD_REPLICATE; a placement >= 0 shards that tensor dimension
MAX_TENSOR_DIMS = 3
MESH_NDIMS = 2
_ENV_VAR = "NCCL_M2N_LIBRARY"
_INSTALL = "pip install 'nccl-extensions[cu13]'"

_native = threading.RLock()  # the library is process-wide single-thread
# How long a call waits for the library while another thread is inside it.
NATIVE_WAIT_S = 60.0
_lock = threading.Lock()
_lib: Any = None
_path = ""


@dataclass(frozen=True, kw_only=True)
class DistTensor:
    """One side of a reshard as this rank sees it (``ncclDistTensor_t``).

    Attributes:
        ptr: this rank's buffer on this side, or 0 where it is not on the
            side's mesh.
        local_shape: a rank's block of the tensor on this side (1 to 3 dims),
            given on every rank.
        dtype: the ``ncclDataType_t`` code.
        mesh: the side's mesh, ``(rows, columns)`` of ranks.
        start_rank: its first rank; the mesh holds ``rows * columns``
            consecutive ranks from there, row-major.
        placements: per mesh axis, ``REPLICATE`` or the tensor dimension it
            splits.
    """

    ptr: int
    local_shape: tuple[int, ...]
    dtype: int
    mesh: tuple[int, int]
    start_rank: int
    placements: tuple[int, int]

    def to_c(self) -> tuple[Any, list[Any]]:
        """The C descriptor, and what must stay alive while it is used."""
        dims = ffi.new("int[]", list(self.mesh))
        mesh = ffi.new("ncclMesh_t *", {"size": ffi.sizeof("ncclMesh_t"),
                                         "version": API_VERSION, "ndims": MESH_NDIMS,
                                         "dims": dims, "startRank": self.start_rank})
        shape = ffi.new("size_t[]", list(self.local_shape))
        placements = ffi.new("int[]", list(self.placements))
        desc = ffi.new("ncclDistTensor_t *", {
            "size": ffi.sizeof("ncclDistTensor_t"), "version": API_VERSION,
            "dataPtr": ffi.cast("void *", self.ptr), "localShape": shape,
            "ndims": len(self.local_shape), "dtype": self.dtype, "mesh": mesh,
            "placements": placements})
        return desc, [dims, mesh, shape, placements]


def _cuda_major() -> int:
    """The CUDA major the process runs (``cuda.bindings``), which picks the
    build of ``libnccl_m2n`` in the wheel."""
    try:
        from cuda import bindings
    except ImportError:
        return 13
    return int(bindings.__version__.split(".", 1)[0])


def _wheel_path() -> str | None:
    """``libnccl_m2n.so`` of an installed ``nccl-extensions``, found on
    ``sys.path`` without importing ``nccl.m2n`` (which would load nccl4py)."""
    rel = Path("nccl", "m2n", "lib", f"cu{_cuda_major()}", "libnccl_m2n.so")
    for entry in sys.path:
        candidate = Path(entry or ".", rel)
        if candidate.is_file():
            return str(candidate.resolve())
    return None


def _symbol_address(handle: int, name: bytes) -> int:
    libdl = ctypes.CDLL(None)
    libdl.dlsym.restype = ctypes.c_void_p
    libdl.dlsym.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
    return libdl.dlsym(ctypes.c_void_p(handle), name) or 0


def _check_binding(path: str) -> None:
    """Refuse an M2N library bound to another libnccl than this package's:
    the communicator would be handed to a library that did not make it."""
    ours = library_info().path
    m2n = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    nccl = ctypes.CDLL(ours, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    mine = _symbol_address(nccl._handle, b"ncclGetVersion")
    seen = _symbol_address(m2n._handle, b"ncclGetVersion")
    default = _symbol_address(0, b"ncclGetVersion")  # RTLD_DEFAULT: the global scope
    if seen != mine or default not in (0, mine):
        raise NcclLibraryNotFound(_bound_elsewhere(path, ours))


def _other_libnccl(ours: str) -> list[str]:
    """Every other ``libnccl.so*`` mapped into this process (``/proc/self/maps``),
    e.g. the one JAX loads from the ``nvidia-nccl-cu13`` wheel."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libnccl.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/")
                  and os.path.realpath(p) != os.path.realpath(ours))


def _bound_elsewhere(path: str, ours: str) -> str:
    """Why ``libnccl_m2n`` binds to the wrong libnccl, and the fix: it takes the
    first ``libnccl.so.2`` the process loaded, whatever path this package chose."""
    first = ", ".join(_other_libnccl(ours)) or "another libnccl.so.2"
    return (f"{path} binds to {first}, loaded into this process before {ours} (the one this "
            "package uses; JAX loads the nvidia-nccl-cu13 wheel's): pip install "
            f"'nvidia-nccl-cu13>=2.30.5' so that both are one file, or start Python with "
            f"LD_PRELOAD={ours}")


def _check_version() -> None:
    info = library_info()
    if info.version < MIN_NCCL:
        raise NcclLibraryNotFound(
            f"NCCL M2N needs NCCL >= {'.'.join(map(str, MIN_NCCL))}, but the loaded libnccl is "
            f"{'.'.join(map(str, info.version))} ({info.path}, chosen by {info.source}): "
            "pip install 'nvidia-nccl-cu13>=2.30.5' or point NCCL_LIBRARY at a newer "
            "libnccl.so.2, the same on every rank")


def load_m2n(path: str | os.PathLike | None = None) -> Any:
    """Open ``libnccl_m2n`` once per process, over this package's libnccl.

    Search order: ``path``, ``$NCCL_M2N_LIBRARY``, the ``nccl-extensions``
    wheel (its build for the CUDA major of ``cuda.bindings``).

    Args:
        path: the file to load.

    Returns:
        The cffi library object.

    Raises:
        NcclLibraryNotFound: the loaded libnccl is older than 2.30.5, no
            ``libnccl_m2n`` is found or loads, or it binds to another libnccl.
    """
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        load_library()
        _check_version()
        source = "path argument" if path else f"${_ENV_VAR}"
        chosen = os.fspath(path) if path else os.environ.get(_ENV_VAR) or None
        if chosen is None:
            chosen, source = _wheel_path(), "the nccl-extensions wheel"
        if chosen is None or not os.path.isfile(chosen):
            raise NcclLibraryNotFound(
                f"no libnccl_m2n found ({source}: {chosen or 'not installed'}): {_INSTALL}, "
                f"or point {_ENV_VAR} at its libnccl_m2n.so")
        real = os.path.realpath(chosen)
        short = cut_short(real)  # dlopen would die of SIGBUS
        if short:
            raise NcclLibraryNotFound(f"libnccl_m2n chosen by {source}: {short}: reinstall it "
                                      f"({_INSTALL})")
        try:
            lib = ffi.dlopen(real, ffi.RTLD_NOW | ffi.RTLD_LOCAL)
        except OSError as e:
            ours = library_info().path
            if _other_libnccl(ours):
                raise NcclLibraryNotFound(_bound_elsewhere(chosen, ours)) from None
            raise NcclLibraryNotFound(
                f"libnccl_m2n at {chosen} (chosen by {source}) did not load ({e}): "
                f"reinstall it ({_INSTALL}) for this machine's CUDA") from None
        _check_binding(real)
        _lib, _path = lib, real
        return _lib


def m2n_path() -> str:
    """The loaded ``libnccl_m2n``'s file (loading it first).

    Returns:
        Its path, symlinks resolved.

    Raises:
        NcclLibraryNotFound: as ``load_m2n``.
    """
    load_m2n()
    return _path


def last_error() -> str:
    """``ncclM2nGetLastError``: the library's detail of its last failure on
    this thread ("" where it has none).

    Returns:
        Its text.
    """
    text = load_m2n().ncclM2nGetLastError()
    return ffi.string(text).decode(errors="replace") if text != ffi.NULL else ""


def _check(rc: int, call: str) -> None:
    if rc != SUCCESS:
        detail = last_error()
        err = make_error(rc, call)
        if detail:
            err = type(err)(f"{err}: {detail}", code=err.code, last_error=detail)
        raise err


@contextlib.contextmanager
def _inside(call: str) -> Iterator[None]:
    """The library to this thread alone, waited for within ``NATIVE_WAIT_S``:
    a call another thread made and that never returned (a reshard into a
    peer that is gone) holds it for good, and later calls must not wait for ever."""
    if not _native.acquire(timeout=NATIVE_WAIT_S):
        raise NcclTimeoutError(
            f"{call} waited {NATIVE_WAIT_S:.0f}s for libnccl_m2n, which another call of this "
            "process is still inside (an earlier reshard that did not return): NCCL M2N runs "
            "one call at a time per process, so restart this process to use it again")
    try:
        yield
    finally:
        _native.release()


@cache
def _config_size() -> int:
    return ffi.sizeof("ncclM2nConfig_t")


def init(max_cta: int | None = None) -> Any:
    """``ncclM2nInit``: a handle for reshards (raw layer).

    Args:
        max_cta: the most CTAs a reshard kernel uses; None: the library's
            default (or ``NCCL_RESHARD_MAX_CTA``).

    Returns:
        The ``ncclM2nHandle_t``.

    Raises:
        NcclLibraryNotFound: as ``load_m2n``.
        NcclTimeoutError: another call is stuck inside the library.
        NcclError: the library refused.
    """
    lib = load_m2n()
    config = ffi.new("ncclM2nConfig_t *", {"size": _config_size(), "magic": _CONFIG_MAGIC,
                                            "version": API_VERSION,
                                            "maxCta": _UNDEF_INT if max_cta is None else max_cta})
    out = ffi.new("ncclM2nHandle_t *")
    with _inside("ncclM2nInit"):
        _check(lib.ncclM2nInit(out, config), "ncclM2nInit")
    return out[0]


def finalize(handle: Any) -> None:
    """``ncclM2nFinalize`` (raw layer): every reshard of ``handle`` must be done.

    Args:
        handle: from ``init``.

    Raises:
        NcclTimeoutError: another call is stuck inside the library.
        NcclError: the library refused.
    """
    with _inside("ncclM2nFinalize"):
        _check(load_m2n().ncclM2nFinalize(handle), "ncclM2nFinalize")


def reshard(handle: Any, comm: Any, src: DistTensor, dst: DistTensor, stream: int) -> None:
    """``ncclReshard`` (raw layer): enqueue one reshard on ``stream``.

    Every rank of ``comm`` calls it for the same tensor, in the same order.
    The first reshard on a communicator sets up its windows, a step every
    rank takes together, so the call may wait for the other ranks.

    Args:
        handle: from ``init``.
        comm: the raw ``ncclComm_t``.
        src: the source side; ``ptr`` 0 off the source mesh.
        dst: the destination side; ``ptr`` 0 off the destination mesh.
        stream: the ``CUstream`` handle.

    Raises:
        NcclTimeoutError: another call is stuck inside the library.
        NcclError: the library refused the descriptors, or NCCL failed.
    """
    s, keep_s = src.to_c()
    d, keep_d = dst.to_c()
    with _inside("ncclReshard"):
        rc = load_m2n().ncclReshard(handle, comm, s, d, ffi.cast("cudaStream_t", stream))
        _check(rc, "ncclReshard")
    del keep_s, keep_d


class Handle:
    """An M2N handle, used by one communicator's reshards.

    Args:
        max_cta: the most CTAs a reshard kernel uses (None: the library's).

    Raises:
        NcclLibraryNotFound: as ``load_m2n``.
        NcclError: ``ncclM2nInit`` failed.
    """

    def __init__(self, max_cta: int | None = None):
        self._handle: Any = init(max_cta)

    def reshard(self, comm: Any, src: DistTensor, dst: DistTensor, stream: int) -> None:
        """One reshard on ``comm`` (a ``Communicator``), enqueued on ``stream``.

        While it runs, ``comm.in_call_since`` says since when (a watcher
        tells a call that does not return: a peer gone during the first
        reshard's setup).

        Args:
            comm: the ``Communicator`` holding every rank of both sides.
            src, dst: the two sides (``DistTensor``).
            stream: the ``CUstream`` handle.

        Raises:
            InvalidUsageError: the handle is finalized or ``comm`` closed.
            NcclError: the reshard failed (``comm`` is aborted).
        """
        if self._handle is None:
            raise InvalidUsageError("this M2N handle is finalized")
        comm.in_call_since = time.monotonic()
        try:
            reshard(self._handle, comm.raw(), src, dst, stream)
        except Exception:
            comm.abort("ncclReshard failed")
            raise
        finally:
            comm.in_call_since = 0.0

    def finalize(self) -> None:
        """Release the handle (its reshards must be done); again: nothing."""
        handle, self._handle = self._handle, None
        if handle is not None:
            finalize(handle)

    @property
    def open(self) -> bool:
        """Whether the handle takes reshards."""
        return self._handle is not None


__all__ = ["API_VERSION", "DistTensor", "Handle", "MAX_TENSOR_DIMS", "MESH_NDIMS", "MIN_NCCL",
           "REPLICATE", "finalize", "init", "last_error", "load_m2n", "m2n_path", "reshard"]
