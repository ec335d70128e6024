"""TPUStrategy: the custom-training-loop API over the same mesh."""
