"""One mapping from every dtype spelling users have to ``ncclDataType_t``.

numpy / ml_dtypes / JAX dtypes, ``torch.dtype`` objects and torch's names as
strings ("bfloat16", "torch.float8_e4m3fn", "half") all resolve through the
canonical name. FP8 exists in NCCL from 2.24 on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# canonical name -> (ncclDataType_t, itemsize, minimum NCCL version code)
NCCL_TYPES: dict[str, tuple[int, int, int]] = {
    "int8": (0, 1, 0),
    "uint8": (1, 1, 0),
    "int32": (2, 4, 0),
    "uint32": (3, 4, 0),
    "int64": (4, 8, 0),
    "uint64": (5, 8, 0),
    "float16": (6, 2, 0),
    "float32": (7, 4, 0),
    "float64": (8, 8, 0),
    "bfloat16": (9, 2, 21000),
    "float8_e4m3fn": (10, 1, 22400),
    "float8_e5m2": (11, 1, 22400),
}

_ALIASES = {"half": "float16", "float": "float32", "double": "float64",
            "long": "int64", "int": "int32", "char": "int8"}


def dtype_name(dtype: Any) -> str:
    """Canonical (torch-compatible) name of ``dtype``, e.g. ``"bfloat16"``.

    Args:
        dtype: a numpy, ml_dtypes or JAX dtype, a ``torch.dtype``, or a name
            ("bfloat16", "torch.float8_e4m3fn", "half", ...).

    Returns:
        The name, a key of ``NCCL_TYPES``.

    Raises:
        TypeError: ``dtype`` is not a dtype, or one NCCL has no type for.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif str(dtype).startswith("torch."):  # a torch.dtype, without importing torch
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as e:
            raise TypeError(f"not a dtype: {dtype!r}") from e
    name = _ALIASES.get(name, name)
    if name not in NCCL_TYPES:
        raise TypeError(
            f"NCCL has no datatype for {dtype!r}; supported: {', '.join(NCCL_TYPES)}"
        )
    return name


def nccl_type(dtype: Any, version_code: int | None = None) -> int:
    """``ncclDataType_t`` for ``dtype``; checks the loaded NCCL supports it.

    Args:
        dtype: any spelling ``dtype_name`` takes.
        version_code: the NCCL version code to check against (e.g. 22809);
            None: the loaded library's.

    Returns:
        The ``ncclDataType_t`` code.

    Raises:
        TypeError: no NCCL type for ``dtype``, or none before that version
            (bfloat16 needs 2.10, FP8 2.24).
        NcclLibraryNotFound: ``version_code`` is None and no libnccl loads.
    """
    name = dtype_name(dtype)
    code, _, since = NCCL_TYPES[name]
    if version_code is None:
        from .library import nccl_version
        version_code = nccl_version()[1]
    if version_code < since:
        raise TypeError(f"{name} needs NCCL >= {since}; the loaded library is {version_code}")
    return code


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``.

    Args:
        dtype: any spelling ``dtype_name`` takes.

    Returns:
        The element size in bytes.

    Raises:
        TypeError: no NCCL type for ``dtype``.
    """
    return NCCL_TYPES[dtype_name(dtype)][1]


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy (ml_dtypes) dtype for a name, for building host/JAX arrays.

    Args:
        dtype: any spelling ``dtype_name`` takes.

    Returns:
        The numpy dtype; bfloat16 and FP8 come from ``ml_dtypes``.

    Raises:
        TypeError: no NCCL type for ``dtype``.
        ImportError: bfloat16 or FP8 without ``ml_dtypes`` installed (JAX
            brings it).
    """
    name = dtype_name(dtype)
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)
