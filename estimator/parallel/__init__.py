"""Mesh, partitioning, replica context, multi-process collectives and outside_compilation."""
