"""``Communicator`` on CPU, over a stand-in for libnccl and for the CUDA calls.

The stand-in library (``FakeNccl``) is made of C function pointers with
the signatures ``_cdef.py`` declares (``support.fake_c``): every argument a
``Communicator`` passes goes through cffi's conversion as it would into the
real libnccl, and the stand-in records what C received (addresses, counts,
type and op codes, the config struct) together with the device current on
the calling thread. Its answers (result codes, async states, an init that
blocks) are set by each test. The ``cuda`` calls are stand-ins too
(``FakeCuda``): a per-thread current device, and events a test completes.

What this shows that the GPU tests cannot show cheaply: every C argument,
every error code's translation, and every way out of a wait (a deadline, a
refused check, an async error), each of which must leave the communicator
aborted exactly once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

import nccl_cffi
import nccl_cffi.comm as comm_mod
from nccl_cffi import (
    Communicator,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    NcclError,
    NcclSystemError,
    NcclTimeoutError,
    RemoteError,
    UnhandledCudaError,
    group,
    results,
)
from nccl_cffi._ffi import ffi

from support.fake_c import address, c_library, c_string

HANDLE = 0x5EED0  # the ncclComm_t the stand-in hands out
UID = bytes(range(128))
# What ncclGetErrorString says for each result code (nccl.h's ncclResult_t).
NCCL_TEXT = {0: "no error", 1: "unhandled cuda error", 2: "unhandled system error",
             3: "internal error", 4: "invalid argument", 5: "invalid usage",
             6: "remote process exited or there was a network error",
             7: "NCCL operation in progress", 8: "timeout", 9: "unknown result code"}
CLASSES = {1: UnhandledCudaError, 2: NcclSystemError, 3: InternalError, 4: InvalidArgumentError,
           5: InvalidUsageError, 6: RemoteError, 8: NcclTimeoutError}
SLACK = 1.5  # seconds a deadline may be overrun on a loaded machine


class FakeEvent:
    """A CUDA event: ``record`` notes the stream handle; done once ``finished``."""

    def __init__(self, device: int, current: int | None):
        self.device, self.current_at_creation = device, current
        self.stream: int | None = None
        self.finished = False
        self.closed = 0

    def record(self, stream: int) -> FakeEvent:
        self.stream = stream
        return self

    def done(self) -> bool:
        return self.finished

    def close(self) -> None:
        self.closed += 1


class FakeCuda:
    """The ``cuda`` calls ``comm.py`` makes: a current device per thread
    (``on_device`` for a block, ``use_device`` for good, ``kept_context``
    restoring it), and ``Event``s that ``finish_events`` completes."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.events: list[FakeEvent] = []
        self.finish_events = True
        self.used: list[tuple[int, str]] = []  # (device, thread name) per use_device

    def current(self) -> int | None:
        return getattr(self._local, "device", None)

    def kept(self) -> int:
        return getattr(self._local, "kept", 0)

    @contextlib.contextmanager
    def kept_context(self):
        before = self.current()
        self._local.kept = self.kept() + 1
        try:
            yield
        finally:
            self._local.kept -= 1
            self._local.device = before

    @contextlib.contextmanager
    def on_device(self, ordinal: int):
        with self.kept_context():
            self._local.device = ordinal
            yield

    def use_device(self, ordinal: int) -> None:
        self._local.device = ordinal
        self.used.append((ordinal, threading.current_thread().name))

    def Event(self, device: int, *, timing: bool = False) -> FakeEvent:  # noqa: N802
        e = FakeEvent(device, self.current())
        e.finished = self.finish_events
        self.events.append(e)
        return e


@dataclass
class Call:
    name: str
    args: dict[str, Any]
    device: int | None  # the calling thread's current device
    kept: bool  # inside kept_context (the caller's context restored afterwards)
    thread: str = field(default="")


