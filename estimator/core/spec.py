"""TPUEstimatorSpec, EstimatorSpec and ModeKeys: what model_fn returns, validated on construction.

Example:
  >>> def model_fn(features, labels, mode, params):
  ...     logits = models.MLP(...)(features)
  ...     loss = ...
  ...     return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3),
  ...                                       eval_metrics=(metric_fn, [labels, logits]))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from hooks.base import as_hook_list

from .errors import EstimatorTypeError, EstimatorValueError


class ModeKeys:
    """The three modes model_fn is called in (TF's string values)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"

    ALL = (TRAIN, EVAL, PREDICT)


def _arg_count(fn: Callable) -> tuple[int, int, bool]:
    """(required positional, max positional, takes *args) of a host function."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0, 0, True
    required = maximum = 0
    varargs = False
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            varargs = True
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            maximum += 1
            required += p.default is p.empty
    return required, maximum, varargs


def _rank(tensor: Any) -> int | None:
    shape = getattr(tensor, "shape", None)
    return None if shape is None else len(shape)


def validate_host_fn_tuple(value: Any, field: str) -> None:
    """Checks ``(fn, tensors)`` of ``eval_metrics``/``host_call`` as TPUEstimator did.

    Raises:
      ValueError/TypeError naming ``field`` and, for a tensor, its position or key.
    """
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise EstimatorValueError(
            f"{field} should be a tuple/list of 2 elements (fn, tensors), got {value!r}"
        )
    fn, tensors = value
    if not callable(fn):
        raise EstimatorTypeError(f"{field}[0] (the function) must be callable, got {fn!r}")
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (list, tuple)):
        items = list(enumerate(tensors))
        required, maximum, varargs = _arg_count(fn)
        if not varargs and not (required <= len(tensors) <= maximum):
            takes = required if required == maximum else f"{required}-{maximum}"
            raise EstimatorValueError(
                f"In {field}, the function takes {takes} positional arguments but "
                f"{len(tensors)} tensors were given"
            )
    else:
        raise EstimatorTypeError(
            f"{field}[1] (the tensors) must be a list, tuple or dict, got {type(tensors).__name__}"
        )
    for key, tensor in items:
        rank = _rank(tensor)
        if rank is None:
            raise EstimatorTypeError(f"{field} tensor {key!r} is not an array: {tensor!r}")
        if rank == 0:
            raise EstimatorValueError(
                f"{field} tensor {key!r} has rank 0; host tensors need rank >= 1 because they "
                "are concatenated across replicas along axis 0 (reshape it to [1])"
            )


def _validate_hooks(hooks: Any, field: str) -> tuple:
    return tuple(as_hook_list(hooks, field))


class TPUEstimatorSpec:
    """What ``model_fn`` returns (TF's ``tf.estimator.tpu.TPUEstimatorSpec``).

    Args:
      mode: a ``ModeKeys`` value.
      predictions: an array or dict of arrays (required in PREDICT).
      loss: a scalar (required in TRAIN and EVAL).
      train_op: an ``optax.GradientTransformation`` (required in TRAIN). The estimator takes
        the gradient of ``loss`` on each replica, averages it over replicas and applies it.
      eval_metrics: ``(metric_fn, tensors)``; metric_fn runs on the host.
      export_outputs: dict of output name -> array (or key of ``predictions``) for export.
      scaffold_fn: zero-argument function run on the host returning ``estimator.Scaffold``.
      host_call: ``(fn, tensors)`` run on the host for each training step.
      training_hooks, evaluation_hooks, prediction_hooks: ``hooks.SessionRunHook`` lists.
    """

    def __init__(
        self,
        mode: str,
        predictions: Any = None,
        loss: Any = None,
        train_op: Any = None,
        eval_metrics: Any = None,
        export_outputs: Any = None,
        scaffold_fn: Callable | None = None,
        host_call: Any = None,
        training_hooks: Sequence | None = None,
        evaluation_hooks: Sequence | None = None,
        prediction_hooks: Sequence | None = None,
    ):
        if mode not in ModeKeys.ALL:
            raise EstimatorValueError(f"mode must be one of {ModeKeys.ALL}, got {mode!r}")
        if mode in (ModeKeys.TRAIN, ModeKeys.EVAL) and loss is None:
            raise EstimatorValueError(
                f"Missing loss: TPUEstimatorSpec in mode {mode!r} needs a loss"
            )
        if loss is not None:
            shape = getattr(loss, "shape", None)
            if shape is None:
                raise EstimatorTypeError(f"loss must be an array, got {type(loss).__name__}")
            if len(shape) > 1 or (len(shape) == 1 and shape[0] != 1):
                raise EstimatorValueError(f"loss must be a scalar, got shape {tuple(shape)}")
        if mode == ModeKeys.TRAIN:
            if train_op is None:
                raise EstimatorValueError(
                    "Missing train_op: TPUEstimatorSpec in TRAIN mode needs one"
                )
            if isinstance(train_op, optax.MultiSteps):
                raise EstimatorTypeError(
                    "train_op must be an optax.GradientTransformation, got optax.MultiSteps: "
                    "it accumulates over train steps, so global_step would count "
                    "micro-batches. Use TPUConfig(num_microbatches=k) with the inner "
                    "optimizer as train_op instead: one update per step, global_step "
                    "counts updates"
                )
            if not isinstance(train_op, optax.GradientTransformation):
                raise EstimatorTypeError(
                    "train_op must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
                    f"got {type(train_op).__name__}"
                )
        if mode == ModeKeys.PREDICT:
            if predictions is None:
                raise EstimatorValueError(
                    "Missing predictions: TPUEstimatorSpec in PREDICT mode needs them"
                )
        if predictions is not None and not isinstance(predictions, Mapping):
            if _rank(predictions) is None:
                raise EstimatorTypeError(
                    f"predictions must be an array or a dict of arrays, got {type(predictions)}"
                )
        if eval_metrics is not None:
            validate_host_fn_tuple(eval_metrics, "eval_metrics")
        if host_call is not None:
            validate_host_fn_tuple(host_call, "host_call")
        if scaffold_fn is not None and not callable(scaffold_fn):
            raise EstimatorTypeError(f"scaffold_fn must be callable, got {scaffold_fn!r}")
        if export_outputs is not None and not isinstance(export_outputs, Mapping):
            raise EstimatorTypeError(
                f"export_outputs must be a dict, got {type(export_outputs).__name__}"
            )
        self.mode = mode
        self.predictions = predictions
        self.loss = loss
        self.train_op = train_op
        self.eval_metrics = eval_metrics
        self.export_outputs = export_outputs
        self.scaffold_fn = scaffold_fn
        self.host_call = host_call
        self.training_hooks = _validate_hooks(training_hooks, "training_hooks")
        self.evaluation_hooks = _validate_hooks(evaluation_hooks, "evaluation_hooks")
        self.prediction_hooks = _validate_hooks(prediction_hooks, "prediction_hooks")

    def as_estimator_spec(self) -> EstimatorSpec:
        """The same spec as a plain ``EstimatorSpec`` (TF's single-device path).

        The host functions travel with it, so the estimator runs them exactly as it does for
        this spec: on one device this is the same computation.
        """
        spec = EstimatorSpec(
            self.mode,
            predictions=self.predictions,
            loss=self.loss,
            train_op=self.train_op,
            export_outputs=self.export_outputs,
            training_hooks=self.training_hooks,
            evaluation_hooks=self.evaluation_hooks,
            prediction_hooks=self.prediction_hooks,
        )
        spec._tpu_spec = self
        return spec


class EstimatorSpec:
    """TF's ``tf.estimator.EstimatorSpec``, accepted where TPUEstimator accepted it.

    ``eval_metric_ops`` maps names to ``(metric_fn, tensors)``-free values: in JAX metrics run
    on the host, so use ``TPUEstimatorSpec.eval_metrics`` instead (an error says so).
    """

    def __init__(
        self,
        mode: str,
        predictions: Any = None,
        loss: Any = None,
        train_op: Any = None,
        eval_metric_ops: Any = None,
        export_outputs: Any = None,
        training_chief_hooks: Sequence | None = None,
        training_hooks: Sequence | None = None,
        scaffold: Any = None,
        evaluation_hooks: Sequence | None = None,
        prediction_hooks: Sequence | None = None,
    ):
        if eval_metric_ops:
            raise EstimatorValueError(
                "EstimatorSpec.eval_metric_ops is not supported: metrics run on the host, "
                "return TPUEstimatorSpec(eval_metrics=(metric_fn, tensors)) instead"
            )
        self._tpu_spec = None
        self.mode = mode
        self.predictions = predictions
        self.loss = loss
        self.train_op = train_op
        self.export_outputs = export_outputs
        self.training_hooks = tuple(training_hooks or ()) + tuple(training_chief_hooks or ())
        self.evaluation_hooks = tuple(evaluation_hooks or ())
        self.prediction_hooks = tuple(prediction_hooks or ())
        self.scaffold = scaffold
        self.to_tpu_spec()  # validates

    def to_tpu_spec(self) -> TPUEstimatorSpec:
        if self._tpu_spec is not None:
            return self._tpu_spec
        scaffold = self.scaffold
        return TPUEstimatorSpec(
            self.mode,
            predictions=self.predictions,
            loss=self.loss,
            train_op=self.train_op,
            export_outputs=self.export_outputs,
            scaffold_fn=(lambda: scaffold) if scaffold is not None else None,
            training_hooks=self.training_hooks,
            evaluation_hooks=self.evaluation_hooks,
            prediction_hooks=self.prediction_hooks,
        )


def as_tpu_spec(spec: Any, mode: str) -> TPUEstimatorSpec:
    """Normalises what model_fn returned, checking its type and mode."""
    if isinstance(spec, EstimatorSpec):
        spec = spec.to_tpu_spec()
    if not isinstance(spec, TPUEstimatorSpec):
        raise EstimatorTypeError(
            f"model_fn must return a TPUEstimatorSpec (or EstimatorSpec), got {type(spec).__name__}"
        )
    if spec.mode != mode:
        raise EstimatorValueError(
            f"model_fn was called in mode {mode!r} but returned a spec for {spec.mode!r}"
        )
    return spec
