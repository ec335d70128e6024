"""Calling the user's model_fn: argument introspection and the Flax root module it builds under.

Modules that model_fn constructs attach to ``_Root``'s compact scope, so the estimator owns
every variable: ``params`` is what ``train_op`` trains and every other collection is state.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax

from ..core import context
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.spec import ModeKeys, TPUEstimatorSpec, as_tpu_spec
from ..core.tpu_context import TPUContext
from ..parallel.mesh import DATA
from ..parallel.replica_context import replica_scope
from .multi_loss import leaf_names

_MODEL_FN_ARGS = ("features", "labels", "mode", "params", "config")
RESERVED_PARAMS = ("batch_size", "context")


def model_fn_args(model_fn: Callable) -> tuple[str, ...]:
    """The argument names model_fn takes, checked against TPUEstimator's rules.

    Raises:
      ValueError: an unknown argument name, or no ``params`` argument.
    """
    fn = model_fn.func if hasattr(model_fn, "func") else model_fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise EstimatorValueError(f"model_fn is not inspectable: {e}") from None
    names = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "self":
            continue
        if p.name not in _MODEL_FN_ARGS:
            raise EstimatorValueError(
                f"model_fn has an unexpected argument {p.name!r}; it may take only "
                f"{', '.join(_MODEL_FN_ARGS)}"
            )
        names.append(p.name)
    if hasattr(model_fn, "keywords"):
        names = [n for n in names if n not in model_fn.keywords]
    if "features" not in names:
        raise EstimatorValueError("model_fn must take a 'features' argument")
    if "params" not in names:
        raise EstimatorValueError(
            "model_fn must take a 'params' argument: the estimator passes the per-replica "
            "batch size to it as params['batch_size']"
        )
    return tuple(names)


def user_params(params: Any) -> dict:
    """A deep copy of the user's params, refusing the keys the estimator reserves."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        try:
            params = dict(params)
        except (TypeError, ValueError):
            raise EstimatorTypeError(
                f"params must be a dict, got {type(params).__name__}"
            ) from None
    for key in RESERVED_PARAMS:
        if key in params:
            raise EstimatorValueError(
                f"params[{key!r}] is reserved by the estimator; use another name"
            )
    return copy.deepcopy(params)


class _Root(nn.Module):
    """Calls model_fn inside a compact scope so the modules it makes become our children."""

    model_fn: Callable
    arg_names: tuple
    mode: str
    params: dict
    config: Any

    @nn.compact
    def __call__(self, features, labels):
        values = {
            "features": features,
            "labels": labels,
            "mode": self.mode,
            "params": self.params,
            "config": self.config,
        }
        with context.root_module(self):  # estimator.trainable_variables() reads its params
            spec = self.model_fn(**{n: values[n] for n in self.arg_names})
        # read after the call: ExponentialMovingAverage.variables_to_restore() in scaffold_fn
        context.note_param_names(leaf_names(nn.meta.unbox(self.variables.get("params", {}))))
        return spec


