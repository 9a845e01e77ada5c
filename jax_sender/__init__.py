"""Push JAX arrays into vLLM workers over NCCL, and a torch-free reference receiver."""

from .naming import LLAMA, Mapping, flatten, llama_name, llama_transform, named_arrays
from .plan import WIRE_DTYPES, Chunk, MetadataError, TensorMeta, plan_chunks
from .sender import SendError, SendStats, WeightSender

__all__ = [
    "LLAMA", "WIRE_DTYPES", "Chunk", "Mapping", "MetadataError", "SendError", "SendStats",
    "TensorMeta", "WeightSender", "flatten", "llama_name", "llama_transform", "named_arrays",
    "plan_chunks",
]
