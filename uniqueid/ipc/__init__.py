"""Joining a vLLM server started with the ``ipc`` backend, whose workers
share the trainer's GPUs and map its memory (CUDA IPC, no NCCL): torch's
producer contract without torch (``handles``: the rebuild arguments and
their pickle; ``counters``: the ref-counter file), the init and update
payloads (``wire``), and the join with its probe (``join``)."""
