"""``nccl_cffi.cuda`` on CPU: what runs without a driver runs for real; the
rest over a stand-in ``cuda.bindings.driver`` and a stand-in libcuda.

Without a driver (this machine), the module must say so in one sentence
and never raise a loader traceback: ``device_count`` is 0, ``check_device``
names what is missing, and ``kept_context`` still runs its block (an abort
must run on a machine that lost its driver).

With one, the stand-in driver (``FakeDriver``) keeps a current context per
thread as CUDA does and records every call with the context current when
it was made; the per-chunk calls go through ``support.fake_c``, C function
pointers with the signatures ``_cdef.py`` declares, so what the module
passes is converted as libcuda would receive it. The tests check each
call's arguments and context, that contexts are put back, and that every
stream, event and allocation is destroyed exactly once (by ``close``, or
when collected).
"""

from __future__ import annotations

import enum
import gc
import sys
import threading
import types
from typing import Any

import pytest

import nccl_cffi.cuda as cuda
from nccl_cffi import CudaError
from nccl_cffi._ffi import ffi

from support.fake_c import address, c_library

CUresult = enum.IntEnum("CUresult", {
    "CUDA_SUCCESS": 0, "CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NO_DEVICE": 100, "CUDA_ERROR_NOT_READY": 600, "CUDA_ERROR_ILLEGAL_ADDRESS": 700})
OK = CUresult.CUDA_SUCCESS


def context(ordinal: int) -> int:
    """The stand-in's primary context of a device (0: none current)."""
    return 0xC0 + ordinal


class DynamicLibNotFoundError(Exception):
    """What cuda-python raises at ``cuInit`` when libcuda.so.1 is absent."""


def caches_clear() -> None:
    cuda._driver.cache_clear()
    cuda._raw.cache_clear()
    cuda._primary_context.cache_clear()


class FakeDriver(types.ModuleType):
    """``cuda.bindings.driver`` for ``count`` devices: a current context per
    thread, handles from a counter, ``fail[call]`` a code that call returns.
    ``log``: (call, arguments, the calling thread's current context)."""

    CUresult = CUresult
    CUstream_flags = enum.IntEnum("CUstream_flags", {"CU_STREAM_DEFAULT": 0,
                                                     "CU_STREAM_NON_BLOCKING": 1})
    CUevent_flags = enum.IntEnum("CUevent_flags", {"CU_EVENT_DEFAULT": 0,
                                                   "CU_EVENT_DISABLE_TIMING": 2})

    def __init__(self, count: int = 2):
        super().__init__("cuda.bindings.driver")
        self.count = count
        self.init: CUresult | Exception = OK
        self.fail: dict[str, CUresult] = {}
        self.log: list[tuple[str, tuple, int]] = []
        self._local = threading.local()
        self._next = 0x1000

    def current(self) -> int:
        return getattr(self._local, "ctx", 0)

    def _call(self, name: str, *args: Any) -> CUresult:
        self.log.append((name, args, self.current()))
        return self.fail.get(name, OK)

    def calls(self, name: str) -> list[tuple[tuple, int]]:
        return [(args, ctx) for n, args, ctx in self.log if n == name]

    def _handle(self) -> int:
        self._next += 0x10
        return self._next

    def cuInit(self, flags):  # noqa: N802
        if isinstance(self.init, Exception):
            raise self.init
        return (self.init,)

    def cuGetErrorName(self, err):  # noqa: N802
        return OK, CUresult(err).name.encode()

    def cuDeviceGetCount(self):  # noqa: N802
        return self._call("cuDeviceGetCount"), self.count

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return self._call("cuDeviceGet", ordinal), ordinal

    def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
        return self._call("cuDevicePrimaryCtxRetain", dev), context(dev)

    def cuCtxGetCurrent(self):  # noqa: N802
        return OK, self.current()

    def cuCtxSetCurrent(self, ctx):  # noqa: N802
        rc = self._call("cuCtxSetCurrent", int(ctx))
        if rc == OK:
            self._local.ctx = int(ctx)
        return (rc,)

    def cuStreamCreate(self, flags):  # noqa: N802
        return self._call("cuStreamCreate", flags), self._handle()

    def cuStreamDestroy(self, stream):  # noqa: N802
        return (self._call("cuStreamDestroy", stream),)

    def cuEventCreate(self, flags):  # noqa: N802
        return self._call("cuEventCreate", flags), self._handle()

    def cuEventDestroy(self, event):  # noqa: N802
        return (self._call("cuEventDestroy", event),)

    def cuMemAlloc(self, nbytes):  # noqa: N802
        return self._call("cuMemAlloc", nbytes), self._handle() << 16

    def cuMemsetD8(self, ptr, value, nbytes):  # noqa: N802
        return (self._call("cuMemsetD8", ptr, value, nbytes),)

    def cuMemFree(self, ptr):  # noqa: N802
        return (self._call("cuMemFree", ptr),)


