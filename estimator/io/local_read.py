"""Reading checkpoints from one process of a many-process job, without the others.

Orbax's ``CheckpointManager`` synchronises every process of the job by default: building one
waits at a barrier (``CheckpointManager:save_root_metadata``), and each restore ends at another
(``Checkpointer:restore``). A reader (``get_variable_value``, ``get_variable_names``,
``latest_checkpoint``, ``list_variables``, ``load_variable``, ``checkpoints_iterator``) called
by one process alone, the ``if is_chief:`` idiom after ``train``, then waits for processes
that never come, until JAX's coordination service aborts the whole job. TF's readers each read
the checkpoint files on their own, and so do ours: the read-only managers are made for this
process alone (Orbax skips every barrier of a manager whose active processes are just the
caller), and ``read_variables`` restores onto the host as numpy arrays, so no restore builds
an array spanning other processes' devices.

This is only for readers: they never write, move or delete, so there is nothing for the
processes to agree on. The trainer's writer keeps Orbax's cooperative saving.

Example:
  >>> options = ocp.CheckpointManagerOptions(read_only=True, create=False,
  ...                                        multiprocessing_options=process_local_options())
"""

from __future__ import annotations

import orbax.checkpoint as ocp


def process_index() -> int:
    """This process's index in the job (0 alone), without starting JAX's backend.

    ``jax.process_index()`` would start the backend, after which this process could no
    longer join a job (``jax.distributed.initialize`` must come first); the distributed
    runtime's own record says the same without that.

    Example:
      >>> process_index()
      0
    """
    from jax._src import distributed  # private: the only record readable before the backend

    state = distributed.global_state
    if state.client is None or state.process_id is None:
        return 0
    return int(state.process_id)


def process_local_options() -> ocp.options.MultiprocessingOptions:
    """Orbax options that make a ``CheckpointManager`` this process's alone.

    With ``active_processes`` holding only this process, every barrier Orbax would run across
    the job is skipped (``multihost.should_skip_process_sync``); this process is also its
    primary host, which matters only for writing, which a reader never does.

    Example:
      >>> process_local_options().active_processes
      {0}
    """
    me = process_index()
    return ocp.options.MultiprocessingOptions(
        primary_host=me,
        active_processes={me},
        # Distinct per process: a barrier Orbax did run could never pair with another's.
        barrier_sync_key_prefix=f"estimator_local_read_{me}",
    )
