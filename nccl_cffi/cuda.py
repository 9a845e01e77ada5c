"""The few CUDA driver calls NCCL's host side needs, through ``cuda.bindings``.

Contexts (NCCL uses the calling thread's current device), non-blocking
streams, events and device-to-device copies. The driver offers no timed
wait, so waits on events poll (``waiting.poll_until``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import cache

from ._ffi import ffi
from .errors import CudaError


@cache
def _driver():
    """``cuda.bindings.driver``, initialised; a ``CudaError`` that says what is
    missing (the package, the driver, a GPU) instead of a loader traceback."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaError(
            "cuda-python is not installed, and device work needs it: "
            "pip install 'jax-vllm-nccl[cuda13]'") from e
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # no libcuda.so: cuda.pathfinder's DynamicLibNotFoundError
        raise CudaError(
            f"no NVIDIA driver found ({type(e).__name__}): this needs a machine with an "
            "NVIDIA GPU and its driver (libcuda.so.1)") from e
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(
            f"the NVIDIA driver could not start (cuInit: {err.name}): check that a GPU is "
            "visible (nvidia-smi, CUDA_VISIBLE_DEVICES)")
    return driver


def _check(result, call: str):
    d = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        _, name = d.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else rest


def device_count_or_raise() -> int:
    """Visible CUDA devices; ``CudaError`` saying what is missing when none."""
    n = int(_check(_driver().cuDeviceGetCount(), "cuDeviceGetCount"))
    if n < 1:
        raise CudaError("the NVIDIA driver sees no GPU: check CUDA_VISIBLE_DEVICES and "
                        "nvidia-smi")
    return n


def device_count() -> int:
    """Visible CUDA devices; 0 when there is no driver or no device."""
    try:
        return device_count_or_raise()
    except CudaError:
        return 0


def check_device(ordinal: int) -> None:
    """Make sure ``ordinal`` names a visible GPU that takes a context, before
    anything depends on it (a peer sent into an init that this device then
    fails would wait there for ever).

    Args:
        ordinal: the CUDA device ordinal.

    Raises:
        CudaError: one sentence naming the device, how many there are and
            the fix.
    """
    count = device_count_or_raise()
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or not 0 <= ordinal < count:
        raise CudaError(
            f"there is no CUDA device {ordinal!r} here: {count} visible (ordinals 0 to "
            f"{count - 1}); pass one of those, or check CUDA_VISIBLE_DEVICES")
    try:
        with on_device(ordinal):
            pass
    except CudaError as e:
        raise CudaError(f"CUDA device {ordinal} cannot be used ({e}): is it busy in "
                        "exclusive-process mode, or out of memory?") from e


@cache
def _primary_context(ordinal: int):
    d = _driver()
    dev = _check(d.cuDeviceGet(ordinal), "cuDeviceGet")
    return _check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")


def use_device(ordinal: int) -> None:
    """Make ``ordinal``'s primary context current on this thread, for good:
    for threads this library owns (a push, a blocking init). Calls made on a
    caller's thread use ``on_device``, which puts the caller's context back.

    JAX works in the primary context, and the CUDA runtime inside NCCL takes
    its device from the current context, so this is all "set device" needs.
    """
    _check(_driver().cuCtxSetCurrent(_primary_context(ordinal)), "cuCtxSetCurrent")


