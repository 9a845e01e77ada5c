"""Unique ids, communicators, collectives and groups over the loaded libnccl.

Two kinds of communicator, both with a way out of every wait:

* **blocking** (``ncclCommInitRankConfig`` with ``blocking=1``): what vLLM's
  workers use, and the fast one: a collective launches in the caller's
  thread, several times faster than a non-blocking one's, whose every call
  NCCL launches from a thread of its own (docs/benchmarks.md, "Figures
  behind the design").
  Its init cannot be interrupted, so with a deadline it runs on a daemon
  thread that the caller stops waiting for; if init ever returns after the
  deadline, that thread aborts what it made. Nothing ever aborts a
  communicator under a thread that is still inside one of its calls.
* **non-blocking** (``blocking=0``): every call returns at once
  (``ncclInProgress`` while NCCL works in the background) and this module
  polls ``ncclCommGetAsyncError`` against a deadline, aborting on expiry.

Either way, waits for the GPU poll events with a deadline and abort the
communicator when it passes, which also releases the kernels stuck in it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from . import cuda
from ._ffi import ffi
from .buffers import DeviceBuffer, as_buffer
from .dtypes import dtype_name, nccl_type
from .errors import InvalidUsageError, NcclTimeoutError
from .library import load_library, nccl_version
from .results import IN_PROGRESS, SUCCESS, make_error
from .results import check as check_rc
from .waiting import Deadline, Job, check_timeout, no_check, poll_until

UNIQUE_ID_BYTES = 128
DEFAULT_INIT_TIMEOUT = 300.0
DEFAULT_OP_TIMEOUT = 300.0

# What ``init_rank`` runs right after init: (the communicator, the seconds
# left, the check to poll).
Then = Callable[["Communicator", "float | None", Callable[[], None]], None]

_REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # the ncclConfig_t prefix declared in _cdef.py
_UNDEF_INT = -(2**31)


def get_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` as 128 bytes. Needs no GPU.

    The id embeds the bootstrap address of a listener in *this* process, so
    the process must outlive every rank's init.

    Returns:
        The id's ``UNIQUE_ID_BYTES`` raw bytes.

    Raises:
        NcclLibraryNotFound: no usable libnccl.
        NcclError: ``ncclGetUniqueId`` failed (e.g. no network interface to
            listen on).
    """
    uid = ffi.new("ncclUniqueId *")
    check_rc(load_library().ncclGetUniqueId(uid), "ncclGetUniqueId")
    return unique_id_to_bytes(uid[0])


