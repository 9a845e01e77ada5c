"""From a pytree to the wire's tensors: checkpoint names and transforms
(``naming``, the ready mappings in ``zoo``), the arrays described and held
to what the workers can take (``describe``), vLLM's dtypes, chunk rule and
wire order (``plan``)."""
