"""An export's outputs and signatures, from the PREDICT spec (TF's ``export_outputs`` rules).

``export_signatures(spec)`` returns the flat outputs the exported computation returns (name ->
array) and the signatures that serve them: signature key -> ``{"method": <TF method name>,
"outputs": {output key: flat output name}}``. The TF SavedModel gets one signature per entry;
``load_saved_model`` returns the flat outputs.

* No ``export_outputs``: one ``serving_default`` signature of every ``predictions`` entry (an
  array alone is ``"output"``), as TF's default ``PredictOutput(predictions)``.
* ``export_outputs`` of plain arrays (or names of ``predictions`` keys): one
  ``serving_default`` signature with an output per entry.
* ``export_outputs`` holding ``PredictOutput`` / ``ClassificationOutput`` / ``RegressionOutput``:
  one signature per entry (a plain array entry is a one-output ``PredictOutput``). With one entry
  it is also ``serving_default`` and its outputs keep their names; with several, one must be
  ``"serving_default"`` (TF's rule) and outputs are named ``"<entry>/<output>"``.

Example:
  >>> outputs, signatures = export_signatures(spec)
  >>> signatures["classify"]
  {'method': 'tensorflow/serving/classify',
   'outputs': {'scores': 'classify/scores', 'classes': 'classify/classes'}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.export_output import ExportOutput, PredictOutput

DEFAULT_SIGNATURE = "serving_default"
SINGLE_OUTPUT = "output"  # TF's name for a lone prediction array


def _resolve(name: str, value: Any, predictions: Any) -> Any:
    """An ``export_outputs`` value as an array (a string names a ``predictions`` key)."""
    if isinstance(value, str):
        if not isinstance(predictions, Mapping) or value not in predictions:
            keys = sorted(predictions) if isinstance(predictions, Mapping) else []
            raise EstimatorValueError(
                f"export_outputs[{name!r}] names predictions key {value!r}, which does not "
                f"exist; predictions keys: {keys}"
            )
        value = predictions[value]
    if not hasattr(value, "shape"):
        raise EstimatorTypeError(
            f"export_outputs[{name!r}] must be an array, a predictions key or an ExportOutput "
            f"(PredictOutput, ClassificationOutput, RegressionOutput), got {type(value).__name__}"
        )
    return value


def _one_signature(outputs: Mapping[str, Any]) -> tuple[dict, dict]:
    signature = {"method": PredictOutput.method_name, "outputs": {k: k for k in outputs}}
    return dict(outputs), {DEFAULT_SIGNATURE: signature}


def export_signatures(spec: Any) -> tuple[dict[str, Any], dict[str, dict]]:
    """``(flat outputs, signatures)`` of a PREDICT spec; see the module doc.

    Raises:
      ValueError: several ``ExportOutput`` entries and none is ``"serving_default"``, or a
        string names no ``predictions`` key.
      TypeError: an entry is neither an array, a ``predictions`` key nor an ``ExportOutput``.
    """
    preds, export_outputs = spec.predictions, spec.export_outputs
    if not export_outputs:
        return _one_signature(preds if isinstance(preds, Mapping) else {SINGLE_OUTPUT: preds})
    if not any(isinstance(v, ExportOutput) for v in export_outputs.values()):
        return _one_signature(
            {str(k): _resolve(str(k), v, preds) for k, v in export_outputs.items()}
        )
    entries = {
        str(k): v if isinstance(v, ExportOutput) else PredictOutput({str(k): _resolve(k, v, preds)})
        for k, v in export_outputs.items()
    }
    if len(entries) > 1 and DEFAULT_SIGNATURE not in entries:
        raise EstimatorValueError(
            f"export_outputs has several entries {sorted(entries)} and none is named "
            f"{DEFAULT_SIGNATURE!r}; name the default signature {DEFAULT_SIGNATURE!r} (TF's rule)"
        )
    single = len(entries) == 1
    outputs, signatures = {}, {}
    for entry, value in entries.items():
        names = {}
        for key, array in value.outputs.items():
            plain = not isinstance(export_outputs[entry], ExportOutput)
            flat = key if single or plain else f"{entry}/{key}"
            outputs[flat], names[key] = array, flat
        signatures[entry] = {"method": value.method_name, "outputs": names}
    if single:
        signatures.setdefault(DEFAULT_SIGNATURE, next(iter(signatures.values())))
    return outputs, signatures


__all__ = ["DEFAULT_SIGNATURE", "export_signatures"]
