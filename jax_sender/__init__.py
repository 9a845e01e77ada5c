"""Push JAX arrays into vLLM workers over NCCL, with no torch."""

from .config import SendConfig
from .errors import GatherTimeout, MetadataError, SendError, TransferError
from .naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
from .plan import WIRE_DTYPES, Chunk, LoadPlan, TensorMeta, plan_chunks, wire_order
from .push import PendingSend, PushCancelled, SendStats
from .sender import VerifyResult, WeightSender, describe

__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "GatherTimeout", "LoadPlan", "Mapping", "MetadataError",
    "PendingSend", "PushCancelled", "SendConfig", "SendError", "SendStats", "TensorMeta",
    "TransferError", "VerifyResult", "WeightSender", "describe", "flatten", "llama_name",
    "llama_transform", "named_arrays", "plan_chunks", "wire_order",
]
