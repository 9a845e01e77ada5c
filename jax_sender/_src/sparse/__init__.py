"""The ``sparse_nccl`` backend: ``SparseSender`` (``sender``) broadcasts
only the changed elements, as patches (``patches``)."""
