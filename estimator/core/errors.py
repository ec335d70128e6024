"""The errors the framework raises on purpose, under one base.

Every deliberate error derives from ``EstimatorError``; each also keeps the built-in base it
had before (``ValueError``, ``TypeError`` or ``RuntimeError``), so ``except ValueError`` in
existing code still catches what it caught.

Example:
  >>> try:
  ...     est.evaluate(input_fn)
  ... except estimator.NoCheckpointError:
  ...     est.train(input_fn, max_steps=100)
"""

from __future__ import annotations

import hooks


class EstimatorError(Exception):
    """Base of every error this framework raises on purpose."""


class EstimatorValueError(EstimatorError, ValueError):
    """A bad value: an argument, a config field, an input batch, a spec field."""


class EstimatorTypeError(EstimatorError, TypeError):
    """An argument or a returned value of the wrong type."""


class EstimatorRuntimeError(EstimatorError, RuntimeError):
    """A failure while running: host work, another process, the environment."""


class EstimatorKeyError(EstimatorError, KeyError):
    """A name that is not there (e.g. a hook fetching a value the loop does not expose)."""


class NanLossDuringTrainingError(EstimatorRuntimeError, hooks.NanLossDuringTrainingError):
    """A NaN or Inf in training; also a ``hooks.NanLossDuringTrainingError``.

    ``hooks`` is a package of its own that does not depend on this one, so its error is
    extended here rather than made to derive from ``EstimatorError`` there.
    """


class CheckpointError(EstimatorError, RuntimeError):
    """No readable checkpoint where one was expected, or a step that cannot be read."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A readable checkpoint whose variables do not match the model (another model's)."""


class NoCheckpointError(CheckpointError, EstimatorValueError):
    """There is no checkpoint at all where one is needed (TF: "Could not find trained model"),
    or a ``checkpoint_path`` names none (TF's ``tf.errors.NotFoundError``).

    Also an ``EstimatorValueError`` (what a missing ``checkpoint_path`` raised before), so
    existing ``except`` clauses still catch it.
    """


#: TF's name, for a ported ``except tf.errors.NotFoundError`` around ``evaluate(
#: checkpoint_path=...)``: ``except estimator.errors.NotFoundError``. The same class as
#: ``NoCheckpointError`` (here only a missing checkpoint raises it; TF's covered any file).
NotFoundError = NoCheckpointError
