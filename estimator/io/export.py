"""The export format: the PREDICT computation serialized by jax.export, written and loaded.

``export_saved_model`` (``driver/export.py``) restores the variables and traces model_fn;
this module holds what does not need a model: the serving input specs, the files written
and ``load_saved_model``.

Example:
  >>> serving_input_receiver_fn = estimator.build_raw_serving_input_receiver_fn(
  ...     {"x": np.zeros((1, 64), np.float32)})          # the batch dimension's size is ignored
  >>> path = est.export_saved_model("/tmp/export", serving_input_receiver_fn)
  >>> model = estimator.load_saved_model(path)          # any process; no model code needed
  >>> model({"x": x})                                   # {'class_ids': ..., 'logits': ...}

The serving input. ``serving_input_receiver_fn()`` takes no arguments and returns the
features model_fn receives in PREDICT mode, as shapes: a dict of name -> ``jax.ShapeDtypeStruct``
(or example array), or one of them alone. Each needs a leading batch dimension, whose size is
ignored: it becomes the symbolic dimension ``b``, so the export serves any batch size. (This is
TF's ``ServingInputReceiver`` reduced to its feature specs; an object with a ``features``
attribute is accepted too.) ``float64``/``int64`` become ``float32``/``int32`` as in training.

What is written: ``<export_dir_base>/<seconds since epoch>/`` (unique, written under a
``temp-`` name and renamed when complete; the number is TF Serving's model version; a killed
export's ``temp-`` folder is removed by the next export into the same base, see
``io/export_temp.py``) holding

* with TensorFlow installed (the ``tf`` extra), a TF SavedModel (``saved_model.pb``,
  ``variables/``) that TF Serving loads; see ``io/tf_saved_model.py``. Without it, one log line
  says how to get it;
* in ``assets.extra/`` (TF's place for extra files), our portable export:
* ``saved_model.jax``: the PREDICT computation for one device, serialized by ``jax.export``
  (StableHLO; runs wherever a compatible jaxlib does, on the export's ``platforms``);
* ``variables/variables.npz``: the variables by name (``dense/kernel``, ``batch_stats/...``,
  as ``get_variable_names`` names them), unless ``fold_variables=True`` folded them into the
  program as constants (``rewrite_for_inference``);
* ``signature.json``: input and output names, shapes (``"b"`` for the batch) and dtypes, the
  global step, how variables are stored, platforms and versions.

The outputs and signatures come from ``export_outputs`` of the PREDICT spec (TF's
``PredictOutput``/``ClassificationOutput``/``RegressionOutput``, or output name -> array or
``predictions`` key), else every entry of ``predictions`` (an array alone is named ``"output"``);
see ``io/signatures.py``. Every output needs the batch dimension first.
model_fn runs with ``params["batch_size"]`` equal to the symbolic batch size, the padding mask
all ones, the checkpoint's global step, and as replica 0 of 1.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import storage
from ..core.errors import EstimatorTypeError, EstimatorValueError
from . import disk_full, export_temp, tf_saved_model
from . import variables as variables_lib

COMPUTATION_FILE = "saved_model.jax"
VARIABLES_FILE = os.path.join("variables", "variables.npz")
SIGNATURE_FILE = "signature.json"
PORTABLE_DIR = "assets.extra"  # our export, inside the TF SavedModel directory
SIGNATURE_VERSION = 2
BATCH = "b"
_SINGLE_INPUT = "features"
_CANONICAL = {
    np.dtype(np.float64): np.float32,
    np.dtype(np.int64): np.int32,
    np.dtype(np.uint64): np.uint32,
}
logger = logging.getLogger(__name__)
_NO_TF_SAID = [False]  # the "TensorFlow is not installed" warning was given in this process


# --------------------------------------------------------------------------- serving input
def build_raw_serving_input_receiver_fn(features: Any) -> Callable[[], Any]:
    """A serving_input_receiver_fn for features shaped like ``features`` (TF's name).

    Args:
      features: a dict of name -> example array or ``jax.ShapeDtypeStruct`` (or one alone),
        each with a leading batch dimension of any size.

    Example:
      >>> fn = build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})
      >>> fn()["x"].shape[1:]
      (6,)
    """
    specs = feature_specs(features)
    return lambda: specs


def feature_specs(features: Any) -> Any:
    """Per-leaf ``ShapeDtypeStruct`` with canonical dtypes; checks names and ranks."""
    features = getattr(features, "features", features)
    if isinstance(features, Mapping):
        for key, value in features.items():
            if not isinstance(key, str) or isinstance(value, Mapping):
                raise EstimatorTypeError(
                    f"serving features must be a flat dict of str -> array spec; got key {key!r}"
                )
        return {k: _spec(v, k) for k, v in features.items()}
    return _spec(features, _SINGLE_INPUT)


def _spec(x: Any, name: str) -> jax.ShapeDtypeStruct:
    if not isinstance(x, jax.ShapeDtypeStruct):
        try:
            x = np.asarray(x)
        except Exception as e:  # noqa: BLE001
            raise EstimatorTypeError(f"serving feature {name!r} is not an array spec: {x!r}") from e
    dtype = np.dtype(x.dtype)
    if dtype.kind in "OUSV":
        raise EstimatorTypeError(f"serving feature {name!r} has non-numeric dtype {dtype}")
    if len(x.shape) == 0:
        raise EstimatorValueError(
            f"serving feature {name!r} is a scalar; it needs a leading batch dimension"
        )
    return jax.ShapeDtypeStruct(tuple(x.shape), _CANONICAL.get(dtype, dtype))


def symbolic(specs: Any) -> Any:
    (b,) = jax.export.symbolic_shape(BATCH)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((b, *s.shape[1:]), s.dtype), specs)


class ExportedProgram(NamedTuple):
    """The exported computation, the jitted function it came from, and what it serves."""

    exported: jax.export.Exported
    fn: Callable  # (variable leaves, features) -> outputs; (features) -> outputs when folded
    leaves: list | None  # the variables' values; None when folded
    signatures: dict  # signature key -> {"method", "outputs"} (io/signatures.py)


# --------------------------------------------------------------------------- writing
def _describe(avals: Any) -> dict:
    return {
        "shape": [d if isinstance(d, int) else str(d) for d in avals.shape],
        "dtype": np.dtype(avals.dtype).name,
    }


def describe_export(export: ExportedProgram, specs, variables, global_step, fold_variables) -> dict:
    exported = export.exported
    outs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    described = [
        {"name": n, **_describe(v)}
        for n, v in zip(variables_lib.names(variables), jax.tree.leaves(variables), strict=True)
    ]
    inputs = specs if isinstance(specs, Mapping) else {_SINGLE_INPUT: specs}
    return {
        "format": "tpu-estimator/jax.export",
        # 2: variables named as everywhere else (io/variables.py: ``dense/kernel``); 1 (no
        # field) named them with the collection in front (``params/dense/kernel``). The
        # loader takes the names from this list, so both load.
        "signature_version": SIGNATURE_VERSION,
        "signature_name": "serving_default",
        "batch_dimension": BATCH,
        "input_structure": "dict" if isinstance(specs, Mapping) else "array",
        "inputs": {k: _describe(symbolic(v)) for k, v in inputs.items()},
        "outputs": {k: _describe(v) for k, v in outs.items()},
        "signatures": export.signatures,
        "variables": {"stored": "folded" if fold_variables else VARIABLES_FILE, "list": described},
        "global_step": int(global_step),
        "platforms": list(exported.platforms),
        "calling_convention_version": exported.calling_convention_version,
        "jax_version": jax.__version__,
        "created": time.time(),
    }


def _json(signature: dict) -> str:
    """Indented JSON with each shape on one line."""
    text = json.dumps(signature, indent=2, sort_keys=True)
    shape = r'\[\s*((?:"b"|\d+)(?:,\s*(?:"b"|\d+))*)?\s*\]'
    return (
        re.sub(
            shape,
            lambda m: (
                "[" + ", ".join(re.split(r",\s*", m.group(1) or "")) + "]" if m.group(1) else "[]"
            ),
            text,
        )
        + "\n"
    )


def _write_tf(
    directory: str, export: ExportedProgram, names: list[str], specs: Any, serving_input: Any
) -> bool:
    """The TF SavedModel, when TensorFlow is installed; else one log line per process saying
    how (an exporter may export at every evaluation: not one warning each time)."""
    if not tf_saved_model.tensorflow_available():
        level = logging.DEBUG if _NO_TF_SAID[0] else logging.WARNING
        _NO_TF_SAID[0] = True
        logging.getLogger("estimator").log(
            level,
            "TensorFlow is not installed: wrote the portable export only (%s/), no TF "
            "SavedModel for TF Serving (said once per process); to get one: %s",
            PORTABLE_DIR,
            tf_saved_model.INSTALL_HINT,
        )
        return False
    leaves = export.leaves
    tf_saved_model.write_tf_saved_model(
        directory,
        export.fn,
        variables=None if leaves is None else list(zip(names, leaves, strict=True)),
        inputs=specs if isinstance(specs, Mapping) else {_SINGLE_INPUT: specs},
        single_input=not isinstance(specs, Mapping),
        signatures=export.signatures,
        platforms=export.exported.platforms,
        serving_input=serving_input,
    )
    return True


def write_export(
    base: str,
    export: ExportedProgram,
    names: list[str],
    specs: Any,
    signature: dict,
    serving_input: Any = None,
) -> str:
    """Writes the export into a new ``<base>/<timestamp>`` directory and returns its path.

    ``serving_input`` (``io/tf_serving_input.py``) makes the TF SavedModel's signatures take
    encoded images; it is recorded in ``signature.json`` as ``tf_serving_input``.

    Locally it is written as ``temp-<ts>`` and renamed when complete. On an object store it is
    written into a local staging directory, uploaded, and marked finished with
    ``storage.COMMIT_FILE`` last (readers skip an export without it).
    """
    writer = _write_remote if storage.is_url(base) else _write_local
    try:
        return writer(base, export, names, specs, signature, serving_input)
    except Exception as e:
        if disk_full.is_disk_full(e):  # TF's ResourceExhaustedError, numpy's or our ENOSPC
            raise disk_full.export_full_error(base) from e
        raise


def _write_local(
    base: str,
    export: ExportedProgram,
    names: list[str],
    specs: Any,
    signature: dict,
    serving_input: Any,
) -> str:
    if serving_input is not None:
        signature["tf_serving_input"] = dict(serving_input.description)
    temp, final, fd = export_temp.reserve(base)  # also removes dead exports' temp folders
    try:
        signature["tf_saved_model"] = _write_tf(temp, export, names, specs, serving_input)
        portable = os.path.join(temp, PORTABLE_DIR)
        os.makedirs(portable)
        with open(os.path.join(portable, COMPUTATION_FILE), "wb") as f:
            f.write(export.exported.serialize())
        if export.leaves is not None:
            os.makedirs(os.path.join(portable, "variables"))
            variables = dict(zip(names, export.leaves, strict=True))
            np.savez(os.path.join(portable, VARIABLES_FILE), **variables)
        with open(os.path.join(portable, SIGNATURE_FILE), "w") as f:
            f.write(_json(signature))
        export_temp.unlock(temp, fd)
        fd = -1
        while True:
            try:
                os.rename(temp, final)
                return final
            except OSError:
                if not os.path.exists(final):
                    raise
                # another export took this second meanwhile
                final = os.path.join(base, str(int(os.path.basename(final)) + 1))
    except BaseException:
        if fd >= 0:
            export_temp.unlock(temp, fd)
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _write_remote(
    base: str,
    export: ExportedProgram,
    names: list[str],
    specs: Any,
    signature: dict,
    serving_input: Any,
) -> str:
    with tempfile.TemporaryDirectory(prefix="tpu_estimator_export_") as local_base:
        local = _write_local(local_base, export, names, specs, signature, serving_input)
        stamp = int(os.path.basename(local))
        while storage.exists(storage.join(base, str(stamp))):
            stamp += 1  # another export took this second meanwhile
        final = storage.join(base, str(stamp))
        with storage.staged(final) as staging:
            shutil.copytree(local, staging, dirs_exist_ok=True)
        return final


# --------------------------------------------------------------------------- loading
class LoadedModel:
    """An exported PREDICT computation, callable on numpy features; see ``load_saved_model``."""

    def __init__(self, path: str):
        self.path = path
        root = _portable_dir(path)
        if root is None:
            raise EstimatorValueError(f"{path!r} is not an export directory (no {SIGNATURE_FILE})")
        self.signature = json.loads(storage.read_text(storage.join(root, SIGNATURE_FILE)))
        computation = storage.read_bytes(storage.join(root, COMPUTATION_FILE))
        self.exported = jax.export.deserialize(bytearray(computation))
        var = self.signature["variables"]
        self._variables = None
        if var["stored"] != "folded":
            stored = storage.join(root, _inside(var["stored"], path))
            with np.load(io.BytesIO(storage.read_bytes(stored)), allow_pickle=False) as npz:
                self._variables = [
                    jnp.asarray(_as_dtype(npz[v["name"]], v["dtype"])) for v in var["list"]
                ]
        self._call = jax.jit(self.exported.call)

    @property
    def input_names(self) -> list[str]:
        return list(self.signature["inputs"])

    @property
    def output_names(self) -> list[str]:
        return list(self.signature["outputs"])

    def _features(self, features: Any, kwargs: dict) -> Any:
        sig = self.signature["inputs"]
        if features is None:
            features = kwargs
        elif kwargs:
            raise EstimatorTypeError(
                "pass the features either as one argument or as keywords, not both"
            )
        if self.signature["input_structure"] == "array":
            features = features.get(_SINGLE_INPUT) if isinstance(features, Mapping) else features
            return _conform(features, sig[_SINGLE_INPUT], _SINGLE_INPUT)
        if not isinstance(features, Mapping):
            raise EstimatorTypeError(f"features must be a dict with keys {sorted(sig)}")
        missing, extra = sorted(set(sig) - set(features)), sorted(set(features) - set(sig))
        if missing or extra:
            raise EstimatorValueError(
                f"features: missing {missing}, unexpected {extra}; the export takes {sorted(sig)}"
            )
        return {k: _conform(features[k], sig[k], k) for k in sig}

    def __call__(self, features: Any = None, /, **kwargs: Any) -> dict[str, np.ndarray]:
        """Runs the computation; returns ``{output name: numpy array}``."""
        feats = self._features(features, kwargs)
        rows = {
            k: v.shape[0]
            for k, v in (feats.items() if isinstance(feats, dict) else [(_SINGLE_INPUT, feats)])
        }
        if len(set(rows.values())) != 1:
            raise EstimatorValueError(f"features have different batch sizes: {rows}")
        args = (feats,) if self._variables is None else (self._variables, feats)
        return {k: np.asarray(v) for k, v in self._call(*args).items()}

    def __repr__(self) -> str:
        return f"LoadedModel({self.path!r}, inputs={self.input_names}, outputs={self.output_names})"


def _as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    want = jnp.dtype(dtype)
    return x.view(want) if x.dtype != want and x.dtype.itemsize == want.itemsize else x


def _conform(x: Any, sig: dict, name: str) -> np.ndarray:
    arr = np.asarray(x)
    want = tuple(sig["shape"][1:])
    if arr.ndim != len(sig["shape"]) or arr.shape[1:] != want:
        raise EstimatorValueError(
            f"feature {name!r} has shape {arr.shape}; the export takes "
            f"(batch, {', '.join(map(str, want))})"
        )
    dtype = jnp.dtype(sig["dtype"])
    if arr.dtype != dtype and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise EstimatorTypeError(
            f"feature {name!r} has dtype {arr.dtype}; the export takes {dtype}"
        )
    return arr.astype(dtype, copy=False)


def _inside(stored: Any, path: str) -> str:
    """``signature.json``'s ``stored`` entry, refused unless it names a file inside the export
    (a crafted ``../../outside.npz`` must not make the loader read elsewhere)."""
    parts = stored.split("/") if isinstance(stored, str) else [""]
    if (
        not isinstance(stored, str)
        or not stored
        or stored.startswith("/")
        or "\\" in stored
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise EstimatorValueError(
            f"export {path!r}: signature.json's variables.stored={stored!r} does not name a "
            "file inside the export; the export was altered, refusing to load it"
        )
    return stored


def _portable_dir(path: str) -> str | None:
    """Where an export's ``signature.json`` is: ``assets.extra/``, or the directory itself
    (exports written before the TF SavedModel)."""
    for root in (storage.join(path, PORTABLE_DIR), path):
        if storage.isfile(storage.join(root, SIGNATURE_FILE)):
            return root
    return None


def export_versions(base: str) -> list[int]:
    """The finished exports' timestamps in an export base directory, oldest first (on an
    object store only those with their commit marker: an upload in progress is not one)."""
    try:
        names = storage.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    stamps = sorted(int(d) for d in names if d.isdigit())
    if storage.is_url(base):
        stamps = [s for s in stamps if storage.finished_step(storage.join(base, str(s)))]
    return stamps


def load_saved_model(path: str) -> LoadedModel:
    """Loads an export: a callable ``model(features) -> {output name: numpy array}``.

    Needs only this package's loader, JAX and numpy (not the model code, not TensorFlow).
    ``path`` is a timestamped export directory, or an export base directory (its newest export
    is used).

    Example:
      >>> model = estimator.load_saved_model("/tmp/export/1700000000")
      >>> model({"x": x})["logits"].shape            # any batch size
      (7, 10)
    """
    path = storage.absolute(os.fspath(path)) if storage.is_url(path) else os.fspath(path)
    if _portable_dir(path) is None:
        stamps = export_versions(path)
        if not stamps:
            raise EstimatorValueError(f"{path!r} is not an export directory (no {SIGNATURE_FILE})")
        path = storage.join(path, str(max(stamps)))
    return LoadedModel(path)


__all__ = [
    "ExportedProgram",
    "LoadedModel",
    "build_raw_serving_input_receiver_fn",
    "load_saved_model",
]
