"""``export_outputs`` values: TF's PredictOutput, ClassificationOutput and RegressionOutput.

A TF model_fn names what its SavedModel serves with
``EstimatorSpec(mode, predictions=..., export_outputs={"serving_default": PredictOutput(...)})``.
These classes keep that line as it is. Each holds a dict of output name -> array
(``outputs``), named as TF's signature constants name them:

* ``PredictOutput(outputs)``: a dict of arrays, or one array (named ``"output"``, as TF);
* ``ClassificationOutput(scores=None, classes=None)``: ``"scores"`` (float) and/or
  ``"classes"`` (integer class ids here: JAX has no strings; the TF SavedModel serves them as
  strings, TF's dtype for them);
* ``RegressionOutput(value)``: ``"outputs"`` (float).

``export_saved_model`` makes one signature per entry (``io/signatures.py``); ``load_saved_model``
returns their outputs under their own names with one entry, as ``"<entry>/<name>"`` with several.

Example:
  >>> spec = estimator.TPUEstimatorSpec(
  ...     mode, predictions={"probabilities": probs},
  ...     export_outputs={"serving_default": estimator.PredictOutput({"probabilities": probs})})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import EstimatorTypeError, EstimatorValueError

# TF's signature constants (tensorflow/python/saved_model/signature_constants.py).
PREDICT_METHOD_NAME = "tensorflow/serving/predict"
CLASSIFY_METHOD_NAME = "tensorflow/serving/classify"
REGRESS_METHOD_NAME = "tensorflow/serving/regress"
PREDICT_OUTPUT = "output"  # PredictOutput._SINGLE_OUTPUT_DEFAULT_NAME
CLASSIFY_OUTPUT_SCORES = "scores"
CLASSIFY_OUTPUT_CLASSES = "classes"
REGRESS_OUTPUTS = "outputs"


def _check_array(value: Any, what: str, kind: str = "") -> Any:
    """``value`` if it is an array (of a dtype kind in ``kind``, numpy's letters, when given)."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise EstimatorTypeError(f"{what} must be an array, got {type(value).__name__}")
    if kind and np.dtype(value.dtype).kind not in kind:
        want = {"f": "a floating", "iu": "an integer"}.get(kind, kind)
        raise EstimatorTypeError(f"{what} must be {want} array, got dtype {value.dtype}")
    return value


class ExportOutput:
    """The base of the three output kinds: ``outputs`` (name -> array) and ``method_name``."""

    method_name: str = PREDICT_METHOD_NAME

    def __init__(self, outputs: dict[str, Any]):
        self._outputs = dict(outputs)

    @property
    def outputs(self) -> dict[str, Any]:
        """The arrays this signature serves, by output name."""
        return dict(self._outputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self._outputs)})"


class PredictOutput(ExportOutput):
    """TF's ``PredictOutput``: any arrays, served under their names.

    Args:
      outputs: a dict of output name -> array, or one array (named ``"output"``).

    Raises:
      TypeError: an output is not an array or a name is not a string.

    Example:
      >>> PredictOutput({"class_ids": ids, "probabilities": probs}).outputs.keys()
      dict_keys(['class_ids', 'probabilities'])
    """

    method_name = PREDICT_METHOD_NAME

    def __init__(self, outputs: Any):
        if not isinstance(outputs, Mapping):
            outputs = {PREDICT_OUTPUT: outputs}
        for name, value in outputs.items():
            if not isinstance(name, str):
                raise EstimatorTypeError(f"PredictOutput output names must be str, got {name!r}")
            _check_array(value, f"PredictOutput output {name!r}")
        super().__init__(outputs)


class ClassificationOutput(ExportOutput):
    """TF's ``ClassificationOutput``: ``scores`` ``[batch, classes]`` and/or ``classes``.

    Args:
      scores: float scores per class (e.g. probabilities).
      classes: integer class ids (TF takes string labels; the TF SavedModel serves these as
        their decimal strings).

    Raises:
      ValueError: neither is given.
      TypeError: ``scores`` is not floating or ``classes`` not integer.

    Example:
      >>> ClassificationOutput(scores=probs).outputs.keys()
      dict_keys(['scores'])
    """

    method_name = CLASSIFY_METHOD_NAME

    def __init__(self, scores: Any = None, classes: Any = None):
        if scores is None and classes is None:
            raise EstimatorValueError("ClassificationOutput needs scores or classes (or both)")
        outputs = {}
        if scores is not None:
            outputs[CLASSIFY_OUTPUT_SCORES] = _check_array(
                scores, "ClassificationOutput scores", "f"
            )
        if classes is not None:
            outputs[CLASSIFY_OUTPUT_CLASSES] = _check_array(
                classes, "ClassificationOutput classes", "iu"
            )
        super().__init__(outputs)

    @property
    def scores(self) -> Any:
        return self._outputs.get(CLASSIFY_OUTPUT_SCORES)

    @property
    def classes(self) -> Any:
        return self._outputs.get(CLASSIFY_OUTPUT_CLASSES)


class RegressionOutput(ExportOutput):
    """TF's ``RegressionOutput``: one array of predicted values, served as ``"outputs"``.

    Example:
      >>> RegressionOutput(value=y).outputs.keys()
      dict_keys(['outputs'])
    """

    method_name = REGRESS_METHOD_NAME

    def __init__(self, value: Any):
        super().__init__({REGRESS_OUTPUTS: _check_array(value, "RegressionOutput value", "f")})

    @property
    def value(self) -> Any:
        return self._outputs[REGRESS_OUTPUTS]


__all__ = [
    "ClassificationOutput",
    "ExportOutput",
    "PredictOutput",
    "RegressionOutput",
]
