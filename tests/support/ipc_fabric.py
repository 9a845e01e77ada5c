"""CUDA IPC stood in for on CPU: host shared memory in place of GPU memory,
so the colocated push runs against vLLM 0.33.0's real ``ipc`` engine
(``jax_sender.testing.vllm_ipc --cpu --plane support.ipc_fabric:ARG``) with
only the CUDA calls replaced, on both sides.

* The trainer's side (``FabricMemory``, the ``uniqueid.ipc.join.Memory`` an
  ``IPCSender`` is given): an exported buffer is a file in ``/dev/shm``,
  mapped here; its "IPC handle" is the file's name, padded to 64 bytes; a
  "copy" moves the bytes of a (CPU) JAX array into the mapping; a GPU's UUID
  is made from its ordinal (``uuid_of``).
* The workers' side (``install``, in each worker before vLLM's engine is
  built): ``torch.cuda.get_device_properties(i).uuid`` is the UUID of the
  worker's "GPU" (its ``CUDA_VISIBLE_DEVICES``), and torch's
  ``rebuild_cuda_tensor`` maps the named file and views the arguments'
  storage in it (an empty storage: nothing mapped, nothing counted, as
  torch does); when that storage dies, the export's count is given back
  in the ref-counter file as torch's receiver does (``CudaIPCTypes.cpp``:
  the file opened without creating it, header + 1, slot - 1, header - 1,
  unlinked at 0; a missing file skipped).

Everything else (the pickle, vLLM's flag, the packed importer, the
rank-indexed payloads, the UUID lookup and its error, the load, the
checksums) is the real code on both sides.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import weakref
from typing import Any

PREFIX = "ipcfab"


def uuid_of(gpu: int | str) -> str:
    """The stand-in UUID of GPU ``gpu`` (torch's format)."""
    return f"00000000-0000-4000-8000-{int(gpu):012x}"


def _handle(name: str) -> bytes:
    raw = name.encode()
    assert len(raw) <= 64, name
    return raw.ljust(64, b"\0")


class _Buffer:
    """An exported "device" buffer: a mapped file in ``/dev/shm``."""

    def __init__(self, name: str, nbytes: int, device: int):
        self.name, self.nbytes, self.device = name, nbytes, device
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.ptr = ctypes.addressof(self._anchor)
        self.handle = _handle(name)

    def free(self) -> None:
        if self._map is not None:
            del self._anchor
            self._map.close()
            self._map = None
            os.unlink(f"/dev/shm/{self.name}")


class FabricMemory:
    """The trainer's side (see the module docstring).

    Args:
        free: what ``free_bytes`` answers for every device.
    """

    def __init__(self, free: int = 1 << 40):
        self.free = free
        self.exported: list[_Buffer] = []
        self.copies = 0
        self.syncs = 0
        self.closed = 0

    def uuid(self, device: int) -> str:
        return uuid_of(device)

    def free_bytes(self, device: int) -> int:
        return self.free

    def export(self, device: int, nbytes: int) -> _Buffer:
        buffer = _Buffer(f"{PREFIX}_{os.getpid()}_{len(self.exported)}", nbytes, device)
        self.exported.append(buffer)
        return buffer

    def copy(self, device: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.copies += 1

    def sync(self, device: int, timeout: float | None, check: Any = None) -> None:
        self.syncs += 1

    def close(self) -> None:
        self.closed += 1

    def alive(self) -> list[str]:
        """The buffers not freed."""
        return [b.name for b in self.exported if b._map is not None]


# -- the workers' side -----------------------------------------------------------

def install(argument: str) -> None:
    """In a worker process: torch's CUDA IPC receiver over the shared files."""
    import torch
    import torch.multiprocessing.reductions as reductions

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    class _Props:
        uuid = uuid_of(gpu)

    torch.cuda.get_device_properties = lambda *a, **k: _Props()
    reductions.rebuild_cuda_tensor = _rebuild
    from vllm.distributed.weight_transfer import ipc_engine
    ipc_engine.rebuild_cuda_tensor = _rebuild


def _rebuild(tensor_cls: Any, size: Any, stride: Any, offset: int, storage_cls: Any,
             dtype: Any, device: int, handle: bytes, storage_bytes: int, storage_offset: int,
             requires_grad: bool, counter: bytes, slot: int, event: bytes,
             event_sync: bool) -> Any:
    import numpy as np
    import torch
    assert handle[:2] == b"\x02c" and len(handle) == 66, handle[:2]
    assert len(event) == 64 and event_sync is False and isinstance(counter, bytes)
    if storage_bytes == 0:  # torch maps nothing for an empty storage, and counts nothing
        return torch.empty(tuple(size), dtype=dtype)
    name = handle[2:].rstrip(b"\0").decode()
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    host = np.frombuffer(mm, dtype=np.uint8, count=storage_bytes, offset=storage_offset)
    weakref.finalize(host, _release, counter.decode(), slot)  # when the storage dies
    return torch.from_numpy(host).view(dtype).as_strided(tuple(size), tuple(stride), offset)


def _release(counter: str, slot: int) -> None:
    """Torch's receiver giving an export back (see the module docstring);
    the header's updates atomic, as torch's ``std::atomic`` makes them (two
    workers release at once: without that, one could take it to 0 and
    unlink the file under the other)."""
    try:
        fd = os.open(f"/dev/shm{counter}", os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        mm = mmap.mmap(fd, 0)
        _add(fd, mm, 0, "<i", 1)
        _add(fd, mm, 64 + 8 * slot, "<q", -1)
        header = _add(fd, mm, 0, "<i", -1)
        mm.close()
    finally:
        os.close(fd)
    if header == 0:
        os.unlink(f"/dev/shm{counter}")


def _add(fd: int, mm: mmap.mmap, at: int, fmt: str, delta: int) -> int:
    """``mm[at] += delta`` under the file's lock; the new value."""
    import fcntl
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        value = struct.unpack_from(fmt, mm, at)[0] + delta
        struct.pack_into(fmt, mm, at, value)
        return value
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