class FakeLibcuda:
    """The five libcuda calls ``_cdef.py`` declares, as C function pointers
    recording into the driver's log; ``query[event]``: ``cuEventQuery``'s code."""

    def __init__(self, driver: FakeDriver):
        self.d = driver
        self.query: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self.lib = c_library({
            "cuMemcpyDtoDAsync_v2": lambda dst, src, n, s: self.d._call(
                "cuMemcpyDtoDAsync_v2", dst, src, n, address(s)),
            "cuEventRecord": lambda e, s: self.d._call("cuEventRecord", address(e), address(s)),
            "cuEventQuery": lambda e: self.query.get(address(e), 0),
            "cuStreamWaitEvent": lambda s, e, flags: self.d._call(
                "cuStreamWaitEvent", address(s), address(e), flags),
            "cuEventElapsedTime": self._elapsed,
        }, self.errors)

    def _elapsed(self, out, start, end):
        out[0] = 1500.0  # milliseconds
        return self.d._call("cuEventElapsedTime", address(start), address(end))


class FfiWithLibcuda:
    """The module's ``ffi``, whose ``dlopen`` hands out the stand-in libcuda."""

    def __init__(self, lib: Any):
        self.lib, self.opened = lib, []

    def dlopen(self, name: str, *flags: Any) -> Any:
        self.opened.append(name)
        return self.lib

    def __getattr__(self, name: str) -> Any:
        return getattr(ffi, name)


@pytest.fixture
def driver(monkeypatch):
    """The stand-ins installed where ``_driver`` imports from and ``_raw``
    opens; caches cleared around them."""
    d = FakeDriver()
    libcuda = FakeLibcuda(d)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = d
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", d)
    d.ffi = FfiWithLibcuda(libcuda.lib)
    d.libcuda = libcuda
    monkeypatch.setattr(cuda, "ffi", d.ffi)
    caches_clear()
    yield d
    gc.collect()  # run the finalizers of what a test dropped while the stand-ins are in place
    caches_clear()
    assert libcuda.errors == []


@pytest.fixture
def no_fakes():
    caches_clear()
    yield
    caches_clear()


def real_driver_present() -> bool:
    caches_clear()
    try:
        cuda._driver()
        return True
    except CudaError:
        return False
    finally:
        caches_clear()


no_driver = pytest.mark.skipif(real_driver_present(), reason="this machine has an NVIDIA driver")


# -- no driver, for real ----------------------------------------------------------

@no_driver
def test_without_a_driver_nothing_raises_a_loader_traceback(no_fakes):
    """No libcuda: ``device_count`` is 0, ``check_device`` raises one
    ``CudaError`` sentence naming the driver, and ``kept_context`` still
    runs its block (an abort must run on such a machine)."""
    assert cuda.device_count() == 0
    with pytest.raises(CudaError) as err:
        cuda.check_device(0)
    text = str(err.value)
    assert text.startswith("no NVIDIA driver found") and "libcuda.so.1" in text
    assert "\n" not in text and ". " not in text
    ran = []
    with cuda.kept_context():
        ran.append(1)
    assert ran == [1]


