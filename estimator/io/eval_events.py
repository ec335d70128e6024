"""Writing an evaluation's results as events, where the model_dir may not be writable.

``evaluate`` is a reader: it may run on a model_dir it cannot write (a read-only mount of a
finished run, a colleague's directory). Its results are then still returned; the events
(``<model_dir>/eval*/``, read by TensorBoard and the early-stopping hooks) are not written,
and one warning per directory per process says so, naming the directory and the error.

Example:
  >>> write_eval_events("/runs/a/eval", {"loss": 0.3}, 100)  # warns once if unwritable
"""

from __future__ import annotations

import logging
import threading

from .. import storage
from ..core import summary

log = logging.getLogger("estimator")

_warned: set[str] = set()
_lock = threading.Lock()


def write_eval_events(eval_dir: str, scalars: dict[str, float], step: int) -> bool:
    """Appends ``scalars`` at ``step`` to ``eval_dir``'s results file; False if it could not.

    Args:
      eval_dir: the evaluation's event directory.
      scalars: tag -> value.
      step: the global step evaluated.

    Returns:
      Whether the events were written (a warning was logged, once per directory, if not).
    """
    try:
        summary.write_results(eval_dir, scalars, step)
    except OSError as e:  # read-only, no permission, no space: the results are still good
        key = storage.absolute(eval_dir)
        with _lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            log.warning(
                "Evaluation events could not be written to %s (%s: %s); the results are "
                "returned, but TensorBoard and early-stopping hooks reading that directory "
                "will not see them. (Said once per directory.)",
                key,
                type(e).__name__,
                e.strerror or e,
            )
        return False
    return True
