"""Push JAX arrays into vLLM workers over NCCL, and a torch-free reference receiver."""

from .naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
from .plan import WIRE_DTYPES, Chunk, LoadPlan, MetadataError, TensorMeta, plan_chunks
from .sender import SendError, SendStats, WeightSender, describe

__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "LoadPlan", "Mapping", "MetadataError", "SendError",
    "SendStats", "TensorMeta", "WeightSender", "describe", "flatten", "llama_name",
    "llama_transform", "named_arrays", "plan_chunks",
]