class FakeNccl:
    """libnccl's calls as a ``Communicator`` makes them. ``rc[name]``: the
    code a call returns (a list: one per call, the last repeated);
    ``async_states``: what ``ncclCommGetAsyncError`` reports, one per call,
    the last repeated; ``init_gate``: an event ``ncclCommInitRankConfig``
    waits on before returning (a blocking init that does not return)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.calls: list[Call] = []
        self.rc: dict[str, int | list[int]] = {}
        self.async_states: list[int] = [0]
        self.last_error = ""
        self.init_gate: threading.Event | None = None
        self.init_entered = threading.Event()
        self.aborted = threading.Event()
        self.errors: list[BaseException] = []
        self._keep: list[Any] = []
        self._lock = threading.Lock()
        names = ("ncclGetUniqueId", "ncclGetErrorString", "ncclGetLastError",
                 "ncclCommInitRankConfig", "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort",
                 "ncclCommGetAsyncError", "ncclCommCount", "ncclCommCuDevice", "ncclCommUserRank",
                 "ncclBroadcast", "ncclAllReduce", "ncclSend", "ncclRecv", "ncclGroupStart",
                 "ncclGroupEnd")
        self.lib = c_library({n: getattr(self, "_" + n) for n in names}, self.errors)

    # -- bookkeeping -------------------------------------------------------
    def _record(self, name: str, **args: Any) -> int:
        with self._lock:
            self.calls.append(Call(name, args, self.cuda.current(), self.cuda.kept() > 0,
                                   threading.current_thread().name))
            rc = self.rc.get(name, 0)
            if isinstance(rc, list):
                rc = rc.pop(0) if len(rc) > 1 else rc[0]
            return rc

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def names(self) -> list[str]:
        return [c.name for c in self.calls if c.name not in ("ncclGetErrorString",
                                                              "ncclGetLastError")]

    # -- the C functions -------------------------------------------------
    def _ncclGetUniqueId(self, uid):
        ffi.memmove(uid.internal, UID, 128)
        return self._record("ncclGetUniqueId")

    def _ncclGetErrorString(self, code):
        return c_string(NCCL_TEXT.get(code, "unknown result code"), self._keep)

    def _ncclGetLastError(self, comm):
        self._record("ncclGetLastError", comm=address(comm))
        return c_string(self.last_error, self._keep) if self.last_error else ffi.NULL

    def _ncclCommInitRankConfig(self, out, nranks, uid, rank, cfg):
        rc = self._record("ncclCommInitRankConfig", nranks=nranks, rank=rank,
                          uid=bytes(ffi.buffer(uid.internal, 128)),
                          config=dict(size=cfg.size, magic=cfg.magic, version=cfg.version,
                                      blocking=cfg.blocking, cgaClusterSize=cfg.cgaClusterSize,
                                      minCTAs=cfg.minCTAs, maxCTAs=cfg.maxCTAs,
                                      splitShare=cfg.splitShare,
                                      netName=address(cfg.netName)))
        self.init_entered.set()
        if self.init_gate is not None:
            self.init_gate.wait(30)
        if rc in (0, 7) or self.rc.get("handle_on_error", True):
            out[0] = ffi.cast("ncclComm_t", HANDLE)
        return rc

    def _ncclCommFinalize(self, comm):
        return self._record("ncclCommFinalize", comm=address(comm))

    def _ncclCommDestroy(self, comm):
        return self._record("ncclCommDestroy", comm=address(comm))

    def _ncclCommAbort(self, comm):
        rc = self._record("ncclCommAbort", comm=address(comm))
        self.aborted.set()
        return rc

    def _ncclCommGetAsyncError(self, comm, state):
        rc = self._record("ncclCommGetAsyncError", comm=address(comm))
        with self._lock:
            state[0] = self.async_states.pop(0) if len(self.async_states) > 1 else \
                self.async_states[0]
        return rc

    def _query(self, name, comm, out, value):
        out[0] = value
        return self._record(name, comm=address(comm))

    def _ncclCommCount(self, comm, out):
        return self._query("ncclCommCount", comm, out, 4)

    def _ncclCommCuDevice(self, comm, out):
        return self._query("ncclCommCuDevice", comm, out, 3)

    def _ncclCommUserRank(self, comm, out):
        return self._query("ncclCommUserRank", comm, out, 2)

    def _ncclBroadcast(self, send, recv, count, dtype, root, comm, stream):
        return self._record("ncclBroadcast", send=address(send), recv=address(recv), count=count,
                            dtype=dtype, root=root, comm=address(comm), stream=address(stream))

    def _ncclAllReduce(self, send, recv, count, dtype, op, comm, stream):
        return self._record("ncclAllReduce", send=address(send), recv=address(recv), count=count,
                            dtype=dtype, op=op, comm=address(comm), stream=address(stream))

    def _ncclSend(self, buf, count, dtype, peer, comm, stream):
        return self._record("ncclSend", buf=address(buf), count=count, dtype=dtype, peer=peer,
                            comm=address(comm), stream=address(stream))

    def _ncclRecv(self, buf, count, dtype, peer, comm, stream):
        return self._record("ncclRecv", buf=address(buf), count=count, dtype=dtype, peer=peer,
                            comm=address(comm), stream=address(stream))

    def _ncclGroupStart(self):
        return self._record("ncclGroupStart")

    def _ncclGroupEnd(self):
        return self._record("ncclGroupEnd")


@pytest.fixture
def nccl(monkeypatch):
    """The stand-ins installed where ``comm.py`` and ``results.py`` look them up."""
    cuda = FakeCuda()
    fake = FakeNccl(cuda)
    monkeypatch.setattr(comm_mod, "cuda", cuda)
    monkeypatch.setattr(comm_mod, "load_library", lambda: fake.lib)
    monkeypatch.setattr(comm_mod, "nccl_version", lambda: ((2, 30, 7), 23007))
    monkeypatch.setattr(results, "load_library", lambda: fake.lib)
    monkeypatch.setattr(results, "has_symbol", lambda name: hasattr(fake.lib, name))
    yield fake
    if fake.init_gate is not None:
        fake.init_gate.set()  # let an abandoned init thread go
    assert fake.errors == []


def open_comm(*, blocking: bool = False, nranks: int = 4, rank: int = 0,
              device: int = 1) -> Communicator:
    return Communicator(ffi.cast("ncclComm_t", HANDLE), nranks=nranks, rank=rank, device=device,
                        blocking=blocking)


# -- unique ids ---------------------------------------------------------------

def test_get_unique_id_returns_the_128_bytes_nccl_wrote(nccl):
    """``get_unique_id`` hands ``ncclGetUniqueId`` a struct to fill and
    returns exactly its bytes: the id every worker is told."""
    assert nccl_cffi.get_unique_id() == UID
    nccl.rc["ncclGetUniqueId"] = 2
    with pytest.raises(NcclSystemError, match="ncclGetUniqueId failed: unhandled system error"):
        nccl_cffi.get_unique_id()


# -- non-blocking init ----------------------------------------------------------

def test_nonblocking_init_passes_its_config_and_polls_until_nccl_is_done(nccl):
    """A non-blocking init returns ``ncclInProgress`` at once; the
    communicator is handed over only once ``ncclCommGetAsyncError`` stops
    saying in progress. The C call gets the rank, the world, the id's bytes
    and an ``ncclConfig_t`` whose prefix NCCL reads by size, magic and
    version, with every field not set left "undefined" (NCCL's defaults),
    all on the communicator's device."""
    nccl.rc["ncclCommInitRankConfig"] = 7
    nccl.async_states = [7, 7, 7, 0]
    comm = Communicator.init_rank(4, UID, 2, 3, timeout=10)
    (init,) = nccl.named("ncclCommInitRankConfig")
    undef = -(2**31)
    assert init.args == dict(nranks=4, rank=2, uid=UID, config=dict(
        size=ffi.sizeof("ncclConfig_t"), magic=0xCAFEBEEF, version=21400, blocking=0,
        cgaClusterSize=undef, minCTAs=undef, maxCTAs=undef, splitShare=undef, netName=0))
    assert init.device == 3 and nccl.cuda.current() is None  # the caller's context restored
    polls = nccl.named("ncclCommGetAsyncError")
    assert len(polls) >= 4 and {p.args["comm"] for p in polls} == {HANDLE}
    assert (comm.state, comm.blocking, comm.rank, comm.nranks, comm.device) == ("open", False, 2, 4, 3)
    assert not nccl.named("ncclCommAbort")


def test_nonblocking_init_past_its_deadline_is_aborted(nccl):
    """An init whose peers never come stays in progress; past ``timeout``
    the communicator is aborted (freeing NCCL's bootstrap) and the error
    says what to check."""
    nccl.rc["ncclCommInitRankConfig"] = 7
    nccl.async_states = [7]
    t = time.monotonic()
    with pytest.raises(NcclTimeoutError, match="did not complete within 0.3s; communicator "
                                               "aborted.*same unique id"):
        Communicator.init_rank(2, UID, 0, 0, timeout=0.3)
    assert 0.3 <= time.monotonic() - t < 0.3 + SLACK
    (abort,) = nccl.named("ncclCommAbort")
    assert abort.args["comm"] == HANDLE and abort.kept


@pytest.mark.parametrize("code", [2, 5, 6])
def test_nonblocking_init_refused_raises_the_typed_error_and_aborts(nccl, code):
    """An init NCCL refuses at once (a handle made, the code an error)
    raises the code's class with NCCL's text and frees the handle."""
    nccl.rc["ncclCommInitRankConfig"] = code
    nccl.last_error = "Mismatched NCCL version detected"
    with pytest.raises(CLASSES[code]) as err:
        Communicator.init_rank(2, UID, 0, 0, timeout=5)
    assert str(err.value).startswith(f"ncclCommInitRankConfig failed: {NCCL_TEXT[code]} "
                                     f"(ncclResult_t {code}): Mismatched NCCL version detected")
    assert "Fix:" in str(err.value) and err.value.last_error == "Mismatched NCCL version detected"
    assert [c.args["comm"] for c in nccl.named("ncclCommAbort")] == [HANDLE]


def test_nonblocking_init_that_makes_no_handle_raises_without_abort(nccl):
    """No handle (NULL) means nothing to free: the error alone, even when
    NCCL says success (an internal error then)."""
    nccl.rc.update({"ncclCommInitRankConfig": 4, "handle_on_error": False})
    with pytest.raises(InvalidArgumentError, match="invalid argument"):
        Communicator.init_rank(2, UID, 0, 0, timeout=5)
    assert not nccl.named("ncclCommAbort")


def test_nonblocking_init_async_failure_is_raised_and_aborted(nccl):
    """A peer that fails while the init settles surfaces as the async code's
    error; the communicator is aborted with that reason."""
    nccl.rc["ncclCommInitRankConfig"] = 7
    nccl.async_states = [7, 6]
    with pytest.raises(RemoteError, match=r"ncclCommInitRank \(async\) failed"):
        Communicator.init_rank(2, UID, 0, 0, timeout=5)
    assert len(nccl.named("ncclCommAbort")) == 1


def test_nonblocking_init_check_and_then_failures_abort(nccl):
    """``check`` raising while the init waits (a server refused) gives the
    init up: aborted, its exception propagated. ``then`` (the warm-up) gets
    the communicator, the time left and the check; if it raises, the
    communicator is aborted."""
    nccl.rc["ncclCommInitRankConfig"] = 7
    nccl.async_states = [7]

    def refused() -> None:
        raise KeyError("server refused")

    with pytest.raises(KeyError, match="server refused"):
        Communicator.init_rank(2, UID, 0, 0, timeout=10, check=refused)
    assert len(nccl.named("ncclCommAbort")) == 1

    nccl.async_states = [0]
    seen = []

    def then(comm, left, check):
        seen.append((comm.state, left, check))
        raise ValueError("warm-up failed")

    with pytest.raises(ValueError, match="warm-up failed"):
        Communicator.init_rank(2, UID, 0, 0, timeout=10, then=then)
    ((state, left, check),) = seen
    assert state == "open" and 5 < left <= 10 and callable(check)
    assert len(nccl.named("ncclCommAbort")) == 2


# -- blocking init --------------------------------------------------------------

def test_blocking_init_runs_on_a_kept_thread_on_the_device(nccl):
    """A blocking init cannot be interrupted, so it runs on a kept
    ``nccl-init`` thread that first makes the device current; the config
    says blocking; ``then`` runs there too."""
    ran = []
    comm = Communicator.init_rank(3, UID, 1, 2, blocking=True, timeout=10,
                                  then=lambda c, left, check: ran.append(
                                      threading.current_thread().name))
    (init,) = nccl.named("ncclCommInitRankConfig")
    assert init.args["config"]["blocking"] == 1 and init.thread == "nccl-init"
    assert init.device == 2 and (2, "nccl-init") in nccl.cuda.used
    assert ran == ["nccl-init"] and comm.blocking and comm.state == "open"


def test_blocking_init_refused_raises_and_aborts_what_it_made(nccl):
    """A blocking init that returns an error raises it in the caller, the
    communicator it made aborted on the init's thread."""
    nccl.rc["ncclCommInitRankConfig"] = 5
    with pytest.raises(InvalidUsageError, match="ncclCommInitRankConfig failed: invalid usage"):
        Communicator.init_rank(2, UID, 0, 0, blocking=True, timeout=10)
    (abort,) = nccl.named("ncclCommAbort")
    assert abort.args["comm"] == HANDLE and abort.thread == "nccl-init"


def test_blocking_init_that_never_returns_is_abandoned_then_aborted(nccl):
    """Past the deadline the caller gets ``NcclTimeoutError`` while the
    init is still inside NCCL (nothing can be aborted yet: NCCL has not
    handed out the handle). When the init returns later, the communicator
    it made is aborted at once, so no group is left half-formed."""
    nccl.init_gate = threading.Event()
    t = time.monotonic()
    with pytest.raises(NcclTimeoutError, match="within 0.3s; the init was abandoned"):
        Communicator.init_rank(2, UID, 0, 0, blocking=True, timeout=0.3)
    assert 0.3 <= time.monotonic() - t < 0.3 + SLACK
    assert nccl.init_entered.wait(10) and not nccl.named("ncclCommAbort")
    nccl.init_gate.set()
    assert nccl.aborted.wait(10)
    (abort,) = nccl.named("ncclCommAbort")
    assert abort.args["comm"] == HANDLE and abort.thread == "nccl-init"


def test_blocking_init_given_up_by_check_aborts_what_it_makes(nccl):
    """``check`` raising while a blocking init waits ends the caller's wait
    with its exception; the init, once it returns, aborts what it made."""
    nccl.init_gate = threading.Event()

    def refused() -> None:
        if nccl.init_entered.is_set():
            raise KeyError("server refused")

    with pytest.raises(KeyError):
        Communicator.init_rank(2, UID, 0, 0, blocking=True, timeout=30, check=refused)
    nccl.init_gate.set()
    assert nccl.aborted.wait(10) and len(nccl.named("ncclCommAbort")) == 1


# -- argument marshalling -------------------------------------------------------

class Stream:
    handle = 0xABC0


def test_broadcast_passes_pointers_count_type_root_comm_and_stream(nccl):
    """``broadcast`` on a raw pointer is in place (send == recv), its dtype
    becomes the ``ncclDataType_t`` code, its stream object its handle, all
    on the communicator's device; with ``recv`` the two buffers differ."""
    comm = open_comm(device=1)
    comm.broadcast(0x7000, root=3, count=10, dtype="bfloat16", stream=Stream())
    comm.broadcast(0x7000, 0x9000, root=0, count=5, dtype="float32", stream=None)
    a, b = nccl.named("ncclBroadcast")
    assert a.args == dict(send=0x7000, recv=0x7000, count=10, dtype=9, root=3, comm=HANDLE,
                          stream=0xABC0)
    assert b.args == dict(send=0x7000, recv=0x9000, count=5, dtype=7, root=0, comm=HANDLE,
                          stream=0)
    assert a.device == b.device == 1 and nccl.cuda.current() is None
    with pytest.raises(ValueError, match="root 4 is out of range for 4 ranks"):
        comm.broadcast(0x7000, root=4, count=1, dtype="int8")
    assert len(nccl.named("ncclBroadcast")) == 2


@pytest.mark.parametrize("op,code", [("sum", 0), ("prod", 1), ("max", 2), ("min", 3), ("avg", 4)])
def test_all_reduce_passes_its_op_code(nccl, op, code):
    """Each reduction's name becomes NCCL's ``ncclRedOp_t`` code."""
    comm = open_comm()
    comm.all_reduce(0x1000, 0x2000, op=op, count=3, dtype="int64", stream=0x55)
    (call,) = nccl.named("ncclAllReduce")
    assert call.args == dict(send=0x1000, recv=0x2000, count=3, dtype=4, op=code, comm=HANDLE,
                             stream=0x55)


def test_all_reduce_refuses_an_unknown_op_before_nccl(nccl):
    """A reduction NCCL has no code for is refused before any C call (NCCL
    would read an out-of-range ``ncclRedOp_t``)."""
    with pytest.raises(ValueError, match="op must be one of"):
        open_comm().all_reduce(0x1000, op="mean", count=1, dtype="float32")
    assert not nccl.calls


def test_send_and_recv_pass_buffer_count_type_and_peer(nccl):
    """Point-to-point calls name the peer; a peer that is this rank or
    outside the group is refused before NCCL sees it."""
    comm = open_comm(rank=1)
    comm.send(0x3000, peer=2, count=7, dtype="float16", stream=0x10)
    comm.recv(0x4000, peer=0, count=8, dtype="uint8", stream=Stream())
    (send,), (recv,) = nccl.named("ncclSend"), nccl.named("ncclRecv")
    assert send.args == dict(buf=0x3000, count=7, dtype=6, peer=2, comm=HANDLE, stream=0x10)
    assert recv.args == dict(buf=0x4000, count=8, dtype=1, peer=0, comm=HANDLE, stream=0xABC0)
    assert send.device == recv.device == 1
    for peer in (1, 4, -1):
        with pytest.raises(ValueError, match="not another rank"):
            comm.send(0x3000, peer=peer, count=1, dtype="int8")
    assert len(nccl.calls) == 2


def test_launch_broadcast_passes_raw_integers_through(nccl):
    """The push's hot path: the pointer (in place), the count, the raw type
    code and the stream handle reach C unchanged; ``in_call_since`` is set
    while the thread is inside NCCL and cleared after."""
    comm = open_comm(blocking=True)
    inside = []
    orig = nccl._record

    def record(name, **args):
        inside.append(comm.in_call_since)
        return orig(name, **args)

    nccl._record = record
    comm.launch_broadcast(0xBEEF00, 12345, 11, 2, 0x77, timeout=5)
    (call,) = nccl.named("ncclBroadcast")
    assert call.args == dict(send=0xBEEF00, recv=0xBEEF00, count=12345, dtype=11, root=2,
                             comm=HANDLE, stream=0x77)
    assert inside[0] > 0 and comm.in_call_since == 0.0


def test_launch_broadcast_in_progress_on_a_nonblocking_comm_settles(nccl):
    """A non-blocking communicator's broadcast that returns in progress is
    waited for (NCCL still sets the connection up); outside a group only."""
    comm = open_comm()
    nccl.rc["ncclBroadcast"] = 7
    nccl.async_states = [7, 0]
    comm.launch_broadcast(0x100, 1, 1, 0, 0, timeout=5)
    assert nccl.names() == ["ncclBroadcast", "ncclCommGetAsyncError", "ncclCommGetAsyncError",
                            "ncclCommGetAsyncError"]


def test_queries_read_what_nccl_wrote(nccl):
    """``count``, ``cu_device`` and ``user_rank`` return what NCCL wrote into
    the int it was given, asked about this communicator."""
    comm = open_comm()
    assert (comm.count(), comm.cu_device(), comm.user_rank()) == (4, 3, 2)
    assert {c.args["comm"] for c in nccl.calls} == {HANDLE}


# -- error translation ----------------------------------------------------------

@pytest.mark.parametrize("code", sorted(CLASSES))
def test_each_error_code_raises_its_class_with_nccls_text_and_aborts(nccl, code):
    """A collective returning code N raises N's class, whose message carries
    ``ncclGetErrorString(N)`` and ``ncclGetLastError`` (asked about this
    communicator), and leaves the communicator aborted with the call named."""
    comm = open_comm()
    nccl.rc["ncclBroadcast"] = code
    nccl.last_error = "peer 3 closed its connection"
    with pytest.raises(CLASSES[code]) as err:
        comm.broadcast(0x100, root=0, count=1, dtype="float32")
    assert type(err.value) is CLASSES[code] and err.value.code == code
    assert str(err.value) == (f"ncclBroadcast failed: {NCCL_TEXT[code]} (ncclResult_t {code}): "
                              "peer 3 closed its connection")
    assert nccl.named("ncclGetLastError")[0].args["comm"] == HANDLE
    assert comm.state == "ncclBroadcast failed"
    assert [c.args["comm"] for c in nccl.named("ncclCommAbort")] == [HANDLE]


@pytest.mark.parametrize("call", ["all_reduce", "send", "recv", "launch_broadcast"])
def test_every_collective_translates_and_aborts(nccl, call):
    """The same for each collective: an unknown code is a plain ``NcclError``."""
    comm = open_comm(rank=0)
    name = {"all_reduce": "ncclAllReduce", "send": "ncclSend", "recv": "ncclRecv",
            "launch_broadcast": "ncclBroadcast"}[call]
    nccl.rc[name] = 9
    with pytest.raises(NcclError) as err:
        if call == "launch_broadcast":
            comm.launch_broadcast(0x100, 1, 7, 0, 0)
        elif call == "all_reduce":
            comm.all_reduce(0x100, count=1, dtype="float32")
        else:
            getattr(comm, call)(0x100, peer=1, count=1, dtype="float32")
    assert type(err.value) is NcclError and err.value.code == 9
    assert str(err.value).startswith(f"{name} failed: unknown result code (ncclResult_t 9)")
    assert comm.state == f"{name} failed" and len(nccl.named("ncclCommAbort")) == 1


def test_a_closed_communicator_takes_no_more_calls(nccl):
    """After an abort, a call raises ``InvalidUsageError`` naming why, and
    never reaches NCCL with a freed handle."""
    comm = open_comm()
    comm.abort("peer died")
    with pytest.raises(InvalidUsageError, match=r"communicator is closed \(peer died\)"):
        comm.broadcast(0x100, root=0, count=1, dtype="float32")
    with pytest.raises(InvalidUsageError):
        comm.count()
    assert nccl.names() == ["ncclCommAbort"]


# -- abort and destroy ------------------------------------------------------------

def test_abort_once_and_state_goes_from_open_to_the_reason(nccl):
    """``abort`` frees the handle once, inside ``kept_context`` (NCCL sets
    the device); a second abort, or a destroy after it, does nothing."""
    comm = open_comm()
    assert comm.state == "open"
    comm.abort("push cancelled")
    comm.abort("again")
    comm.destroy()
    assert comm.state == "push cancelled"
    (abort,) = nccl.named("ncclCommAbort")
    assert abort.kept and abort.args["comm"] == HANDLE
    assert nccl.names() == ["ncclCommAbort"]


def test_blocking_destroy_aborts(nccl):
    """A blocking communicator's finalize would wait, uninterruptibly, on
    every peer: destroy aborts instead."""
    comm = open_comm(blocking=True)
    comm.destroy()
    assert nccl.names() == ["ncclCommAbort"] and comm.state == "destroyed"


def test_nonblocking_destroy_finalizes_then_destroys(nccl):
    """A healthy non-blocking communicator: finalize (on its device), wait
    until NCCL is done, then destroy (inside kept_context); never abort."""
    comm = open_comm(device=2)
    nccl.rc["ncclCommFinalize"] = 7
    nccl.async_states = [0, 7, 7, 0]
    comm.destroy()
    names = nccl.names()
    assert names[:2] == ["ncclCommGetAsyncError", "ncclCommFinalize"]
    assert names[-1] == "ncclCommDestroy" and "ncclCommAbort" not in names
    assert set(names[2:-1]) == {"ncclCommGetAsyncError"}
    assert nccl.named("ncclCommFinalize")[0].device == 2
    assert nccl.named("ncclCommDestroy")[0].kept and comm.state == "destroyed"
    comm.destroy()
    assert nccl.names()[-1] == "ncclCommDestroy" and len(nccl.named("ncclCommDestroy")) == 1


@pytest.mark.parametrize("case", ["async error", "finalize refused", "finalize stalls"])
def test_nonblocking_destroy_aborts_when_it_cannot_finalize(nccl, case):
    """An async error, a refused finalize or a finalize that stalls past
    the timeout: destroy aborts (and never raises), nothing destroyed twice."""
    comm = open_comm()
    if case == "async error":
        nccl.async_states = [6]
    elif case == "finalize refused":
        nccl.rc["ncclCommFinalize"] = 2
    else:
        nccl.rc["ncclCommFinalize"] = 7
        nccl.async_states = [0, 7]
    comm.destroy(timeout=0.2)
    assert len(nccl.named("ncclCommAbort")) == 1 and not nccl.named("ncclCommDestroy")
    assert comm.state == {"async error": "destroyed", "finalize refused": "finalize failed",
                          "finalize stalls": "ncclCommFinalize timed out"}[case]


def test_with_block_destroys_or_aborts(nccl):
    """Leaving a ``with`` normally destroys; by an exception, aborts naming it."""
    with open_comm(blocking=True) as comm:
        pass
    assert comm.state == "destroyed"
    with pytest.raises(ZeroDivisionError), open_comm() as comm:
        1 / 0  # noqa: B018
    assert comm.state == "ZeroDivisionError in with-block"
    assert nccl.names() == ["ncclCommAbort", "ncclCommAbort"]


# -- waits ----------------------------------------------------------------------------

def test_wait_records_an_event_on_the_stream_and_closes_it(nccl):
    """``wait(stream)``: an event on the communicator's device, recorded on
    the stream's handle, polled until done, then destroyed."""
    comm = open_comm(device=2)
    comm.wait(Stream(), timeout=5)
    (event,) = nccl.cuda.events
    assert (event.device, event.current_at_creation, event.stream, event.closed) == \
        (2, 2, 0xABC0, 1)
    assert comm.state == "open"


def test_wait_event_past_its_deadline_aborts(nccl):
    """A broadcast whose peer stopped taking part never completes: past the
    timeout the communicator is aborted (freeing the stuck kernels) and
    ``NcclTimeoutError`` names the wait."""
    comm = open_comm()
    event = FakeEvent(0, None)
    t = time.monotonic()
    with pytest.raises(NcclTimeoutError, match="broadcast did not complete within 0.3s; "
                                               "communicator aborted. a peer stopped"):
        comm.wait_event(event, 0.3, "broadcast")
    assert 0.3 <= time.monotonic() - t < 0.3 + SLACK
    assert comm.state == "broadcast timed out" and len(nccl.named("ncclCommAbort")) == 1


def test_wait_event_ends_on_an_async_error_or_a_failed_check(nccl):
    """While it waits, NCCL's async errors and the caller's check are
    watched; either ends the wait with the communicator aborted."""
    comm = open_comm()
    nccl.async_states = [0, 6]
    with pytest.raises(RemoteError, match=r"broadcast \(async\) failed"):
        comm.wait_event(FakeEvent(0, None), 10, "broadcast")
    assert comm.state == "async error 6"

    comm = open_comm()
    nccl.async_states = [0]

    def cancelled() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        comm.wait_event(FakeEvent(0, None), 10, "packing copy", cancelled)
    assert comm.state == "packing copy interrupted"
    assert len(nccl.named("ncclCommAbort")) == 2


# -- groups ---------------------------------------------------------------------------

def test_group_defers_settling_to_its_end(nccl):
    """Inside ``group`` a non-blocking call in progress is not waited for
    (NCCL launches at group end); the end runs inside kept_context, then
    each non-blocking communicator settles; blocking ones do not."""
    a, b = open_comm(), open_comm(blocking=True)
    nccl.rc["ncclBroadcast"] = 7
    nccl.async_states = [7, 0]
    with group(a, b, timeout=5):
        a.broadcast(0x100, root=0, count=1, dtype="float32")
        assert nccl.names() == ["ncclGroupStart", "ncclBroadcast"]
    names = nccl.names()
    assert names[2] == "ncclGroupEnd" and nccl.named("ncclGroupEnd")[0].kept
    assert set(names[3:]) == {"ncclCommGetAsyncError"} and len(names) >= 5
    assert a.state == b.state == "open"


def test_group_end_failing_aborts_every_member(nccl):
    """A group whose end fails leaves no member half-launched: every
    communicator given to ``group`` is aborted and the typed error raised."""
    nccl.rc["ncclGroupEnd"] = 6
    a, b = open_comm(), open_comm(blocking=True)
    with pytest.raises(RemoteError, match="ncclGroupEnd failed"), group(a, b):
        pass
    assert a.state == b.state == "ncclGroupEnd failed"
    assert len(nccl.named("ncclCommAbort")) == 2
