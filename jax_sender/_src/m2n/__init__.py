"""The ``nccl_m2n`` backend: ``M2NSender`` (``sender``) reshards every
trainer process's blocks (``layout``) straight into each worker's shard
(``resharder``), in a group of its own (``route``)."""
