"""Cluster set-up: TPUClusterResolver and the local multi-process launcher."""