def test_without_cuda_python_the_error_says_what_to_install(monkeypatch, no_fakes):
    """cuda-python missing: ``CudaError`` naming the package extra, and no devices."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(CudaError, match=r"cuda-python is not installed.*pip install"):
        cuda.device_count_or_raise()
    assert cuda.device_count() == 0


def test_a_driver_that_will_not_load_or_start_is_named(driver):
    """cuda-python present but libcuda absent (``cuInit`` raises), or a
    driver whose ``cuInit`` fails: each a sentence saying what to check."""
    driver.init = DynamicLibNotFoundError("libcuda.so.1 not found")
    with pytest.raises(CudaError, match=r"^no NVIDIA driver found \(DynamicLibNotFoundError\)"):
        cuda.device_count_or_raise()
    driver.init = CUresult.CUDA_ERROR_NO_DEVICE
    with pytest.raises(CudaError, match=r"could not start \(cuInit: CUDA_ERROR_NO_DEVICE\)"):
        cuda.device_count_or_raise()
    assert cuda.device_count() == 0


# -- devices and contexts ------------------------------------------------------------

def test_device_count_and_check_device(driver):
    """A driver with no GPU counts 0 (``device_count_or_raise`` says so);
    with two, an ordinal outside 0..1 (or not an int) is refused in one
    sentence naming the count, and a valid one is tried in its context,
    the caller's context (none) restored."""
    driver.count = 0
    assert cuda.device_count() == 0
    with pytest.raises(CudaError, match="sees no GPU"):
        cuda.device_count_or_raise()
    driver.count = 2
    assert cuda.device_count() == 2
    for bad in (2, -1, True, "0"):
        with pytest.raises(CudaError) as err:
            cuda.check_device(bad)
        assert str(err.value) == (f"there is no CUDA device {bad!r} here: 2 visible (ordinals 0 "
                                  "to 1); pass one of those, or check CUDA_VISIBLE_DEVICES")
    cuda.check_device(1)
    assert [ctx for (ctx,), _ in driver.calls("cuCtxSetCurrent")] == [context(1), 0]
    assert driver.current() == 0


def test_check_device_names_a_device_that_takes_no_context(driver):
    """A device whose context cannot be made (busy in exclusive mode, out of
    memory) is named with the driver's error and the likely causes."""
    driver.fail["cuDevicePrimaryCtxRetain"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError, match=r"^CUDA device 0 cannot be used \(cuDevicePrimaryCtxRetain "
                                        r"failed: CUDA_ERROR_OUT_OF_MEMORY\): is it busy"):
        cuda.check_device(0)


def test_use_device_is_for_good_and_on_device_puts_the_context_back(driver):
    """``use_device`` makes a device's primary context current on this
    thread for good; ``on_device`` for a block only; the primary context is
    retained once per device; other threads keep their own."""
    cuda.use_device(1)
    assert driver.current() == context(1)
    with cuda.on_device(0):
        assert driver.current() == context(0)
        with cuda.on_device(1):
            assert driver.current() == context(1)
        assert driver.current() == context(0)
    assert driver.current() == context(1)
    cuda.use_device(1)
    assert [args for args, _ in driver.calls("cuDevicePrimaryCtxRetain")] == [(1,), (0,)]
    other = []
    t = threading.Thread(target=lambda: other.append(driver.current()))
    t.start()
    t.join()
    assert other == [0]


def test_kept_context_restores_only_what_the_block_changed(driver):
    """A library call that moved the thread to another device (NCCL's group
    end does) is undone; a block that changed nothing costs no set."""
    cuda.use_device(0)
    sets = len(driver.calls("cuCtxSetCurrent"))
    with cuda.kept_context():
        pass
    assert len(driver.calls("cuCtxSetCurrent")) == sets
    with cuda.kept_context():
        driver.cuCtxSetCurrent(context(1))
    assert driver.current() == context(0)
    with pytest.raises(KeyError), cuda.kept_context():
        driver.cuCtxSetCurrent(context(1))
        raise KeyError
    assert driver.current() == context(0)


