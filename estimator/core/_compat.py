"""Workarounds that reach into other libraries' private parts or process-wide state.

Everything here may break with a new JAX, Orbax or absl release; keeping it in one module
makes that one place to look when a pin is raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def root_logging_untouched() -> Iterator[None]:
    """Undoes handlers other libraries put on the root logger inside the block.

    absl calls ``logging.basicConfig()`` on its first log call when the root logger has no
    handler, and Orbax logs through absl while it is imported. Left alone, that makes an
    application's own later ``logging.basicConfig(filename=...)`` a silent no-op.
    """
    before = list(logging.root.handlers)
    try:
        yield
    finally:
        for handler in list(logging.root.handlers):
            if handler not in before:
                logging.root.removeHandler(handler)


def jax_cluster_types() -> list:
    """JAX's registry of cluster environments (TPU pod, Slurm, ...); empty if it moved."""
    try:
        from jax._src import clusters  # private: JAX has no public detection API
    except ImportError:
        return []
    return list(clusters.ClusterEnv._cluster_types)


def backends_are_initialized() -> bool:
    """Whether JAX already created its backends (after which it cannot join a job)."""
    from jax._src import xla_bridge  # private: no public way to ask

    return xla_bridge.backends_are_initialized()


def set_absl_flag(name: str, value: Any) -> None:
    """Sets an absl flag (e.g. one of Orbax's) before absl has parsed argv."""
    import orbax.checkpoint  # noqa: F401 - defines Orbax's flags
    from absl import flags

    flag = flags.FLAGS[name]
    flag.value = value
    flag.present = max(int(flag.present), 1)  # readable before absl parses argv


@contextlib.contextmanager
def absl_warning_dropped(prefix: str) -> Iterator[None]:
    """Drops absl log records whose message starts with ``prefix`` inside the block.

    For a warning another library gives about a choice this project makes on purpose; every
    other absl record passes.
    """

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(prefix)

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def standard_handler_with_array_handler(array_handler: Any) -> Any:
    """An Orbax ``StandardCheckpointHandler`` that saves ``jax.Array`` with ``array_handler``
    and every other type as Orbax does by default, without touching Orbax's process-wide
    type-handler registry (Orbax gives a StandardCheckpointHandler no registry argument)."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.handlers import pytree_checkpoint_handler
    from orbax.checkpoint._src.serialization import type_handler_registry

    registry = type_handler_registry.create_type_handler_registry(
        *type_handler_registry._DEFAULT_TYPE_HANDLERS, (jax.Array, array_handler)
    )
    handler = ocp.StandardCheckpointHandler()
    handler._impl = pytree_checkpoint_handler.PyTreeCheckpointHandler(
        type_handler_registry=registry
    )
    return handler


def distributed_client() -> Any:
    """The coordination-service client of ``jax.distributed`` (None before it is started).

    Its key-value store (``key_value_set``, ``key_value_dir_get``) is how the processes of a
    job see each other's heartbeats (``estimator.cluster.watchdog``); JAX keeps the client
    private.
    """
    try:
        from jax._src import distributed  # private: JAX exposes no handle on its client
    except ImportError:
        return None
    return distributed.global_state.client
