"""train_and_evaluate: train continuously, evaluate new checkpoints, as TF does locally.

One ``train`` call runs to ``TrainSpec.max_steps`` on one input stream. Each checkpoint that
training writes (``RunConfig.save_checkpoints_steps``/``save_checkpoints_secs``; the default
is every 600 s) triggers an evaluation if at least ``EvalSpec.throttle_secs`` passed since
the previous one (the first checkpoint always does), and the final checkpoint is evaluated
once at the end. Evaluation runs in the same process on the same devices, on the state
training holds (no reload); every loop compiles once over the whole run.

An evaluation and its exports are one unit: ``<eval dir>/evaluation_pending.json`` names the
step before the evaluation starts and is marked done once every exporter ran. A job stopped in
between (SIGKILL, a full disk during an export, SIGTERM) evaluates and exports that step
again when it restarts, so ``BestExporter``'s newest export is always the best evaluated. A
SIGTERM during an evaluation or between exporters stops them at once (the checkpoint is
already written): the stop takes one evaluation loop or one exporter at most, not every
export (single-process jobs; with many processes the evaluation runs to its end).

Example:
  >>> estimator.train_and_evaluate(
  ...     est, estimator.TrainSpec(train_input_fn, max_steps=1000),
  ...     estimator.EvalSpec(eval_input_fn, steps=None, throttle_secs=0))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence

import hooks as hooks_lib

from . import exporters as exporters_lib
from . import storage
from .core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError
from .driver import preemption
from .parallel import multihost

log = logging.getLogger("estimator")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What to train on and for how long (TF's ``tf.estimator.TrainSpec``)."""

    input_fn: Callable
    max_steps: int | None = None
    hooks: Sequence = ()

    def __post_init__(self):
        if not callable(self.input_fn):
            raise EstimatorTypeError(f"TrainSpec.input_fn must be callable, got {self.input_fn!r}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise EstimatorValueError(f"TrainSpec.max_steps must be positive, got {self.max_steps}")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate on and when (TF's ``tf.estimator.EvalSpec``).

    Args:
      input_fn: the eval input.
      steps: batches per evaluation; None evaluates the whole input.
      name: evaluations are written under ``model_dir/eval_<name>``.
      hooks: hooks for every evaluation.
      exporters: an ``Exporter`` or a list of them (``BestExporter``, ``LatestExporter``,
        ``FinalExporter``), run after each evaluation (``estimator/exporters.py``).
      start_delay_secs: accepted for compatibility; unused, as in TF's local (one-process)
        ``train_and_evaluate``, which evaluates the first checkpoint whenever it comes.
      throttle_secs: at least this many seconds between evaluations triggered by
        checkpoints (0: after every checkpoint); the final checkpoint is always evaluated.
    """

    input_fn: Callable
    steps: int | None = 100
    name: str | None = None
    hooks: Sequence = ()
    exporters: Sequence = ()
    start_delay_secs: float = 120
    throttle_secs: float = 600

    def __post_init__(self):
        if not callable(self.input_fn):
            raise EstimatorTypeError(f"EvalSpec.input_fn must be callable, got {self.input_fn!r}")
        if self.steps is not None and self.steps <= 0:
            raise EstimatorValueError(f"EvalSpec.steps must be positive or None, got {self.steps}")
        if self.throttle_secs < 0 or self.start_delay_secs < 0:
            raise EstimatorValueError("EvalSpec.throttle_secs and start_delay_secs must be >= 0")
        object.__setattr__(self, "exporters", exporters_lib.as_exporters(self.exporters))


def _now() -> float:
    """The throttle's clock (tests replace it)."""
    return time.monotonic()


PENDING_FILE = "evaluation_pending.json"


class _Interrupted(EstimatorRuntimeError):
    """A stop request ended an evaluation: it and its exports are redone on restart."""


def _stop_requested() -> bool:
    """A SIGTERM or Ctrl-C arrived in this ``train`` call (one process: many processes
    must agree to leave a collective evaluation, so they finish it)."""
    signals = preemption.active()
    return signals is not None and signals.requested and not multihost.is_multiprocess()


class _StopOnSignal(hooks_lib.SessionRunHook):
    def after_run(self, run_context, run_values) -> None:
        if _stop_requested():
            raise _Interrupted


class _Pending:
    """The step whose evaluation and exports are under way (see the module docstring)."""

    def __init__(self, est, spec: EvalSpec):
        self.path = storage.join(est.eval_dir(spec.name), PENDING_FILE)

    def mark(self, step: int, *, done: bool) -> None:
        if multihost.is_process_0():
            storage.makedirs(storage.dirname(self.path))
            storage.write_bytes(self.path, json.dumps({"step": step, "done": done}).encode())

    def unfinished(self) -> int | None:
        try:
            record = json.loads(storage.read_text(self.path))
        except (OSError, ValueError):
            return None
        step = record.get("step") if isinstance(record, dict) else None
        done = isinstance(record, dict) and record.get("done") is True
        return step if isinstance(step, int) and not done else None


class _EvalOnCheckpoint(hooks_lib.CheckpointSaverListener):
    """Evaluates after a checkpoint save when the throttle allows (TF's
    ``_NewCheckpointListenerForEvaluate``)."""

    def __init__(self, est, eval_spec: EvalSpec, max_steps: int | None = None):
        self.est, self.spec, self.max_steps = est, eval_spec, max_steps
        self.export_results: list = []
        self.final_exported = False
        self.timer = hooks_lib.SecondOrStepTimer(
            every_secs=eval_spec.throttle_secs, clock=lambda: _now()
        )
        self.result: dict | None = None
        self.pending = _Pending(est, eval_spec)

    def after_save(self, session, global_step_value: int) -> None:
        (due,) = multihost.any_of(self.timer.should_trigger_for_step(global_step_value))
        if due:  # every process evaluates together
            self.evaluate(global_step_value)
        else:
            log.info(
                "Skipping the evaluation of checkpoint %d (throttle_secs=%s).",
                global_step_value,
                self.spec.throttle_secs,
            )

    def evaluate(self, step: int, *, final: bool = False, checkpoint_path: str | None = None):
        spec = self.spec
        restored = checkpoint_path  # None: the state training holds (no reload)
        if checkpoint_path is None:
            checkpoint_path = self.est.latest_checkpoint()  # the one evaluated next
        self.pending.mark(step, done=False)
        try:
            self.result = self.est.evaluate(
                spec.input_fn,
                steps=spec.steps,
                hooks=[*spec.hooks, _StopOnSignal()],
                name=spec.name,
                checkpoint_path=restored,
            )
            self.timer.update_last_triggered_step(step)
            # TF's rule: the export is final once training reached max_steps.
            final = final or (self.max_steps is not None and step >= self.max_steps)
            self.export_results = exporters_lib.run_exporters(
                self.est,
                spec.exporters,
                self.result,
                is_the_final_export=final,
                checkpoint_path=checkpoint_path,
                should_stop=_stop_requested,
            )
        except (_Interrupted, exporters_lib.ExportsInterrupted):
            log.warning(
                "Stopping: the evaluation and exports of step %d are left to the restarted "
                "job (%s).",
                step,
                self.pending.path,
            )
            return
        self.pending.mark(step, done=True)
        self.final_exported = self.final_exported or final

    def finish_interrupted(self) -> None:
        """Evaluates and exports the step a stopped job left unfinished, if its checkpoint
        is still there."""
        step = self.pending.unfinished()
        if step is None:
            return
        path = storage.join(self.est.model_dir, f"model.ckpt-{step}")
        if not storage.finished_step(path):
            log.warning("The evaluation of step %d was interrupted; its checkpoint is gone.", step)
            self.pending.mark(step, done=True)
            return
        log.info(
            "Evaluating and exporting step %d again: the job stopped before it was done.", step
        )
        self.evaluate(step, checkpoint_path=path)

    @property
    def evaluation_steps(self) -> int | None:
        """The steps each evaluation runs (None: the whole input). Training reads it to
        compile the evaluation program while it trains (``Programs.compile_eval_ahead``)."""
        return self.spec.steps

    @property
    def last_step(self) -> int | None:
        return self.timer.last_triggered_step()


def train_and_evaluate(est, train_spec: TrainSpec, eval_spec: EvalSpec) -> tuple[dict, list]:
    """Trains to ``train_spec.max_steps`` in one ``train`` call, evaluating new checkpoints as
    ``eval_spec.throttle_secs`` allows and the final one at the end.

    Returns:
      ``(last eval results, export results)``: the last evaluation's metrics and what each
      of ``eval_spec.exporters`` returned after it (an export directory, or None).
    """
    if not isinstance(train_spec, TrainSpec):
        raise EstimatorTypeError(f"train_spec must be a TrainSpec, got {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise EstimatorTypeError(f"eval_spec must be an EvalSpec, got {type(eval_spec).__name__}")
    listener = _EvalOnCheckpoint(est, eval_spec, train_spec.max_steps)
    listener.finish_interrupted()
    est.train(
        train_spec.input_fn,
        hooks=train_spec.hooks,
        max_steps=train_spec.max_steps,
        saving_listeners=[listener],
    )
    step = est.last_train_outcome.step  # the step training ended (and checkpointed) at
    if listener.last_step != step:
        listener.evaluate(step, final=True)
    elif not listener.final_exported:  # training ended early: the last evaluation is final
        final = tuple(e for e in eval_spec.exporters if isinstance(e, exporters_lib.FinalExporter))
        exporters_lib.run_exporters(
            est,
            final,
            listener.result,
            is_the_final_export=True,
            checkpoint_path=est.latest_checkpoint(),
        )
    return listener.result, listener.export_results
