"""Small Flax models with the parameter layout that ``naming.LLAMA`` maps."""
