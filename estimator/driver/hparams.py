"""The run's ``params`` in TensorBoard's HPARAMS tab, so the runs of a sweep compare there.

TensorBoard's hparams plugin treats each run directory holding a *session start* as one
session: its hyperparameters are the session start's values, its metrics every scalar of
that directory and of its sub-directories (``eval/accuracy``, ``eval/loss``, ``loss``,
``learning_rate``), each shown at its last value. So the estimator writes one session start
into ``model_dir`` when a run begins training from scratch, with the trainer's settings
(``trainer_hparams``: batch size, compute dtype, micro-batches, iterations per loop,
``max_steps``, the optimizer's name) and the user's ``params`` (numbers, strings and bools;
other values are skipped; a ``params`` key wins over a trainer setting of the same name),
and the final evaluation metrics reach the tab as the ``eval`` scalars that ``evaluate``
writes anyway. No experiment summary
is written: TensorBoard builds one from the sessions of every run below its ``--logdir``
(an experiment summary in one run would hide the others' hyperparameters).

Example:
  >>> write_session_start(writer, {"lr": 0.1, "layers": 3, "optimizer": "adam"})
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Mapping
from typing import Any

from hooks import _tensorboardx  # noqa: F401  (imports tensorboardX without torch)

from .optimizer_info import optimizer_name

log = logging.getLogger("estimator")

PLUGIN = "hparams"
SESSION_START_TAG = "_hparams_/session_start_info"


def hparam_values(params: Mapping[str, Any]) -> dict[str, bool | float | str]:
    """The entries of ``params`` the hparams plugin can show: bools, numbers (as float) and
    strings, by their key; nested dicts, lists, arrays, None and objects are left out."""
    out: dict[str, bool | float | str] = {}
    for key, value in params.items():
        if isinstance(value, (bool, str)):
            out[str(key)] = value
        elif isinstance(value, numbers.Real):
            out[str(key)] = float(value)
        elif getattr(value, "shape", None) == () and hasattr(value, "item"):
            item = value.item()  # a numpy scalar
            if isinstance(item, (bool, str, numbers.Real)):
                out[str(key)] = item if isinstance(item, (bool, str)) else float(item)
    return out


def trainer_hparams(
    config: Any, *, global_batch: int, max_steps: int | None, train_op: Any = None
) -> dict[str, bool | float | str]:
    """The trainer's settings of a run, for the HPARAMS tab.

    Args:
      config: the run's ``RunConfig``.
      global_batch: the training batch of one step, over every replica.
      max_steps: the step the call trains to (None: until the input ends; left out).
      train_op: the spec's optax optimizer, named by ``optimizer_info.optimizer_name``.
    """
    tpu = config.tpu_config
    out: dict[str, bool | float | str] = {
        "train_batch_size": global_batch,
        "compute_dtype": tpu.compute_dtype or "float32",
        "num_microbatches": tpu.num_microbatches,
        "iterations_per_loop": tpu.iterations_per_loop,
    }
    if max_steps is not None:
        out["max_steps"] = max_steps
    if train_op is not None:
        out["optimizer"] = optimizer_name(train_op)
    return out


def session_start_summary(params: Mapping[str, Any]) -> Any:
    """A tensorboardX ``Summary`` holding the hparams plugin's session start for ``params``."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionStartInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    start = SessionStartInfo(start_time_secs=time.time())
    for key, value in hparam_values(params).items():
        if isinstance(value, bool):
            start.hparams[key].bool_value = value
        elif isinstance(value, str):
            start.hparams[key].string_value = value
        else:
            start.hparams[key].number_value = value
    content = HParamsPluginData(session_start_info=start, version=0).SerializeToString()
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN, content=content)
    )
    return Summary(value=[Summary.Value(tag=SESSION_START_TAG, metadata=meta)])


def write_session_start(writer: Any, params: Mapping[str, Any], *, step: int = 0) -> None:
    """Writes the session start of ``params`` with a tensorboardX writer (None: nothing)."""
    if writer is None:
        return
    skipped = sorted(str(k) for k in params if str(k) not in hparam_values(params))
    if skipped:
        log.debug("HPARAMS: params not shown (not a number, string or bool): %s", skipped)
    writer.file_writer.add_summary(session_start_summary(params), global_step=step)
