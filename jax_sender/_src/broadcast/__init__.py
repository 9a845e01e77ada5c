"""The ``nccl`` backend: ``WeightSender`` broadcasts whole tensors, packed
or one by one (``sender``), chunks packed by XLA (``packing``)."""
