"""Storage: checkpoints, export and load, inference rewriting."""
