"""Push JAX arrays into vLLM workers over NCCL, with no torch.

The public names are these; everything under ``jax_sender._src`` is
internal. Names load on first use, so ``python -m jax_sender.demo`` can say
what is missing (JAX, a GPU) in a sentence instead of failing on an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "SendConfig": "config",
    "GatherTimeout": "errors", "MetadataError": "errors",
    "SendError": "errors", "SenderClosed": "errors", "TransferError": "errors",
    "UpdateIncomplete": "errors",
    "LLAMA": "naming", "Mapping": "naming", "flatten": "naming", "llama_name": "naming",
    "llama_transform": "naming", "named_arrays": "naming",
    "WIRE_DTYPES": "plan", "Chunk": "plan", "LoadPlan": "plan", "TensorMeta": "plan",
    "plan_chunks": "plan", "wire_order": "plan",
    "PendingSend": "session", "SendStats": "stats", "describe": "describe",
    "VerifyResult": "sender", "WeightSender": "sender",
    "SparseSender": "sparse_sender", "M2NSender": "m2n_sender", "DroppedServer": "fleet",
    "TUNIX_LLAMA3": "zoo", "TUNIX_QWEN2": "zoo", "TUNIX_QWEN3": "zoo", "MAXTEXT_LLAMA31": "zoo",
    "MAXTEXT_QWEN3": "zoo", "tunix_llama3": "zoo", "tunix_qwen2": "zoo", "tunix_qwen3": "zoo",
    "maxtext_llama31": "zoo", "maxtext_qwen3": "zoo",
}
__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "DroppedServer", "GatherTimeout", "LoadPlan", "M2NSender",
    "Mapping", "MetadataError",
    "PendingSend", "SendConfig", "SendError", "SendStats", "SenderClosed",
    "SparseSender", "TensorMeta", "TransferError", "UpdateIncomplete", "VerifyResult",
    "WeightSender", "describe", "flatten", "llama_name", "llama_transform", "named_arrays",
    "plan_chunks", "wire_order",
    "MAXTEXT_LLAMA31", "MAXTEXT_QWEN3", "TUNIX_LLAMA3", "TUNIX_QWEN2", "TUNIX_QWEN3",
    "maxtext_llama31", "maxtext_qwen3", "tunix_llama3", "tunix_qwen2", "tunix_qwen3",
]

if TYPE_CHECKING:
    from ._src.config import SendConfig
    from ._src.describe import describe
    from ._src.errors import (
        GatherTimeout,
        MetadataError,
        SenderClosed,
        SendError,
        TransferError,
        UpdateIncomplete,
    )
    from ._src.fleet import DroppedServer
    from ._src.m2n_sender import M2NSender
    from ._src.naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
    from ._src.plan import WIRE_DTYPES, Chunk, LoadPlan, TensorMeta, plan_chunks, wire_order
    from ._src.sender import VerifyResult, WeightSender
    from ._src.session import PendingSend
    from ._src.sparse_sender import SparseSender
    from ._src.stats import SendStats
    from ._src.zoo import (
        MAXTEXT_LLAMA31,
        MAXTEXT_QWEN3,
        TUNIX_LLAMA3,
        TUNIX_QWEN2,
        TUNIX_QWEN3,
        maxtext_llama31,
        maxtext_qwen3,
        tunix_llama3,
        tunix_qwen2,
        tunix_qwen3,
    )


assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jax_sender' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"._src.{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
