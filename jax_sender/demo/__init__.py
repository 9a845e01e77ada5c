"""The demo (``python -m jax_sender.demo``) and its Flax decoder (``model``)."""
