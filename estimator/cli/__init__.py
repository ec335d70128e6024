"""The ``tpu-estimator`` command line.

``usage`` (commands, flags, help, user errors) and ``configs`` (config files and
``--config.KEY=VALUE`` overrides) import no JAX, so help and mistakes are answered at once;
``jobs`` builds the estimator a config names; ``app`` runs a command.
"""

from .app import main

__all__ = ["main"]
