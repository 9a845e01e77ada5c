"""Plugs for RL frameworks, one module each, imported by name only.

``jax_sender.integrations.tunix``: ``VLLMServerRollout``, a Tunix rollout
engine backed by vLLM servers (weights pushed over NCCL, generation over
HTTP). Importing this package imports no framework; importing a module
without its framework raises an ``ImportError`` that says what to install.
"""
