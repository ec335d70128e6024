"""The ``tpu-estimator`` command line: argument parsing (``app``) and job configs (``jobs``)."""

from .app import main

__all__ = ["main"]
