"""Mixed precision: the compute-dtype policy, its casts, and dynamic loss scaling.

``TPUConfig(compute_dtype="bfloat16" | "float16")`` runs model_fn on low-precision copies:
every floating-point input and every parameter the model reads is cast to the compute dtype
on the way in (``cast_floats``), and the gradient is taken with respect to the float32
master parameters *through* that cast, so the optimizer state, the batch statistics and the
checkpoints stay float32 (``keep_dtypes`` casts updated collections back). Host-bound
tensors (host_call, eval_metrics, predictions) come back as float32 (``float32_outputs``).
The loops make those casts through one ``Policy`` (``to_compute`` on the way in,
``from_compute`` on the way out), resolved once with the other step options
(``engine/options.py``).

``"float16"`` adds dynamic loss scaling (``LossScale``, TF's and Keras's defaults): the loss
is multiplied by the scale before the gradient and the gradient divided by it after; a step
whose gradient is not finite is skipped (the parameters, optimizer state and collections keep
their values; ``TrainState.nonfinite`` counts it) and the scale halves; after
``GROWTH_INTERVAL`` finite steps in a row it doubles.

``bfloat16_scope()`` is TF's block form: inside the block, Flax module calls compute in
bfloat16 (see its docstring for what it covers).

Example:
  >>> config = estimator.TPUConfig(compute_dtype="bfloat16")
  >>> def model_fn(features, labels, mode, params):
  ...     with estimator.tpu.bfloat16_scope():
  ...         logits = nn.Dense(10)(features)      # bf16 compute, float32 kernel
  ...     logits = logits.astype(jnp.float32)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

COMPUTE_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Dynamic loss scaling: TF's LossScaleOptimizer / Keras 3's defaults (initial 2**15, x2 after
# 2000 finite steps, /2 on a non-finite gradient). The floor of 1 is TF's: a scale below 1
# would shrink gradients that already overflow for a reason loss scaling cannot fix.
INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 2000
FACTOR = 2.0
MIN_SCALE = 1.0


def dtype_of(name: str | None) -> Any:
    """The jnp dtype for a ``TPUConfig.compute_dtype`` value (None: no policy)."""
    return None if name is None else COMPUTE_DTYPES[name]


def _is_wide_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4


def cast_floats(tree: Any, dtype: Any) -> Any:
    """``tree`` with float32/float64 leaves cast to ``dtype`` (ints, bools, and leaves that
    are already low precision are kept). ``dtype=None`` returns ``tree`` unchanged."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if _is_wide_float(x) else x, tree)


def cast_params(variables: dict, dtype: Any) -> dict:
    """``variables`` with the ``params`` collection cast (``cast_floats``); the other
    collections (batch statistics) are read as stored."""
    if dtype is None or "params" not in variables:
        return variables
    return {**variables, "params": cast_floats(variables["params"], dtype)}


def float32_outputs(tree: Any, dtype: Any) -> Any:
    """Host-bound tensors in float32: ``dtype`` (the compute dtype) leaves are widened."""
    if dtype is None or tree is None:
        return tree
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if getattr(x, "dtype", None) == dtype else x, tree
    )


def keep_dtypes(new: Any, like: Any) -> Any:
    """``new`` with each leaf cast to the dtype of the matching leaf of ``like``: updated
    collections (batch statistics) keep their float32 storage whatever the compute dtype."""
    return jax.tree.map(lambda n, o: n.astype(o.dtype) if n.dtype != o.dtype else n, new, like)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The compute-dtype policy of the compiled loops: one cast into the compute dtype on the
    way into model_fn (``to_compute``) and one cast out of it (``from_compute``).

    Attributes:
      compute_dtype: ``TPUConfig.compute_dtype`` (None: float32, and both casts keep every
        leaf as it is).

    Example:
      >>> policy = Policy("bfloat16")
      >>> variables, x = policy.to_compute({"params": {"w": jnp.ones(2)}}, jnp.ones(3))
      >>> variables["params"]["w"].dtype, x.dtype, policy.loss_scaled
      (dtype(bfloat16), dtype(bfloat16), False)
      >>> host, _ = policy.from_compute({"logits": x})
      >>> host["logits"].dtype
      dtype('float32')
    """

    compute_dtype: str | None = None

    @property
    def dtype(self) -> Any:
        """The jnp compute dtype (None: no policy)."""
        return dtype_of(self.compute_dtype)

    @property
    def loss_scaled(self) -> bool:
        """float16 compute: the loss is scaled dynamically (``LossScale`` in the train state,
        checkpointed as ``loss_scale``), and a step that overflows is skipped."""
        return self.compute_dtype == "float16"

    def to_compute(self, variables: dict, features: Any) -> tuple[dict, Any]:
        """What model_fn reads: the ``params`` collection of ``variables`` and the float
        ``features`` cast to the compute dtype (``cast_params``, ``cast_floats``); the other
        collections (batch statistics) are read as stored. Under ``grad``, the gradient
        reaches the float32 master parameters through the cast."""
        dtype = self.dtype
        return cast_params(variables, dtype), cast_floats(features, dtype)

    def from_compute(self, host: Any, new_state: Any = None, stored: Any = None) -> tuple[Any, Any]:
        """What leaves the step: ``host`` (host_call tensors, eval metrics, predictions) with
        compute-dtype leaves widened to float32 (``float32_outputs``), and the updated
        collections ``new_state`` in the dtypes of ``stored``, the collections they replace
        (``keep_dtypes``; ``stored=None`` returns ``new_state`` as given)."""
        host = float32_outputs(host, self.dtype)
        if stored is not None:
            new_state = keep_dtypes(new_state, stored)
        return host, new_state


class LossScale(NamedTuple):
    """Dynamic loss-scale state (part of ``TrainState``; checkpointed as ``loss_scale``)."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32: finite steps since the last change


