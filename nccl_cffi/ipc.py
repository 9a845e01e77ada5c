"""CUDA IPC for a producer without torch: memory another process on the same
GPU can map, and the names it is known by.

Why memory of its own: JAX's buffers live in XLA's pool, which is virtual
memory management memory (``cuMemCreate``), not the legacy-IPC capable kind
``cuIpcGetMemHandle`` exports (it answers ``CUDA_ERROR_INVALID_VALUE``, with
every XLA allocator). So every byte a worker maps is copied once into a
``cuMemAlloc`` buffer made here (``Exported``), whose handle names the whole
allocation; a worker maps it and reads at an offset.

``CudaIPC`` bundles what the IPC path asks of the GPU (its UUID, its free
memory, an exported buffer, a copy into one, a wait for the copies), so the
path runs on CPU over a stand-in with the same methods.
"""

from __future__ import annotations

from .cuda import DeviceMemory, Event, Stream, _check, _driver, copy_async, on_device
from .errors import CudaError
from .waiting import Check, no_check, poll_until

IPC_HANDLE_BYTES = 64
# Every exported allocation is a whole number of these. CUDA may carve a
# smaller cuMemAlloc out of a shared block, and its IPC handle then names the
# block: a worker would map the block's start, not the buffer's (and see its
# neighbours). CUDA's programming guide recommends sharing only allocations of
# a 2 MiB-aligned size; torch's caching allocator never exports smaller ones.
IPC_GRANULE = 2 << 20


def exported_bytes(nbytes: int) -> int:
    """The bytes an ``Exported`` buffer asked for ``nbytes`` takes: a whole
    number of ``IPC_GRANULE``, at least one.

    Args:
        nbytes: the bytes asked for.

    Returns:
        The allocation's size.
    """
    return -(-max(nbytes, 1) // IPC_GRANULE) * IPC_GRANULE


def gpu_uuid(ordinal: int) -> str:
    """The GPU's UUID as torch prints it, which vLLM keys IPC handles by:
    8-4-4-4-12 lowercase hex, no ``GPU-`` prefix.

    Args:
        ordinal: the CUDA device.

    Returns:
        The UUID.

    Raises:
        CudaError: no such device.
    """
    d = _driver()
    device = _check(d.cuDeviceGet(ordinal), "cuDeviceGet")
    get = getattr(d, "cuDeviceGetUuid_v2", None) or d.cuDeviceGetUuid
    raw = _check(get(device), "cuDeviceGetUuid").bytes
    h = (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def free_bytes(ordinal: int) -> int:
    """The device memory free now (``cuMemGetInfo``), what a new buffer may take.

    Args:
        ordinal: the CUDA device.

    Returns:
        Free bytes.
    """
    with on_device(ordinal):
        free, _ = _check(_driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


class Exported(DeviceMemory):
    """A ``cuMemAlloc`` buffer and its IPC handle (of the allocation's base:
    a worker maps the whole buffer and reads at offsets into it).

    Args:
        nbytes: the bytes it must hold; it takes ``exported_bytes(nbytes)``
            (its ``nbytes``), zeroed: a worker never sees this process's old bytes.
        device: the CUDA device.

    Raises:
        CudaError: no memory, or the driver refused to export it.
    """

    def __init__(self, nbytes: int, device: int):
        super().__init__(exported_bytes(nbytes), device)
        with on_device(device):
            handle = _check(_driver().cuIpcGetMemHandle(self.ptr), "cuIpcGetMemHandle")
        self.handle = bytes(handle.reserved)
        if len(self.handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"cuIpcGetMemHandle gave {len(self.handle)} bytes, not "
                            f"{IPC_HANDLE_BYTES}")


class CudaIPC:
    """The GPU work of the IPC path: the real driver's (a stand-in on CPU
    offers the same methods). One copy stream (and its event) per device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, Stream] = {}
        self._events: dict[int, Event] = {}  # each device's, recorded after its copies

    uuid = staticmethod(gpu_uuid)
    free_bytes = staticmethod(free_bytes)

    def export(self, device: int, nbytes: int) -> Exported:
        """A new exported buffer (``Exported``).

        Args:
            device: the CUDA device.
            nbytes: its size.

        Returns:
            The buffer (``free()`` releases it).
        """
        return Exported(nbytes, device)

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        """A device-to-device copy on ``device``'s copy stream, not waited for.

        Args:
            device: the CUDA device both pointers are on.
            dst: destination address.
            src: source address (its data must be ready).
            nbytes: bytes to copy.
        """
        copy_async(dst, src, nbytes, self._stream(device))

    def sync(self, device: int, timeout: float | None, check: Check = no_check) -> None:
        """Wait until every copy issued on ``device`` is done (a host sync:
        the worker reads the buffer as soon as the update reaches it).

        Args:
            device: the CUDA device.
            timeout: seconds at most.
            check: polled while waiting.

        Raises:
            TimeoutError: the copies did not end within ``timeout``.
        """
        event = self._events.setdefault(device, Event(device)).record(self._stream(device))
        poll_until(event.done, timeout, check=check, on_timeout=lambda: TimeoutError(
            f"copies into the IPC staging buffer did not end within {timeout}s"))

    def _stream(self, device: int) -> Stream:
        if device not in self._streams:
            self._streams[device] = Stream(device)
        return self._streams[device]

    def close(self) -> None:
        """Destroy the copy streams and their events."""
        for event in self._events.values():
            event.close()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._events.clear()
