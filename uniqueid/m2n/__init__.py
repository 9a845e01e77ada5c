"""Joining a vLLM server started with the ``nccl_m2n`` backend, as vLLM's
M2N trainer does: the metadata group over the store (``metadata``), its
agreements and digests (``agreement``), the check of the complete plan
(``plan``), the init payload (``wire``), and the join itself (``join``:
``connect_m2n``, ``join_m2n``, ``M2NConnection``)."""
