"""Push JAX arrays into vLLM workers over NCCL or CUDA IPC, with no torch.

The public names are these; everything under ``jax_sender._src`` is
internal. Names load on first use, so ``python -m jax_sender.demo`` can say
what is missing (JAX, a GPU) in a sentence instead of failing on an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives: the shared core, or the backend whose sender it is.
_HOMES = {
    "core.config": ("SendConfig",),
    "core.errors": ("GatherTimeout", "MetadataError", "SendError", "SenderClosed", "TransferError",
                    "UpdateIncomplete"),
    "core.fleet": ("DroppedServer",),
    "core.senders": ("VerifyResult",),
    "core.session": ("PendingSend",),
    "core.stats": ("SendStats",),
    "core.tensors.describe": ("describe",),
    "core.tensors.naming": ("LLAMA", "Mapping", "flatten", "llama_name", "llama_transform",
                            "named_arrays"),
    "core.tensors.plan": ("WIRE_DTYPES", "Chunk", "LoadPlan", "TensorMeta", "plan_chunks",
                          "wire_order"),
    "core.tensors.zoo": ("MAXTEXT_LLAMA31", "MAXTEXT_QWEN3", "TUNIX_LLAMA3", "TUNIX_QWEN2",
                         "TUNIX_QWEN3", "maxtext_llama31", "maxtext_qwen3", "tunix_llama3",
                         "tunix_qwen2", "tunix_qwen3"),
    "broadcast.sender": ("WeightSender",),
    "sparse.sender": ("SparseSender",),
    "m2n.sender": ("M2NSender",),
    "ipc.sender": ("IPCSender",),
}
_EXPORTS = {name: home for home, names in _HOMES.items() for name in names}
__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "DroppedServer", "GatherTimeout", "IPCSender", "LoadPlan",
    "M2NSender",
    "Mapping", "MetadataError",
    "PendingSend", "SendConfig", "SendError", "SendStats", "SenderClosed",
    "SparseSender", "TensorMeta", "TransferError", "UpdateIncomplete", "VerifyResult",
    "WeightSender", "describe", "flatten", "llama_name", "llama_transform", "named_arrays",
    "plan_chunks", "wire_order",
    "MAXTEXT_LLAMA31", "MAXTEXT_QWEN3", "TUNIX_LLAMA3", "TUNIX_QWEN2", "TUNIX_QWEN3",
    "maxtext_llama31", "maxtext_qwen3", "tunix_llama3", "tunix_qwen2", "tunix_qwen3",
]

if TYPE_CHECKING:
    from ._src.broadcast.sender import WeightSender
    from ._src.core.config import SendConfig
    from ._src.core.errors import (
        GatherTimeout,
        MetadataError,
        SenderClosed,
        SendError,
        TransferError,
        UpdateIncomplete,
    )
    from ._src.core.fleet import DroppedServer
    from ._src.core.senders import VerifyResult
    from ._src.core.session import PendingSend
    from ._src.core.stats import SendStats
    from ._src.core.tensors.describe import describe
    from ._src.core.tensors.naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
    from ._src.core.tensors.plan import WIRE_DTYPES, Chunk, LoadPlan, TensorMeta, plan_chunks, wire_order
    from ._src.core.tensors.zoo import (
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
    from ._src.ipc.sender import IPCSender
    from ._src.m2n.sender import M2NSender
    from ._src.sparse.sender import SparseSender


assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jax_sender' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"._src.{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