@contextlib.contextmanager
def kept_context() -> Iterator[None]:
    """The thread's current context (none, or a device's) is current again
    after the block, whatever the block made current: a library call must not
    move the caller's thread to another device (NCCL's group end, for one,
    sets its communicators' device)."""
    try:
        d = _driver()
    except CudaError:  # no driver: no context to keep (and an abort must still run)
        yield
        return
    previous = _check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    try:
        yield
    finally:
        if int(_check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")) != int(previous):
            d.cuCtxSetCurrent(previous)


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """``ordinal``'s primary context current for the block, and the thread's
    previous one current again after it (see ``kept_context``)."""
    with kept_context():
        _check(_driver().cuCtxSetCurrent(_primary_context(ordinal)), "cuCtxSetCurrent")
        yield


# The calls a push makes per tensor or per chunk, straight into libcuda
# (declared in ``_cdef.py``): the cuda-python wrappers' own cost per call
# adds up over a push of many small tensors.
# Handles and pointers are plain integers here.
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


@cache
def _raw():
    _driver()  # the sentence for a missing driver, and cuInit
    return ffi, ffi.dlopen("libcuda.so.1")


def _raw_check(code: int, call: str) -> None:
    if code:
        _check((_driver().CUresult(code),), call)


class Stream:
    """A non-blocking CUDA stream (never synchronises with the legacy stream).

    Destroyed by ``close()``, or when collected."""

    def __init__(self, device: int):
        d = _driver()
        self.device = device
        with on_device(device):
            self._stream = _check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                  "cuStreamCreate")
        self.handle = int(self._stream)
        self._ptr = _raw()[0].cast("void *", self.handle)
        self._finalizer = weakref.finalize(self, _destroy_stream, device, self._stream)

    def wait_event(self, event: Event) -> None:
        ffi, lib = _raw()
        _raw_check(lib.cuStreamWaitEvent(self._ptr, event._ptr, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        self._finalizer()


def _destroy_stream(device: int, stream) -> None:
    with on_device(device):
        _driver().cuStreamDestroy(stream)


class Event:
    """A CUDA event, recorded on a stream and polled; timing-free unless
    ``timing`` (then ``elapsed_s`` reads the GPU's time between two).

    Destroyed by ``close()``, or when collected."""

    def __init__(self, device: int, *, timing: bool = False):
        d = _driver()
        flags = d.CUevent_flags.CU_EVENT_DEFAULT if timing else \
            d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with on_device(device):
            self._event = _check(d.cuEventCreate(flags), "cuEventCreate")
        self._ptr = _raw()[0].cast("void *", int(self._event))
        self._finalizer = weakref.finalize(self, _driver().cuEventDestroy, self._event)

    def record(self, stream: Stream | int) -> Event:
        ffi, lib = _raw()
        s = stream._ptr if isinstance(stream, Stream) else ffi.cast("void *", stream)
        _raw_check(lib.cuEventRecord(self._ptr, s), "cuEventRecord")
        return self

    def done(self) -> bool:
        code = _raw()[1].cuEventQuery(self._ptr)
        if code == _NOT_READY:
            return False
        _raw_check(code, "cuEventQuery")
        return True

    def elapsed_s(self, later: Event) -> float:
        """Seconds of GPU time from this event to ``later`` (both done, both timing)."""
        out = ffi.new("float *")
        _raw_check(_raw()[1].cuEventElapsedTime(out, self._ptr, later._ptr),
                   "cuEventElapsedTime")
        return out[0] / 1e3

    def close(self) -> None:
        self._finalizer()


def copy_async(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Device-to-device copy of ``nbytes`` on ``stream``."""
    _raw_check(_raw()[1].cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream._ptr),
               "cuMemcpyDtoDAsync")


class DeviceMemory:
    """A small ``cuMemAlloc`` buffer for NCCL's own scratch (e.g. the warm-up).

    Bulk buffers come from XLA instead, so they count against its pool.
    Freed by ``free()``, or when collected.
    """

    def __init__(self, nbytes: int, device: int):
        self.device = device
        self.nbytes = nbytes
        with on_device(device):
            self.ptr = int(_check(_driver().cuMemAlloc(nbytes), "cuMemAlloc"))
            self._finalizer = weakref.finalize(self, _free_memory, device, self.ptr)
            _check(_driver().cuMemsetD8(self.ptr, 0, nbytes), "cuMemsetD8")

    def read(self) -> bytes:
        """The buffer's bytes, copied to the host (every write to it must be done).

        Returns:
            ``nbytes`` bytes.

        Raises:
            CudaError: the copy failed.
        """
        out = bytearray(self.nbytes)
        with on_device(self.device):
            _check(_driver().cuMemcpyDtoH(out, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return bytes(out)

    def free(self) -> None:
        self._finalizer()
        self.ptr = 0


def _free_memory(device: int, ptr: int) -> None:
    with on_device(device):
        _driver().cuMemFree(ptr)
