"""Unique ids as vLLM reads them, vLLM's weight-transfer routes, and the
rendezvous (init + warm-up) that a torch-free trainer performs with them."""

from .codec import (
    B64_LENGTH,
    UNIQUE_ID_BYTES,
    UniqueId,
    UniqueIdError,
    check_rendezvous_mode,
    redact,
)
from .errors import RendezvousError, RendezvousTimeout, ServerStuck
from .http.client import VLLMClient, VLLMConnectionError, VLLMHTTPError, VLLMProtocolError, VLLMTimeout
from .rendezvous import (
    MAX_WORKERS,
    NCCL_JOIN,
    Connection,
    Joiner,
    as_clients,
    check_engines,
    connect,
    engine_answers,
    handshake,
    preflight,
    release,
    release_each,
    warm_up,
    world_sizes,
)
from .wire import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    InitInfo,
    SparseUpdateInfo,
    UpdateInfo,
)

__all__ = [
    "B64_LENGTH", "Connection", "DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS",
    "InitInfo", "Joiner", "MAX_WORKERS", "NCCL_JOIN", "RendezvousError", "RendezvousTimeout",
    "ServerStuck", "SparseUpdateInfo", "UNIQUE_ID_BYTES", "UniqueId", "UniqueIdError",
    "UpdateInfo", "VLLMClient", "VLLMConnectionError", "VLLMHTTPError", "VLLMProtocolError",
    "VLLMTimeout", "as_clients", "check_engines", "check_rendezvous_mode", "connect",
    "engine_answers", "handshake", "preflight", "redact", "release", "release_each", "warm_up",
    "world_sizes",
]