def test_a_failed_driver_call_raises_with_the_errors_name(driver):
    """A driver call that fails raises ``CudaError`` with the call and the
    driver's name for the error (not a bare code), and leaves no context moved."""
    driver.fail["cuStreamCreate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError, match="^cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY$"):
        cuda.Stream(0)
    assert driver.current() == 0  # on_device put the context back on the way out


# -- streams, events, copies, memory -------------------------------------------------

def test_a_stream_is_non_blocking_made_and_destroyed_in_its_device_context(driver):
    """A stream is created non-blocking in its device's context, and
    destroyed there once: by ``close`` (twice is once), or when collected."""
    s = cuda.Stream(1)
    ((flags,), ctx), = driver.calls("cuStreamCreate")
    assert flags == driver.CUstream_flags.CU_STREAM_NON_BLOCKING and ctx == context(1)
    assert isinstance(s.handle, int) and driver.current() == 0
    s.close()
    s.close()
    assert driver.calls("cuStreamDestroy") == [((s.handle,), context(1))]
    lost = cuda.Stream(0).handle
    gc.collect()
    assert driver.calls("cuStreamDestroy")[1] == ((lost,), context(0))


def test_events_record_wait_query_time_and_close_through_libcuda(driver):
    """The per-chunk calls go straight to libcuda with the handles as
    pointers: record on a ``Stream`` or a raw handle, a stream waiting on an
    event, a query (not ready: False; an error: raised), the time between
    two timing events in seconds; ``close`` destroys once."""
    s = cuda.Stream(0)
    plain, t0, t1 = cuda.Event(0), cuda.Event(0, timing=True), cuda.Event(0, timing=True)
    flags = [args[0] for args, _ in driver.calls("cuEventCreate")]
    assert flags == [driver.CUevent_flags.CU_EVENT_DISABLE_TIMING,
                     driver.CUevent_flags.CU_EVENT_DEFAULT, driver.CUevent_flags.CU_EVENT_DEFAULT]
    handles = [address(e._ptr) for e in (plain, t0, t1)]
    assert plain.record(s) is plain
    t0.record(0x9990)
    s.wait_event(plain)
    assert [args for args, _ in driver.calls("cuEventRecord")] == [
        (handles[0], s.handle), (handles[1], 0x9990)]
    assert [args for args, _ in driver.calls("cuStreamWaitEvent")] == [(s.handle, handles[0], 0)]
    driver.libcuda.query[handles[0]] = CUresult.CUDA_ERROR_NOT_READY
    assert plain.done() is False
    driver.libcuda.query[handles[0]] = OK
    assert plain.done() is True
    driver.libcuda.query[handles[0]] = CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaError, match="^cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS$"):
        plain.done()
    assert t0.elapsed_s(t1) == 1.5
    assert [args for args, _ in driver.calls("cuEventElapsedTime")] == [(handles[1], handles[2])]
    plain.close()
    plain.close()
    assert len(driver.calls("cuEventDestroy")) == 1
    assert driver.ffi.opened == ["libcuda.so.1"]  # opened once, after the driver started


def test_copy_async_passes_addresses_size_and_stream(driver):
    """A device-to-device copy reaches libcuda as (dst, src, bytes, stream);
    a refused one raises with the driver's name for the error."""
    s = cuda.Stream(0)
    cuda.copy_async(0x7F0000001000, 0x7F0000002000, 4096, s)
    assert [args for args, _ in driver.calls("cuMemcpyDtoDAsync_v2")] == [
        (0x7F0000001000, 0x7F0000002000, 4096, s.handle)]
    driver.fail["cuMemcpyDtoDAsync_v2"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="^cuMemcpyDtoDAsync failed: CUDA_ERROR_INVALID_VALUE$"):
        cuda.copy_async(1, 2, 3, s)


def test_device_memory_is_zeroed_and_freed_once_in_its_context(driver):
    """NCCL's scratch: allocated and zeroed in its device's context, freed
    there once (``free`` twice is once, and the pointer reads 0 after)."""
    mem = cuda.DeviceMemory(8, 1)
    (((n,), ctx),) = driver.calls("cuMemAlloc")
    assert (n, ctx) == (8, context(1))
    assert driver.calls("cuMemsetD8") == [((mem.ptr, 0, 8), context(1))]
    ptr = mem.ptr
    mem.free()
    mem.free()
    assert driver.calls("cuMemFree") == [((ptr,), context(1))] and mem.ptr == 0
    assert driver.current() == 0
