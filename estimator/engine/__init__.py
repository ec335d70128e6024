"""Compiled side: model_fn under a Flax root, the pure compiled loops, state creation
and restore.
"""