def initial_loss_scale() -> LossScale:
    return LossScale(jnp.float32(INITIAL_SCALE), jnp.int32(0))


def loss_scale_shapes() -> LossScale:
    return LossScale(jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))


def scale_loss(loss: jax.Array, loss_scale: LossScale | None) -> jax.Array:
    return loss if loss_scale is None else loss * loss_scale.scale


def unscale(grads: Any, loss_scale: LossScale | None) -> Any:
    if loss_scale is None:
        return grads
    inv = 1.0 / loss_scale.scale
    return jax.tree.map(lambda g: (g * inv).astype(g.dtype), grads)


def next_loss_scale(
    loss_scale: LossScale,
    finite: jax.Array,
    *,
    growth_interval: int = GROWTH_INTERVAL,
    factor: float = FACTOR,
    min_scale: float = MIN_SCALE,
) -> LossScale:
    """The scale after a step: halved (``/factor``, not below ``min_scale``) when the step's
    gradient was not finite; ``*factor`` once ``growth_interval`` finite steps ran in a row.
    Pure, so it runs inside the compiled step.

    Example:
      >>> s = next_loss_scale(LossScale(jnp.float32(8.0), jnp.int32(1)), jnp.bool_(True),
      ...                     growth_interval=2)
      >>> float(s.scale), int(s.good_steps)
      (16.0, 0)
    """
    scale, good = loss_scale.scale, loss_scale.good_steps
    grow = finite & (good + 1 >= growth_interval)
    up = jnp.where(grow, scale * factor, scale)
    down = jnp.maximum(scale / factor, jnp.float32(min_scale))
    new_scale = jnp.where(finite, up, down).astype(jnp.float32)
    new_good = jnp.where(finite & ~grow, good + 1, 0).astype(jnp.int32)
    return LossScale(new_scale, new_good)


def _cast_args(value: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            x.astype(dtype) if isinstance(x, jax.Array | np.ndarray) and _is_wide_float(x) else x
        ),
        value,
    )


def _has_unset_dtype(module: nn.Module) -> bool:
    fields = {f.name for f in dataclasses.fields(module)}
    return "dtype" in fields and module.dtype is None


@contextlib.contextmanager
def bfloat16_scope(dtype: Any = jnp.bfloat16) -> Iterator[None]:
    """TF's ``tf.tpu.bfloat16_scope()``: Flax modules called in the block compute in bfloat16.

    Inside the block, every Flax module method call (through ``flax.linen.intercept_methods``)
    gets its float32 array arguments cast to bfloat16, and a module whose ``dtype`` field is
    unset (``None``, the default of ``nn.Dense``, ``nn.Conv``, ``nn.Embed``, the norms and
    attention) computes in bfloat16 for that call: Flax casts the parameters it reads to the
    computation dtype, so the variables stay float32 (created with their ``param_dtype``) and
    the gradient reaches the float32 weights through the cast, as TF's custom getter did.

    Not covered: a module whose ``dtype`` is set explicitly (kept, like a float32 softmax
    layer), and raw ``jnp`` math on ``self.param(...)`` in a module without a ``dtype``
    field (cast those by hand, or use ``TPUConfig(compute_dtype=...)``, which casts every
    parameter). Outputs are bfloat16: cast what leaves the block (the logits) to float32
    before a loss, as TF programs did. It applies wherever model_fn runs, export included:
    this is how a model asks to be served in bfloat16.

    Example:
      >>> def model_fn(features, labels, mode, params):
      ...     with estimator.tpu.bfloat16_scope():
      ...         h = nn.relu(nn.Dense(64)(features))
      ...         logits = nn.Dense(10)(h)
      ...     logits = logits.astype(jnp.float32)
    """

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "setup" or not _has_unset_dtype(module):
            return next_fun(*_cast_args(args, dtype), **_cast_args(kwargs, dtype))
        # The dtype field is read while the method runs (Flax's promote_dtype); it is put back
        # afterwards so the module computes as declared outside the block.
        object.__setattr__(module, "dtype", dtype)
        try:
            return next_fun(*_cast_args(args, dtype), **_cast_args(kwargs, dtype))
        finally:
            object.__setattr__(module, "dtype", None)

    with nn.intercept_methods(interceptor):
        yield


__all__ = [
    "COMPUTE_DTYPES",
    "LossScale",
    "Policy",
    "bfloat16_scope",
    "cast_floats",
    "float32_outputs",
    "keep_dtypes",
    "next_loss_scale",
]
