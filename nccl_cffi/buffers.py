"""Device pointers, element counts and dtypes from the objects users pass.

Accepted: a raw pointer (``int``, with ``count`` and ``dtype``), a
single-device JAX array, anything with ``__cuda_array_interface__``, and
anything with ``__dlpack__``. JAX refuses ``__cuda_array_interface__`` for
bfloat16 and fp8, so JAX arrays go through ``unsafe_buffer_pointer()`` after
``block_until_ready()``: the pointer is only valid once XLA has written the
buffer, and the caller must keep the array alive until the collective ends.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._ffi import ffi
from .dtypes import dtype_name

_KDL_CUDA = 2
_KDL_CUDA_MANAGED = 13
# DLPack type codes -> bits -> name
_DL_TYPES = {
    (0, 8): "int8", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2",
}


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous device buffer: pointer, element count, dtype name.

    Attributes:
        ptr: the device address of its first element.
        count: its elements.
        dtype: the canonical dtype name (``dtype_name``), e.g. ``"bfloat16"``.
        owner: the object the buffer came from, kept alive with it (None for
            a raw pointer: its owner is the caller's to keep).
    """

    ptr: int
    count: int
    dtype: str
    owner: Any = None  # keeps the source object alive while the buffer is used

    @property
    def nbytes(self) -> int:
        """The buffer's size in bytes: ``count`` x the dtype's item size."""
        from .dtypes import itemsize
        return self.count * itemsize(self.dtype)


def _is_jax_array(obj: Any) -> bool:
    return hasattr(obj, "unsafe_buffer_pointer") and hasattr(obj, "addressable_shards")


def _from_jax(arr: Any) -> DeviceBuffer:
    if len(arr.devices()) != 1:
        raise ValueError(
            f"a JAX array sharded over {len(arr.devices())} devices has no single "
            "device buffer; gather it to one device first (jax.device_put(x, device))"
        )
    (dev,) = arr.devices()
    if dev.platform != "gpu":
        raise ValueError(f"JAX array lives on {dev}, not on a CUDA device")
    arr.block_until_ready()
    return DeviceBuffer(int(arr.unsafe_buffer_pointer()), int(arr.size),
                        dtype_name(arr.dtype), arr)


def _from_cai(obj: Any) -> DeviceBuffer:
    cai = obj.__cuda_array_interface__
    shape = tuple(cai["shape"])
    dt = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dt.itemsize):
        raise ValueError("buffer is not C-contiguous; NCCL reads count elements from its start")
    return DeviceBuffer(int(cai["data"][0]), math.prod(shape), dtype_name(dt), obj)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


_get_capsule = ctypes.pythonapi.PyCapsule_GetPointer
_get_capsule.restype = ctypes.c_void_p
_get_capsule.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _from_dlpack(obj: Any, stream: int | None) -> DeviceBuffer:
    capsule = obj.__dlpack__(stream=stream) if stream else obj.__dlpack__()
    # Read without consuming: the capsule's destructor releases the tensor
    # when it dies, and ``owner`` keeps it alive until then.
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        raw = _get_capsule(capsule, b"dltensor_versioned")
        t = ffi.cast("DLManagedTensorVersioned *", raw).dl_tensor
    else:
        raw = _get_capsule(capsule, b"dltensor")
        t = ffi.cast("DLManagedTensor *", raw).dl_tensor
    if t.device.device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise ValueError(f"DLPack tensor is on device type {t.device.device_type}, not CUDA")
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DL_TYPES or t.dtype.lanes != 1:
        raise TypeError(f"DLPack dtype code={t.dtype.code} bits={t.dtype.bits} has no NCCL type")
    name = _DL_TYPES[key]
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides != ffi.NULL:
        strides = tuple(t.strides[i] for i in range(t.ndim))
        expect = tuple(s // (t.dtype.bits // 8) for s in _c_strides(shape, t.dtype.bits // 8))
        if any(n > 1 and s != e for n, s, e in zip(shape, strides, expect)):
            raise ValueError("DLPack tensor is not C-contiguous")
    ptr = int(ffi.cast("uintptr_t", t.data)) + int(t.byte_offset)
    return DeviceBuffer(ptr, math.prod(shape), name, (obj, capsule))


def as_buffer(obj: Any, count: int | None = None, dtype: Any = None,
              stream: int | None = None) -> DeviceBuffer:
    """Resolve ``obj`` to a contiguous device buffer.

    For a raw ``int`` pointer, ``count`` and ``dtype`` are required; for an
    array they are optional and, when given, must not exceed what it holds.

    Args:
        obj: a ``DeviceBuffer``, a raw device pointer (``int``), a
            single-device JAX array (waited for), or an object with
            ``__cuda_array_interface__`` or ``__dlpack__``; C-contiguous.
        count: elements to use from its start; None: all of them.
        dtype: the element type (any spelling ``dtype_name`` takes); None:
            the array's own.
        stream: the consumer stream handle passed to ``__dlpack__``, so the
            producer orders its work before it; None or 0: none passed.

    Returns:
        The buffer; ``owner`` keeps ``obj`` alive.

    Raises:
        TypeError: ``obj`` is none of those kinds, holds another dtype than
            ``dtype``, or has a dtype NCCL has no type for.
        ValueError: a raw pointer without ``count`` and ``dtype``, or null;
            ``count`` beyond what ``obj`` holds; an array that is not
            C-contiguous, not on a CUDA device, or sharded over several.
    """
    if isinstance(obj, int) and not isinstance(obj, DeviceBuffer):
        if count is None or dtype is None:
            raise ValueError("a raw pointer needs count= and dtype=")
        if obj == 0 and count:
            raise ValueError("null device pointer")
        return DeviceBuffer(obj, int(count), dtype_name(dtype))
    buf = _whole(obj, stream)
    if dtype is not None and dtype_name(dtype) != buf.dtype:
        raise TypeError(f"buffer holds {buf.dtype}, not {dtype_name(dtype)}")
    if count is None:
        return buf
    if count > buf.count:
        raise ValueError(f"count {count} exceeds the buffer's {buf.count} elements")
    return DeviceBuffer(buf.ptr, int(count), buf.dtype, buf.owner)


def _whole(obj: Any, stream: int | None) -> DeviceBuffer:
    """All of what an array (or a ``DeviceBuffer``) holds, as a buffer."""
    if isinstance(obj, DeviceBuffer):
        return obj
    if _is_jax_array(obj):
        return _from_jax(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, stream)
    raise TypeError(
        f"cannot get a device buffer from {type(obj).__name__}: pass an int "
        "pointer, a JAX array, or an object with __cuda_array_interface__ or __dlpack__"
    )
