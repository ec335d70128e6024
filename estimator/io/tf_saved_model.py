"""A TensorFlow SavedModel of the PREDICT computation, for TF Serving (the optional ``tf`` extra).

``export_saved_model`` calls ``write_tf_saved_model`` when TensorFlow is installed. The JAX
computation is converted with ``jax2tf`` (native serialization: the StableHLO module runs inside
one ``XlaCallModule`` op), its variables become ``tf.Variable`` s saved under ``variables/``
(not constants in ``saved_model.pb``), and the batch dimension stays symbolic (``-1`` in the
signatures). One signature per entry of the export's signature description:
``serving_default`` plus one per ``export_outputs`` entry.

Example:
  >>> write_tf_saved_model(
  ...     path, fn, variables=[("dense/kernel", w)],
  ...     inputs={"x": jax.ShapeDtypeStruct((1, 64), np.float32)}, single_input=False,
  ...     signatures={"serving_default": {"method": "tensorflow/serving/predict",
  ...                                     "outputs": {"logits": "logits"}}})
  >>> tf.saved_model.load(path).signatures["serving_default"](x=x)["logits"]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

INSTALL_HINT = "pip install 'tpu-estimator-jax[tf]'"
_CLASSIFY = "tensorflow/serving/classify"  # TF's CLASSIFY_METHOD_NAME


def tensorflow_available() -> bool:
    """Whether ``import tensorflow`` works (it is an optional dependency)."""
    try:
        importlib.import_module("tensorflow")
    except ImportError:
        return False
    return True


def _tf():
    # TensorFlow (and jax2tf, which imports it) is an optional, heavy dependency (~5 s to
    # import): imported here, only when a SavedModel is written.
    try:
        tf = importlib.import_module("tensorflow")
        from jax.experimental import jax2tf
    except ImportError as e:
        raise ImportError(
            f"writing a TensorFlow SavedModel needs TensorFlow: {INSTALL_HINT}"
        ) from e
    try:
        # Converting and saving run on the CPU; a GPU build of TensorFlow would otherwise
        # reserve the accelerator's memory that JAX holds in this process.
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow was already initialised by the application: leave it
        pass
    return tf, jax2tf


def write_tf_saved_model(
    directory: str,
    fn: Callable,
    *,
    variables: Sequence[tuple[str, np.ndarray]] | None,
    inputs: Mapping[str, Any],
    single_input: bool,
    signatures: Mapping[str, Mapping[str, Any]],
    platforms: Sequence[str] | None = None,
    serving_input: Any = None,
) -> None:
    """Converts ``fn`` with jax2tf and saves it, with its variables, as a TF SavedModel.

    Args:
      directory: where to write (``saved_model.pb``, ``variables/``, ``assets/``).
      fn: ``fn(variable_leaves, features) -> {flat output name: array}`` (``fn(features)`` when
        ``variables`` is None: folded by ``rewrite_for_inference``).
      variables: ``(name, value)`` per leaf, in ``fn``'s order; saved as ``tf.Variable`` s.
      inputs: feature name -> spec (``.shape``, ``.dtype``; the leading dimension is the batch).
      single_input: ``fn`` takes the one feature as an array, not a dict.
      signatures: signature key -> ``{"method": <TF method name>, "outputs": {output key:
        flat output name}}`` (``io/signatures.py``). A classification signature's ``classes``
        become strings (TF's dtype for them): integer class ids as their decimal digits.
      platforms: jax2tf native serialization platforms (default: the current backend).
      serving_input: a ``tf_serving_input.TFServingInput``: the signatures take its receiver
        tensors (encoded images) and decode them with TF ops before ``fn``; the module's
        ``forward`` still takes the features.
    """
    tf, jax2tf = _tf()
    specs = {
        name: tf.TensorSpec([None, *spec.shape[1:]], tf.as_dtype(np.dtype(spec.dtype)), name=name)
        for name, spec in inputs.items()
    }
    input_signature = next(iter(specs.values())) if single_input else specs
    poly = "(b, ...)"
    kwargs = {"native_serialization_platforms": tuple(platforms)} if platforms else {}
    converted = jax2tf.convert(
        fn,
        with_gradient=False,
        polymorphic_shapes=[poly] if variables is None else [None, poly],
        **kwargs,
    )
    module = tf.Module()
    # Trainable=False: the SavedModel is for inference (jax2tf's converted function has no
    # gradient); the names are the export's variable names (``dense/kernel``).
    module.variables_list = [
        tf.Variable(value, trainable=False, name=_tf_name(name)) for name, value in variables or []
    ]

    def forward(features):
        if variables is None:
            return converted(features)
        return converted(module.variables_list, features)

    # One traced function shared by every signature, so the module (and, when folded, its
    # constants) is stored once.
    module.forward = tf.function(forward, input_signature=[input_signature], autograph=False)
    entry = module.forward
    if serving_input is not None:  # TF decodes the receiver tensors in front of the model
        input_signature = serving_input.input_signature(tf)
        entry = tf.function(
            lambda received: module.forward(serving_input.features(tf, received)),
            input_signature=[input_signature],
            autograph=False,
        )
        module.serve = entry
    concrete = {
        key: _signature_function(tf, entry, sig).get_concrete_function(input_signature)
        for key, sig in signatures.items()
    }
    tf.saved_model.save(module, directory, signatures=concrete)


def _tf_name(name: str) -> str:
    """A legal TF variable name for ``name``: TF's root scope must start with a letter, a
    digit or ``.``, so a Flax module named ``_ResNet_0`` (any class starting with ``_``) is
    stored as ``._ResNet_0/...`` (only the stored label; the export's names are unchanged)."""
    name = "".join(c if c.isalnum() or c in "_./-" else "_" for c in name) or "variable"
    return name if name[0].isalnum() or name[0] == "." else "." + name


def _signature_function(tf, forward, sig: Mapping[str, Any]):
    method, outputs = sig["method"], dict(sig["outputs"])

    def serve(features):
        flat = forward(features)
        result = {}
        for key, flat_name in outputs.items():
            value = flat[flat_name]
            if method == _CLASSIFY and key == "classes" and value.dtype != tf.string:
                value = tf.strings.as_string(value)  # TF's classification signature: strings
            result[key] = value
        return result

    return tf.function(serve, autograph=False)


__all__ = ["INSTALL_HINT", "tensorflow_available", "write_tf_saved_model"]
