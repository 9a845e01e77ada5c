"""What the tests, the benchmark and the demo need, and the library does not.

A torch-free receiver that receives exactly like a vLLM 0.33.0 worker
(``receiver``), its worker processes and HTTP front (``worker``, ``server``),
vLLM's own sparse engine behind its routes (``vllm_sparse``), and the
harness that starts, stops and fault-injects them (``harness``). The
library (``jax_sender``'s other modules) never imports this package.
"""
