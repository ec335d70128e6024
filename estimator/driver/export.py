"""export_saved_model: traces model_fn in PREDICT mode on one device, exports it with the
checkpoint's variables and writes the result.

The restore and the trace happen here, on the driver side; what is written and how it is
loaded again (``load_saved_model``, the serving input, the file layout) is
``io/export.py``.

Example:
  >>> fn = build_raw_serving_input_receiver_fn({"x": np.zeros((1, 64), np.float32)})
  >>> path = export_saved_model(programs, store, "/tmp/export", fn)   # est.export_saved_model
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.runtime import seed_key_data
from ..core.spec import ModeKeys
from ..engine.model import step_rngs
from ..engine.programs import Programs
from ..io import variables as variables_lib
from ..io.export import ExportedProgram, describe_export, feature_specs, symbolic, write_export
from ..io.inference import rewrite_for_inference, validate_inference_rewrite_for_variables
from ..io.restore import restore_variables
from ..io.signatures import export_signatures
from ..io.store import StateStore
from ..parallel.mesh import DATA, single_device_mesh
from ..parallel.outside_compilation import forbid_host_calls
from ..weights.scaffold import saver_sources


def _restore(
    programs: Programs, store: StateStore, specs: Any, checkpoint_path: str | None
) -> tuple[dict, int]:
    """The checkpoint's variables (host numpy) and global step, shaped by a 1-row trace."""
    rows = programs.mesh.shape[DATA]
    zeros = jax.tree.map(lambda s: np.zeros((1, rows, *s.shape[1:]), s.dtype), specs)
    traced = programs.traced(ModeKeys.PREDICT)
    variables, step = restore_variables(
        programs,
        store,
        ModeKeys.PREDICT,
        (zeros, None),
        1,
        checkpoint_path,
        saver_sources=saver_sources,
    )
    if not traced:  # predict's own trace must record the spec, not this 1-row one
        programs.specs.pop(ModeKeys.PREDICT, None)
    return jax.tree.map(np.asarray, jax.device_get(variables)), step


def _predict_fn(programs: Programs, global_step: int, signatures: dict) -> Callable:
    """``(variables, features) -> {name: array}``: model_fn in PREDICT mode on one device.

    Tracing it records the export's signatures (``io/signatures.py``) in ``signatures``.
    """

    key = jax.random.wrap_key_data(seed_key_data(programs.config.tf_random_seed))

    def predict(variables, features):
        batch = jax.tree.leaves(features)[0].shape[0]
        step = jnp.int32(global_step)
        spec, _ = programs.model.apply(
            variables,
            features,
            None,
            mode=ModeKeys.PREDICT,
            batch_size=batch,
            mask=jnp.ones((batch,), jnp.float32),
            step=step,
            rngs=step_rngs(key, step, 0),
        )
        outputs, found = export_signatures(spec)
        signatures.clear()
        signatures.update(found)
        for name, value in outputs.items():
            if len(value.shape) == 0 or value.shape[0] != batch:
                raise EstimatorValueError(
                    f"export output {name!r} has shape {tuple(value.shape)}; every output "
                    f"needs the batch dimension ({batch}) first"
                )
        return outputs

    return jax.shard_map(
        predict,
        mesh=single_device_mesh(),
        in_specs=(P(), P(DATA)),
        out_specs=P(DATA),
        axis_names={DATA},
    )


def _export(
    programs: Programs,
    specs: Any,
    variables: dict,
    global_step: int,
    *,
    fold_variables: bool,
    platforms,
) -> ExportedProgram:

    signatures: dict = {}
    predict = _predict_fn(programs, global_step, signatures)
    sym = symbolic(specs)
    kwargs = {"platforms": tuple(platforms)} if platforms else {}
    reason = "cannot be exported: host callbacks are not serializable by jax.export"
    with forbid_host_calls(reason):
        if fold_variables:
            program = rewrite_for_inference(predict, variables=variables, name="serving_default")
            exported = jax.export.export(program.jitted, **kwargs)(sym)
            validate_inference_rewrite_for_variables(exported, inputs=[sym])
            return ExportedProgram(exported, program.jitted, None, signatures)
        leaves, treedef = jax.tree.flatten(variables)

        def serving_default(var_leaves, features):
            return predict(jax.tree.unflatten(treedef, var_leaves), features)

        structs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves]
        fn = jax.jit(serving_default)
        return ExportedProgram(
            jax.export.export(fn, **kwargs)(structs, sym), fn, leaves, signatures
        )


def export_saved_model(
    programs: Programs,
    store: StateStore,
    export_dir_base: str,
    serving_input_receiver_fn: Callable,
    checkpoint_path: str | None = None,
    *,
    fold_variables: bool = False,
    platforms: tuple[str, ...] | None = None,
) -> str:
    """Writes the PREDICT computation, its variables and its signature; returns the directory.

    Args:
      programs: the estimator's compiled programs (its model_fn and config).
      store: the estimator's checkpoints.
      export_dir_base: the timestamped export directory is made inside it.
      serving_input_receiver_fn: ``() -> features`` as shapes (see the module doc).
      checkpoint_path: a checkpoint to export (default: the latest in ``model_dir``).
      fold_variables: keyword-only. True folds the variables into the program as constants
        (``rewrite_for_inference``, validated); False (default) stores them beside it.
      platforms: keyword-only; platforms to lower for (e.g. ``("cpu", "cuda")``); default the
        current backend's.

    Raises:
      ValueError: no checkpoint, a bad serving input, or an output without a batch dimension.
      RuntimeError: model_fn uses ``outside_compilation`` in PREDICT mode.
    """
    if not callable(serving_input_receiver_fn):
        raise EstimatorTypeError(
            f"serving_input_receiver_fn must be callable, got {serving_input_receiver_fn!r}"
        )
    receiver = serving_input_receiver_fn()
    specs = feature_specs(receiver)
    variables, step = _restore(programs, store, specs, checkpoint_path)
    export = _export(
        programs, specs, variables, step, fold_variables=fold_variables, platforms=platforms
    )
    signature = describe_export(export, specs, variables, step, fold_variables)
    if jax.process_index() != 0:
        return ""
    names = variables_lib.names(variables)
    # an encoded-image receiver: TF decodes inside the TF SavedModel (io/tf_serving_input.py)
    serving_input = getattr(receiver, "tf_serving_input", None)
    return write_export(str(export_dir_base), export, names, specs, signature, serving_input)


__all__ = ["export_saved_model"]
