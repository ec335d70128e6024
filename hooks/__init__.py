"""Hooks: the SessionRunHook lifecycle and the standard hooks, for compiled device loops.

Hooks run once per device loop but receive every step's values (``[n, ...]`` arrays), so
per-step cadences stay exact. See ``hooks.base`` for the protocol.

Example:
  >>> import hooks
  >>> training_hooks = [
  ...     hooks.LoggingTensorHook({"loss": "loss", "step": "global_step"}, every_n_iter=100),
  ...     hooks.StopAtStepHook(last_step=1000),
  ... ]
"""

from hooks.base import HookSession as HookSession
from hooks.base import NanLossDuringTrainingError as NanLossDuringTrainingError
from hooks.base import SessionRunArgs as SessionRunArgs
from hooks.base import SessionRunContext as SessionRunContext
from hooks.base import SessionRunHook as SessionRunHook
from hooks.base import SessionRunValues as SessionRunValues
from hooks.base import fetch_names as fetch_names
from hooks.base import resolve_fetches as resolve_fetches
from hooks.checkpoint_saver import CheckpointSaverHook as CheckpointSaverHook
from hooks.checkpoint_saver import CheckpointSaverListener as CheckpointSaverListener
from hooks.early_stopping import make_early_stopping_hook as make_early_stopping_hook
from hooks.early_stopping import stop_if_higher_hook as stop_if_higher_hook
from hooks.early_stopping import stop_if_lower_hook as stop_if_lower_hook
from hooks.early_stopping import stop_if_no_decrease_hook as stop_if_no_decrease_hook
from hooks.early_stopping import stop_if_no_increase_hook as stop_if_no_increase_hook
from hooks.event_reader import read_eval_metrics as read_eval_metrics
from hooks.logging_hook import LoggingTensorHook as LoggingTensorHook
from hooks.nan_tensor import NanTensorHook as NanTensorHook
from hooks.profiler import ProfilerHook as ProfilerHook
from hooks.step_counter import StepCounterHook as StepCounterHook
from hooks.stop_at_step import StopAtStepHook as StopAtStepHook
from hooks.timer import SecondOrStepTimer as SecondOrStepTimer

__all__ = [
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "HookSession",
    "LoggingTensorHook",
    "NanLossDuringTrainingError",
    "NanTensorHook",
    "ProfilerHook",
    "SecondOrStepTimer",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StepCounterHook",
    "StopAtStepHook",
    "fetch_names",
    "make_early_stopping_hook",
    "read_eval_metrics",
    "resolve_fetches",
    "stop_if_higher_hook",
    "stop_if_lower_hook",
    "stop_if_no_decrease_hook",
    "stop_if_no_increase_hook",
]