class ModelFn:
    """The user's model_fn with its arguments resolved, callable for one replica's batch."""

    def __init__(self, model_fn: Callable, params: dict, config: Any):
        self.fn = model_fn
        self.arg_names = model_fn_args(model_fn)
        self.params = params
        self.config = config
        self.num_replicas = 1  # set by the estimator from its mesh
        self.num_cores_per_replica = 1
        self.use_tpu = True  # params["use_tpu"], set by the estimator
        self.notes: dict[str, dict] = {}  # mode -> the notes of model_fn's last trace
        # mode -> the scaffold_fn of the spec model_fn last returned there (kept here, not
        # only in Programs.specs: a cached trace does not call model_fn again to record it)
        self.scaffold_fns: dict[str, Callable | None] = {}

    def noted(self, mode: str, key: str, default: Any = None) -> Any:
        """What model_fn's last trace in ``mode`` noted under ``key`` (see CallContext)."""
        return self.notes.get(mode, {}).get(key, default)

    def check_labels(self, has_labels: bool) -> None:
        if has_labels and "labels" not in self.arg_names:
            raise EstimatorValueError(
                "input_fn returned labels, but model_fn does not take a 'labels' argument"
            )

    @contextlib.contextmanager
    def _scope(self, mode: str, mask, step, *, initializing: bool = False):
        """model_fn runs as one replica over the mesh's ``"data"`` axis: its padding mask and
        step are current, and ``get_replica_context()`` gives the cross-replica helpers."""
        ctx = context.CallContext(mode, mask, step, initializing)
        with context.calling_model_fn(ctx):
            with replica_scope(self.num_replicas, axis_name=DATA):
                yield
        self.notes[mode] = ctx.notes

    def _root(self, mode: str, batch_size: int | None) -> _Root:
        params = copy.deepcopy(self.params)
        if batch_size is not None:
            params["batch_size"] = batch_size
        params["use_tpu"] = self.use_tpu  # as TF sets it (a user value is replaced)
        params["context"] = TPUContext(
            mode=mode,
            num_replicas=self.num_replicas,
            num_hosts=jax.process_count(),
            num_cores_per_replica=self.num_cores_per_replica,
        )
        return _Root(self.fn, self.arg_names, mode, params, self.config)

    def init(self, rngs: dict, features, labels, *, mode: str, batch_size: int | None, mask, step):
        """Creates every variable by tracing model_fn once; returns (variables, spec)."""
        root = self._root(mode, batch_size)
        with self._scope(mode, mask, step, initializing=True), _explained_name_clash():
            spec, variables = root.init_with_output(rngs, features, labels)
        return variables, self._noted_spec(spec, mode)

    def _noted_spec(self, spec: Any, mode: str) -> TPUEstimatorSpec:
        spec = as_tpu_spec(spec, mode)
        self.scaffold_fns[mode] = spec.scaffold_fn
        return spec

    def apply(
        self,
        variables: dict,
        features,
        labels,
        *,
        mode: str,
        batch_size: int | None,
        mask,
        step,
        rngs: dict | None = None,
        mutable: tuple = (),
    ) -> tuple[TPUEstimatorSpec, dict]:
        """Runs model_fn on existing variables; returns (spec, updated mutable collections).

        With no ``mutable`` (EVAL, PREDICT, export) the state collections are still writable
        and what model_fn writes is dropped: a BatchNorm in training mode there (TF programs
        call their networks with ``is_training=True`` in EVAL) normalises with the batch's
        statistics, as TF did, and its moving averages stay as trained.
        """
        root = self._root(mode, batch_size)
        writable = list(mutable) or [c for c in variables if c != "params"]
        with self._scope(mode, mask, step), _explained_name_clash():
            spec, new_vars = root.apply(variables, features, labels, rngs=rngs, mutable=writable)
        return self._noted_spec(spec, mode), dict(new_vars) if mutable else {}


@contextlib.contextmanager
def _explained_name_clash():
    """Flax's NameInUseError from model_fn, with the TF way to share the variables.

    A TF program builds a network twice under one ``variable_scope(reuse=AUTO_REUSE)`` (a GAN's
    discriminator on real and generated images); its direct port builds two Flax modules of
    one name, which Flax refuses with no hint.
    """
    try:
        yield
    except flax.errors.NameInUseError as e:
        first = str(e).splitlines()[0]
        found = re.search(r'"([^"]+)"', first)
        name = found.group(1) if found else "<name>"
        raise EstimatorValueError(
            f"{first} model_fn builds two modules (or variables) named {name!r} in one scope. "
            "To share their variables, as TF's variable_scope(reuse=tf.AUTO_REUSE) did, build "
            f"them under `with estimator.variable_scope({name!r}, "
            "reuse=estimator.AUTO_REUSE):` (the modules inside, named as before) or construct "
            "the module once and call that instance twice; to keep two copies, give them "
            "different names"
        ) from e


def step_rngs(base_key: jax.Array, step, replica) -> dict:
    """Per-step, per-replica RNG streams: ``params`` (the fallback for any stream name a
    module asks for) and ``dropout``, derived from the seed, the global step and the replica."""
    key = jax.random.fold_in(jax.random.fold_in(base_key, step), replica)
    k_params, k_dropout = jax.random.split(key)
    return {"params": k_params, "dropout": k_dropout}


__all__ = ["ModeKeys", "ModelFn", "model_fn_args", "user_params", "step_rngs"]