def unique_id_from_bytes(raw: bytes) -> Any:
    """The C ``ncclUniqueId`` for 128 raw bytes.

    Args:
        raw: the id's bytes (``bytes``, ``bytearray`` or ``memoryview``).

    Returns:
        A cffi ``ncclUniqueId`` struct, as ``Communicator.init_rank`` takes it.

    Raises:
        TypeError: ``raw`` is not bytes-like.
        ValueError: ``raw`` is not ``UNIQUE_ID_BYTES`` long.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"a unique id is bytes, got {type(raw).__name__}")
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"a unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    uid = ffi.new("ncclUniqueId *")
    ffi.memmove(uid[0].internal, bytes(raw), UNIQUE_ID_BYTES)
    return uid[0]


def unique_id_to_bytes(uid: Any) -> bytes:
    """The 128 raw bytes of a C ``ncclUniqueId``.

    Args:
        uid: a cffi ``ncclUniqueId`` struct.

    Returns:
        Its ``UNIQUE_ID_BYTES`` bytes.
    """
    return bytes(ffi.buffer(uid.internal, UNIQUE_ID_BYTES))


def _config(blocking: bool) -> Any:
    cfg = ffi.new("ncclConfig_t *")
    cfg.size = ffi.sizeof("ncclConfig_t")
    cfg.magic = _CONFIG_MAGIC
    cfg.version = _CONFIG_VERSION
    cfg.blocking = int(blocking)
    cfg.cgaClusterSize = cfg.minCTAs = cfg.maxCTAs = cfg.splitShare = _UNDEF_INT
    cfg.netName = ffi.NULL
    return cfg


def _stream_arg(stream: Any) -> Any:
    handle = 0 if stream is None else getattr(stream, "handle", stream)
    return ffi.cast("cudaStream_t", int(handle))


class Communicator:
    """One rank's NCCL communicator.

    Build it with ``Communicator.init_rank``. Collectives take raw device
    pointers (with ``count``/``dtype``) or array objects (see ``buffers.py``)
    and a CUDA stream handle; they only enqueue work. ``wait(stream)`` waits
    for it with a deadline. On any failure or expired deadline the
    communicator is aborted and cannot be used again: mint a new unique id
    and init again.

    Args:
        handle: the raw ``ncclComm_t`` (``init_rank`` makes it).
        nranks: the ranks in the communicator.
        rank: this process's rank in it.
        device: the CUDA ordinal it was made on.
        blocking: whether NCCL was told to make it blocking.
    """

    def __init__(self, handle: Any, *, nranks: int, rank: int, device: int, blocking: bool):
        self._handle = handle
        self._lock = threading.Lock()
        self.nranks = nranks
        self.rank = rank
        self.device = device
        self.blocking = blocking
        self.closed_reason = ""
        self.in_call_since = 0.0  # time.monotonic() while a thread is inside launch_broadcast

    # -- construction ---------------------------------------------------
    @classmethod
    def init_rank(cls, nranks: int, unique_id: bytes | Any, rank: int, device: int, *,
                  blocking: bool = False, timeout: float | None = DEFAULT_INIT_TIMEOUT,
                  check: Callable[[], None] | None = None,
                  then: Then | None = None) -> Communicator:
        """Join the communicator of ``nranks`` ranks named by ``unique_id`` as ``rank``.

        Every rank must call this concurrently; NCCL has no barrier before it.
        Returns once init completes, or raises ``NcclTimeoutError`` after ``timeout``
        seconds (``None``: wait for ever). ``check`` is called while waiting; if it
        raises (say, the server refused init), the init is given up and its exception
        propagates. ``then(comm, seconds_left, check)`` runs right after init under
        the same deadline (the warm-up); if it raises, the communicator is aborted.

        Non-blocking (default): given up means aborted. Blocking: the init runs on a
        daemon thread, and given up means abandoned: NCCL hands out the handle only
        when init returns, so nothing can abort it earlier. If it ever returns, the
        thread aborts the communicator itself.

        Args:
            nranks: every rank of the communicator.
            unique_id: the group's id: its 128 bytes, or a C ``ncclUniqueId``.
            rank: this process's rank, ``0 <= rank < nranks``.
            device: the CUDA ordinal to make it on.
            blocking: make a blocking communicator (as vLLM's workers use).
            timeout: seconds for the init and ``then`` together; None waits
                for ever.
            check: called while waiting; what it raises gives the init up.
            then: ``then(comm, seconds_left, check)``, run right after init.

        Returns:
            The communicator, open.

        Raises:
            ValueError: ``nranks``, ``rank`` or ``device`` out of range, or
                ``timeout`` not None nor 0 to ``MAX_TIMEOUT_S`` seconds.
            TypeError, ValueError: ``unique_id`` is not 128 bytes.
            NcclLibraryNotFound: no usable libnccl.
            CudaError: ``device`` cannot be made current.
            NcclTimeoutError: the other ranks did not join within ``timeout``.
            NcclError: NCCL refused the init (a version mismatch, a duplicate
                GPU, ...), or reported an error while it ran.
            BaseException: what ``check`` or ``then`` raised (the init given up).
        """
        _check_init_args(nranks, rank, device, timeout)
        uid = unique_id if isinstance(unique_id, ffi.CData) else unique_id_from_bytes(unique_id)
        why = _not_joined(rank, nranks, timeout)
        if blocking:
            return cls._init_blocking(nranks, uid, rank, device, timeout, check, then, why)
        with cuda.on_device(device):
            return cls._init_nonblocking(nranks, uid, rank, device, timeout, check, then, why)

    @classmethod
    def _init_nonblocking(cls, nranks: int, uid: Any, rank: int, device: int,
                          timeout: float | None, check: Callable[[], None] | None,
                          then: Then | None, why: str) -> Communicator:
        """A non-blocking init (and ``then``), aborted if it fails or stalls."""
        lib = load_library()
        out = ffi.new("ncclComm_t *")
        deadline = Deadline(timeout)
        rc = lib.ncclCommInitRankConfig(out, nranks, uid, rank, _config(blocking=False))
        if out[0] == ffi.NULL:
            raise make_error(rc if rc != SUCCESS else 3, "ncclCommInitRankConfig")
        comm = cls(out[0], nranks=nranks, rank=rank, device=device, blocking=False)
        if rc not in (SUCCESS, IN_PROGRESS):
            err = make_error(rc, "ncclCommInitRankConfig", out[0])
            comm.abort()
            raise err
        comm._settle("ncclCommInitRank", timeout, why, check)
        if then is not None:
            try:
                then(comm, deadline.left(), check or no_check)
            except BaseException:
                comm.abort("initialisation failed")
                raise
        return comm

    @classmethod
    def _init_blocking(cls, nranks: int, uid: Any, rank: int, device: int,
                       timeout: float | None, check: Callable[[], None] | None,
                       then: Then | None, why: str) -> Communicator:
        """A blocking init (and ``then``) on a kept thread (a ``Job``), waited
        for with a deadline; given up, it aborts what it made if it ever returns."""
        deadline = Deadline(timeout)

        def run(given_up: Callable[[], None]) -> Communicator:
            cuda.use_device(device)
            out = ffi.new("ncclComm_t *")
            rc = load_library().ncclCommInitRankConfig(out, nranks, uid, rank,
                                                       _config(blocking=True))
            comm = None if out[0] == ffi.NULL else cls(out[0], nranks=nranks, rank=rank,
                                                      device=device, blocking=True)
            try:
                if rc != SUCCESS:
                    raise make_error(rc, "ncclCommInitRankConfig", out[0] if comm else None)
                given_up()
                if then is not None:
                    then(comm, deadline.left(), given_up)
            except BaseException:
                if comm is not None:
                    comm.abort("init failed")
                raise
            return comm

        job = Job(run, name="nccl-init")
        try:
            if job.wait(deadline.at, check or no_check):
                return job.future.result()
            raise NcclTimeoutError(
                f"ncclCommInitRank did not complete within {timeout}s; the init was "
                f"abandoned (a blocking init cannot be aborted). {why}")
        except BaseException:
            job.stop(0.0)
            job.then(_abort_made)
            raise

    # -- state ----------------------------------------------------------
    @property
    def state(self) -> str:
        """``"open"``, or why it is closed (``closed_reason``: "destroyed", an
        abort's reason). Anything but ``"open"`` takes no more calls."""
        return "open" if self._handle is not None else (self.closed_reason or "destroyed")

    def _live(self) -> Any:
        if self._handle is None:
            raise InvalidUsageError(
                f"communicator is closed ({self.closed_reason or 'destroyed'}); "
                "mint a new unique id and init again"
            )
        return self._handle

    def raw(self) -> Any:
        """The open ``ncclComm_t``, for a library that runs its own collectives
        on this communicator (NCCL M2N's reshard, ``m2n.py``).

        Returns:
            The cffi ``ncclComm_t``.

        Raises:
            InvalidUsageError: the communicator is closed.
        """
        return self._live()

    def get_async_error(self) -> int:
        """``ncclCommGetAsyncError``: 0 ok, 7 in progress, else the failure code.

        Returns:
            The communicator's ``ncclResult_t`` state.

        Raises:
            InvalidUsageError: the communicator is closed.
            NcclError: the query itself failed.
        """
        with self._lock:
            handle = self._live()
            state = ffi.new("ncclResult_t *")
            check_rc(load_library().ncclCommGetAsyncError(handle, state), "ncclCommGetAsyncError")
            return int(state[0])

    def check_async(self, call: str = "NCCL") -> None:
        """Raise (and abort) if NCCL reported an asynchronous error.

        Args:
            call: what the error is reported for, in its message.

        Raises:
            NcclError: the error's subclass; the communicator is aborted.
            InvalidUsageError: the communicator is closed.
        """
        state = self.get_async_error()
        if state not in (SUCCESS, IN_PROGRESS):
            err = make_error(state, f"{call} (async)", self._handle)
            self.abort(f"async error {state}")
            raise err

    def _settle(self, call: str, timeout: float | None, why: str,
                check: Callable[[], None] | None = None) -> None:
        """Poll until NCCL finished the last call on a non-blocking comm."""
        poll_until(
            lambda: self.get_async_error() != IN_PROGRESS, timeout,
            check=self._guard(call, check),
            on_timeout=lambda: self._timeout(call, timeout, why),
        )
        self.check_async(call)

    def _guard(self, call: str, check: Callable[[], None] | None) -> Callable[[], None]:
        """``check``, aborting this communicator before its exception escapes."""
        def run() -> None:
            if check is None:
                return
            try:
                check()
            except BaseException:
                self.abort(f"{call} interrupted")
                raise
        return run

    def _timeout(self, call: str, timeout: float | None, why: str) -> NcclTimeoutError:
        self.abort(f"{call} timed out")
        return NcclTimeoutError(f"{call} did not complete within {timeout}s; "
                                f"communicator aborted. {why}")

    def abort(self, reason: str = "aborted") -> None:
        """``ncclCommAbort``: frees the communicator, unblocking any peer-waiting kernel.

        Aborting a closed communicator does nothing.

        Args:
            reason: why, kept as ``closed_reason`` (what ``state`` says).
        """
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is None:
                return
            self.closed_reason = reason
        with cuda.kept_context():  # NCCL sets the communicator's device
            load_library().ncclCommAbort(handle)

    def destroy(self, timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """Free the communicator; every wait on it has already returned.

        Non-blocking: finalize (flush outstanding work) then destroy, aborting
        if that stalls past ``timeout``. Blocking: ``ncclCommAbort``, because
        its ``ncclCommFinalize`` would wait, uninterruptibly, on every peer's
        outstanding work; with nothing outstanding the two free the same.
        Destroying a closed communicator does nothing; a finalize that fails
        or stalls aborts it instead of raising. ``finalize`` is the same call.

        Args:
            timeout: seconds a non-blocking finalize may take before the
                communicator is aborted; None waits for ever.

        Raises:
            NcclError: ``ncclCommGetAsyncError`` itself failed (nothing freed).
            CudaError: the communicator's device cannot be made current.
        """
        if self._handle is None:
            return
        if self.blocking or self.get_async_error() != SUCCESS:
            self.abort("destroyed")
            return
        lib = load_library()
        with cuda.on_device(self.device):
            rc = lib.ncclCommFinalize(self._live())
            if rc not in (SUCCESS, IN_PROGRESS):
                self.abort("finalize failed")
                return
            try:
                self._settle("ncclCommFinalize", timeout, "a peer still has work pending")
            except Exception:
                return  # already aborted
        with self._lock:
            handle, self._handle = self._handle, None
            self.closed_reason = "destroyed"
        if handle is not None:
            with cuda.kept_context():
                lib.ncclCommDestroy(handle)

    finalize = destroy

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.destroy()
        else:
            self.abort(f"{exc_type.__name__} in with-block")

    def _query(self, fn: str) -> int:
        out = ffi.new("int *")
        check_rc(getattr(load_library(), fn)(self._live(), out), fn, self._handle)
        return int(out[0])

    def count(self) -> int:
        """``ncclCommCount``: the number of ranks in the communicator.

        Returns:
            NCCL's answer.

        Raises:
            InvalidUsageError: the communicator is closed.
            NcclError: the query failed.
        """
        return self._query("ncclCommCount")

    def cu_device(self) -> int:
        """``ncclCommCuDevice``: the CUDA ordinal the communicator uses.

        Returns:
            NCCL's answer.

        Raises:
            InvalidUsageError: the communicator is closed.
            NcclError: the query failed.
        """
        return self._query("ncclCommCuDevice")

    def user_rank(self) -> int:
        """``ncclCommUserRank``: this process's rank in the communicator.

        Returns:
            NCCL's answer.

        Raises:
            InvalidUsageError: the communicator is closed.
            NcclError: the query failed.
        """
        return self._query("ncclCommUserRank")

    # -- collectives ----------------------------------------------------
    def _enqueue(self, call: str, rc: int, timeout: float | None) -> None:
        if rc not in (SUCCESS, IN_PROGRESS):
            err = make_error(rc, call, self._handle)
            self.abort(f"{call} failed")
            raise err
        if rc == IN_PROGRESS and not _in_group():
            self._settle(call, timeout, "a peer did not take part (connection setup stalled)")

    def _buffers(self, send: Any, recv: Any, count: int | None, dtype: Any,
                 stream: Any) -> tuple[DeviceBuffer, DeviceBuffer]:
        handle = None if stream is None else int(getattr(stream, "handle", stream))
        sbuf = as_buffer(send, count, dtype, handle)
        rbuf = sbuf if recv is None else as_buffer(recv, sbuf.count, sbuf.dtype, handle)
        return sbuf, rbuf

    def broadcast(self, send: Any, recv: Any = None, *, root: int, count: int | None = None,
                  dtype: Any = None, stream: Any = None,
                  timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """``ncclBroadcast`` from ``root``; in place when ``recv`` is None.

        Enqueues only: the broadcast is done once ``wait(stream)`` returns.

        Args:
            send: the source buffer (read on ``root`` only): a raw device
                pointer, a JAX array, or an object with
                ``__cuda_array_interface__`` or ``__dlpack__`` (``as_buffer``).
            recv: the destination buffer, of the same kind; None: ``send``.
            root: the rank that sends.
            count: elements; required with a raw pointer, else at
                most what the array holds (default: all of it).
            dtype: the element type (any spelling ``dtype_name`` takes);
                required with a raw pointer, else checked against the array.
            stream: the CUDA stream (a handle, or an object with ``.handle``)
                to enqueue on; None: the legacy default stream.
            timeout: seconds a non-blocking communicator may take to enqueue
                (``ncclInProgress``) before it is aborted; None waits for
                ever. Completion is waited for by ``wait``.

        Raises:
            TypeError, ValueError: a buffer ``as_buffer`` refuses, or a dtype
                this NCCL has no type for.
            ValueError: ``root`` is not a rank of the communicator.
            InvalidUsageError: the communicator is closed.
            NcclError: NCCL refused the call (the communicator is aborted).
            NcclTimeoutError: a non-blocking enqueue overran ``timeout``
                (the communicator is aborted).
        """
        sbuf, rbuf = self._buffers(send, recv, count, dtype, stream)
        if not 0 <= root < self.nranks:
            raise ValueError(f"root {root} is out of range for {self.nranks} ranks")
        with cuda.on_device(self.device):
            rc = load_library().ncclBroadcast(
                ffi.cast("void *", sbuf.ptr), ffi.cast("void *", rbuf.ptr), sbuf.count,
                nccl_type(sbuf.dtype, nccl_version()[1]), root, self._live(),
                _stream_arg(stream))
            self._enqueue("ncclBroadcast", rc, timeout)

    def launch_broadcast(self, ptr: int, count: int, nccl_dtype: int, root: int,
                         stream: int, timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """``ncclBroadcast`` in place on raw integers (a device pointer, an
        element count, an ``ncclDataType_t`` code, a ``CUstream`` handle): the
        hot path of a push, which has checked all of them once beforehand.
        The calling thread's current device must be this communicator's.

        While the call runs, ``in_call_since`` holds when it began, so a
        watcher can tell a call that does not return.

        Args:
            ptr: the device pointer, sent from on ``root`` and received into
                elsewhere.
            count: elements.
            nccl_dtype: the ``ncclDataType_t`` code (``nccl_type``).
            root: the rank that sends.
            stream: the ``CUstream`` handle to enqueue on.
            timeout: seconds a non-blocking communicator may take to enqueue
                before it is aborted; None waits for ever.

        Raises:
            InvalidUsageError: the communicator is closed.
            NcclError: NCCL refused the call (the communicator is aborted).
            NcclTimeoutError: a non-blocking enqueue overran ``timeout``
                (the communicator is aborted).
        """
        self.in_call_since = time.monotonic()
        try:
            rc = load_library().ncclBroadcast(ffi.cast("void *", ptr), ffi.cast("void *", ptr),
                                              count, nccl_dtype, root, self._live(),
                                              ffi.cast("cudaStream_t", stream))
        finally:
            self.in_call_since = 0.0
        if rc != SUCCESS:
            self._enqueue("ncclBroadcast", rc, timeout)

    def all_reduce(self, send: Any, recv: Any = None, *, op: str = "sum",
                   count: int | None = None, dtype: Any = None, stream: Any = None,
                   timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """``ncclAllReduce``; in place when ``recv`` is None.

        Enqueues only: the reduction is done once ``wait(stream)`` returns.

        Args:
            send: the input buffer (any kind ``as_buffer`` takes).
            recv: the output buffer; None: ``send``.
            op: ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` or ``"avg"``.
            count: elements; required with a raw pointer, else at
                most what the array holds (default: all of it).
            dtype: the element type (any spelling ``dtype_name`` takes);
                required with a raw pointer, else checked against the array.
            stream: the CUDA stream (a handle, or an object with ``.handle``)
                to enqueue on; None: the legacy default stream.
            timeout: seconds a non-blocking communicator may take to enqueue
                (``ncclInProgress``) before it is aborted; None waits for
                ever. Completion is waited for by ``wait``.

        Raises:
            ValueError: an unknown ``op``.
            TypeError, ValueError: a buffer ``as_buffer`` refuses, or a dtype
                this NCCL has no type for.
            InvalidUsageError: the communicator is closed.
            NcclError: NCCL refused the call (the communicator is aborted).
            NcclTimeoutError: a non-blocking enqueue overran ``timeout``
                (the communicator is aborted).
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        sbuf, rbuf = self._buffers(send, recv, count, dtype, stream)
        with cuda.on_device(self.device):
            rc = load_library().ncclAllReduce(
                ffi.cast("void *", sbuf.ptr), ffi.cast("void *", rbuf.ptr), sbuf.count,
                nccl_type(sbuf.dtype, nccl_version()[1]), _REDUCE_OPS[op], self._live(),
                _stream_arg(stream))
            self._enqueue("ncclAllReduce", rc, timeout)

    def send(self, buf: Any, *, peer: int, count: int | None = None, dtype: Any = None,
             stream: Any = None, timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """``ncclSend`` to ``peer``.

        Enqueues only; the matching call of ``peer`` must be enqueued too,
        in a ``group`` when one rank both sends and receives.

        Args:
            buf: the buffer to send (any kind ``as_buffer`` takes).
            peer: the rank that receives; not this one.
            count: elements; required with a raw pointer, else at
                most what the array holds (default: all of it).
            dtype: the element type (any spelling ``dtype_name`` takes);
                required with a raw pointer, else checked against the array.
            stream: the CUDA stream (a handle, or an object with ``.handle``)
                to enqueue on; None: the legacy default stream.
            timeout: seconds a non-blocking communicator may take to enqueue
                (``ncclInProgress``) before it is aborted; None waits for
                ever. Completion is waited for by ``wait``.

        Raises:
            TypeError, ValueError: a buffer ``as_buffer`` refuses, or a dtype
                this NCCL has no type for.
            ValueError: ``peer`` is not another rank of the communicator.
            InvalidUsageError: the communicator is closed.
            NcclError: NCCL refused the call (the communicator is aborted).
            NcclTimeoutError: a non-blocking enqueue overran ``timeout``
                (the communicator is aborted).
        """
        self._p2p("ncclSend", buf, peer, count, dtype, stream, timeout)

    def recv(self, buf: Any, *, peer: int, count: int | None = None, dtype: Any = None,
             stream: Any = None, timeout: float | None = DEFAULT_OP_TIMEOUT) -> None:
        """``ncclRecv`` from ``peer``.

        Enqueues only; the matching call of ``peer`` must be enqueued too,
        in a ``group`` when one rank both sends and receives.

        Args:
            buf: the buffer to receive into (any kind ``as_buffer`` takes).
            peer: the rank that sends; not this one.
            count: elements; required with a raw pointer, else at
                most what the array holds (default: all of it).
            dtype: the element type (any spelling ``dtype_name`` takes);
                required with a raw pointer, else checked against the array.
            stream: the CUDA stream (a handle, or an object with ``.handle``)
                to enqueue on; None: the legacy default stream.
            timeout: seconds a non-blocking communicator may take to enqueue
                (``ncclInProgress``) before it is aborted; None waits for
                ever. Completion is waited for by ``wait``.

        Raises:
            TypeError, ValueError: a buffer ``as_buffer`` refuses, or a dtype
                this NCCL has no type for.
            ValueError: ``peer`` is not another rank of the communicator.
            InvalidUsageError: the communicator is closed.
            NcclError: NCCL refused the call (the communicator is aborted).
            NcclTimeoutError: a non-blocking enqueue overran ``timeout``
                (the communicator is aborted).
        """
        self._p2p("ncclRecv", buf, peer, count, dtype, stream, timeout)

    def _p2p(self, call: str, buf: Any, peer: int, count: int | None, dtype: Any,
             stream: Any, timeout: float | None) -> None:
        b, _ = self._buffers(buf, None, count, dtype, stream)
        self._check_peer(peer)
        with cuda.on_device(self.device):
            rc = getattr(load_library(), call)(ffi.cast("void *", b.ptr), b.count,
                                               nccl_type(b.dtype, nccl_version()[1]), peer,
                                               self._live(), _stream_arg(stream))
            self._enqueue(call, rc, timeout)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.nranks or peer == self.rank:
            raise ValueError(f"peer {peer} is not another rank of {self.nranks}")

    def wait(self, stream: Any = None, timeout: float | None = DEFAULT_OP_TIMEOUT,
             what: str = "collective", check: Callable[[], None] | None = None) -> None:
        """Wait until the work enqueued on ``stream`` is done, polling NCCL's errors.

        Past ``timeout`` the communicator is aborted (which also releases the
        stuck kernels) and ``NcclTimeoutError`` is raised.

        Args:
            stream: the CUDA stream (a handle, or an object with ``.handle``);
                None: the legacy default stream.
            timeout: seconds to wait at most; None waits for ever.
            what: what is waited for, in error messages.
            check: called between polls; what it raises ends the wait.

        Raises:
            NcclTimeoutError: not done within ``timeout`` (the communicator
                is aborted).
            NcclError: NCCL reported an asynchronous error (aborted).
            InvalidUsageError: the communicator is closed.
            CudaError: the event to wait on cannot be made or recorded.
            BaseException: what ``check`` raised (the communicator is aborted).
        """
        with cuda.on_device(self.device):
            event = cuda.Event(self.device).record(0 if stream is None else
                                                   getattr(stream, "handle", stream))
        try:
            self.wait_event(event, timeout, what, check)
        finally:
            event.close()

    def wait_event(self, event: cuda.Event, timeout: float | None,
                   what: str = "collective", check: Callable[[], None] | None = None) -> None:
        """Wait for ``event`` with a deadline, surfacing NCCL async errors.

        ``check`` runs between polls; if it raises, the communicator is aborted.

        Args:
            event: a recorded ``cuda.Event``.
            timeout: seconds to wait at most; None waits for ever.
            what: what is waited for, in error messages.
            check: called between polls; what it raises ends the wait.

        Raises:
            NcclTimeoutError: not done within ``timeout`` (the communicator
                is aborted).
            NcclError: NCCL reported an asynchronous error (aborted).
            InvalidUsageError: the communicator is closed.
            CudaError: querying the event failed.
            BaseException: what ``check`` raised (the communicator is aborted).
        """
        guard = self._guard(what, check)

        def watch() -> None:
            self.check_async(what)
            guard()

        poll_until(
            event.done, timeout, check=watch,
            on_timeout=lambda: self._timeout(
                what, timeout, "a peer stopped taking part (died, or is blocked elsewhere)"),
        )


def _check_init_args(nranks: Any, rank: Any, device: Any, timeout: Any) -> None:
    """``init_rank``'s arguments, refused before NCCL is called."""
    if not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be a positive int, got {nranks!r}")
    if not isinstance(rank, int) or not 0 <= rank < nranks:
        raise ValueError(f"rank {rank!r} is out of range for nranks {nranks}")
    if not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be a CUDA ordinal, got {device!r}")
    check_timeout("the init's timeout", timeout, optional=True, zero=True)


def _not_joined(rank: int, nranks: int, timeout: float | None) -> str:
    """What an init that timed out says: why the other ranks may not have come."""
    return (f"rank {rank} of {nranks} waited {timeout}s for the other ranks to join: check "
            "that every peer got the same unique id and world size and entered init "
            "(vLLM: /init_weight_transfer_engine)")



def _abort_made(init: Future[Communicator]) -> None:
    """An abandoned init's cleanup: abort the communicator it made, if any."""
    if not init.cancelled() and init.exception() is None:
        init.result().abort("init given up")


_group_depth = threading.local()


def _in_group() -> bool:
    return getattr(_group_depth, "n", 0) > 0


@contextlib.contextmanager
def group(*comms: Communicator, timeout: float | None = DEFAULT_OP_TIMEOUT) -> Iterator[None]:
    """``ncclGroupStart`` / ``ncclGroupEnd`` as a context manager.

    Pass the non-blocking communicators used inside so the end of the group
    can wait (with ``timeout``) for NCCL to finish enqueuing on each. Groups
    nest; only the outermost end launches.

    Args:
        *comms: the communicators used inside the group.
        timeout: seconds each non-blocking one may take to finish enqueuing
            at the end; None waits for ever.

    Raises:
        NcclLibraryNotFound: no usable libnccl.
        NcclError: ``ncclGroupStart`` or ``ncclGroupEnd`` failed (at the end,
            ``comms`` are aborted).
        NcclTimeoutError: a non-blocking communicator did not finish
            enqueuing within ``timeout`` (it is aborted).
    """
    lib = load_library()
    check_rc(lib.ncclGroupStart(), "ncclGroupStart")
    _group_depth.n = getattr(_group_depth, "n", 0) + 1
    try:
        yield
    finally:
        _group_depth.n -= 1
        with cuda.kept_context():  # the end launches, on the communicators' device
            rc = lib.ncclGroupEnd()
    if rc not in (SUCCESS, IN_PROGRESS):
        err = make_error(rc, "ncclGroupEnd")
        for c in comms:
            c.abort("ncclGroupEnd failed")
        raise err
    if not _in_group():
        for c in comms:
            if not c.blocking:
                c._settle("ncclGroupEnd", timeout, "a peer did not take part")


__all__ = ["Communicator", "group", "get_unique_id", "unique_id_from_bytes",
           "unique_id_to_bytes", "dtype_name", "UNIQUE_ID_BYTES"]
