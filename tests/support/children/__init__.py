"""Code the tests run in child processes (``python -m support.children.NAME``):
GPU ranks, trainer process groups, torch's and vLLM's own code, a first
push measured alone."""
