"""Push JAX arrays into vLLM workers over NCCL, with no torch.

Names load on first use, so ``python -m jax_sender.demo`` can say what is
missing (JAX, a GPU) in a sentence instead of failing on an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SendConfig": "config",
    "GatherTimeout": "errors", "MetadataError": "errors", "SendError": "errors",
    "TransferError": "errors",
    "LLAMA": "naming", "Mapping": "naming", "flatten": "naming", "llama_name": "naming",
    "llama_transform": "naming", "named_arrays": "naming",
    "WIRE_DTYPES": "plan", "Chunk": "plan", "LoadPlan": "plan", "TensorMeta": "plan",
    "plan_chunks": "plan", "wire_order": "plan",
    "PendingSend": "push", "PushCancelled": "push", "SendStats": "push",
    "VerifyResult": "sender", "WeightSender": "sender", "describe": "base",
    "SparseSender": "sparse_sender",
}
__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "GatherTimeout", "LoadPlan", "Mapping", "MetadataError",
    "PendingSend", "PushCancelled", "SendConfig", "SendError", "SendStats", "SparseSender", "TensorMeta",
    "TransferError", "VerifyResult", "WeightSender", "describe", "flatten", "llama_name",
    "llama_transform", "named_arrays", "plan_chunks", "wire_order",
]

if TYPE_CHECKING:
    from .base import describe
    from .config import SendConfig
    from .errors import GatherTimeout, MetadataError, SendError, TransferError
    from .naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
    from .plan import WIRE_DTYPES, Chunk, LoadPlan, TensorMeta, plan_chunks, wire_order
    from .push import PendingSend, PushCancelled, SendStats
    from .sender import VerifyResult, WeightSender
    from .sparse_sender import SparseSender


assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jax_sender' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
