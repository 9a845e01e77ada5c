"""A cffi binding over libnccl: library discovery, unique ids, communicators
with deadlines, collectives, and typed errors. No torch, no compiler."""

from .buffers import DeviceBuffer, as_buffer
from .comm import (
    DEFAULT_INIT_TIMEOUT,
    DEFAULT_OP_TIMEOUT,
    UNIQUE_ID_BYTES,
    Communicator,
    get_unique_id,
    group,
    unique_id_from_bytes,
    unique_id_to_bytes,
)
from .dtypes import NCCL_TYPES, dtype_name, itemsize, nccl_type, numpy_dtype
from .errors import (
    CudaError,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    NcclError,
    NcclLibraryNotFound,
    NcclSystemError,
    NcclTimeoutError,
    RemoteError,
    UnhandledCudaError,
)
from .library import LibraryInfo, library_info, load_library, nccl_version
from .results import make_error
from .waiting import Deadline, Job, JobStopped, await_future, in_background, poll_until

init_rank = Communicator.init_rank

__all__ = [
    "Communicator", "CudaError", "DeviceBuffer", "LibraryInfo", "NcclError", "NcclLibraryNotFound",
    "NcclSystemError", "NcclTimeoutError", "InternalError", "InvalidArgumentError",
    "InvalidUsageError", "RemoteError", "UnhandledCudaError", "NCCL_TYPES",
    "DEFAULT_INIT_TIMEOUT", "DEFAULT_OP_TIMEOUT", "UNIQUE_ID_BYTES",
    "as_buffer", "dtype_name", "get_unique_id", "group", "init_rank", "itemsize",
    "library_info", "load_library", "make_error", "nccl_type", "nccl_version",
    "numpy_dtype", "unique_id_from_bytes", "unique_id_to_bytes",
    "Deadline", "Job", "JobStopped", "await_future", "in_background", "poll_until",
]
