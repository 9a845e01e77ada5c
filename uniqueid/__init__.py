"""Unique ids as vLLM reads them, vLLM's weight-transfer routes, and the
rendezvous (init + warm-up) that a torch-free trainer performs with them."""

from .client import VLLMClient, VLLMConnectionError, VLLMHTTPError, in_background
from .codec import B64_LENGTH, UNIQUE_ID_BYTES, UniqueId, UniqueIdError, check_rendezvous_mode
from .errors import RendezvousError, RendezvousTimeout
from .rendezvous import Connection, as_clients, connect, handshake, warm_up
from .wire import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    InitInfo,
    SparseUpdateInfo,
    UpdateInfo,
)

__all__ = [
    "B64_LENGTH", "Connection", "DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS",
    "InitInfo", "RendezvousError", "RendezvousTimeout", "SparseUpdateInfo", "UNIQUE_ID_BYTES",
    "UniqueId", "UniqueIdError", "UpdateInfo", "VLLMClient", "VLLMConnectionError",
    "VLLMHTTPError", "as_clients", "check_rendezvous_mode", "connect", "handshake",
    "in_background", "warm_up",
]
