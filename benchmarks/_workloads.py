"""The benchmark workloads: models, data, the estimator's model_fn and hand-written loops.

Both sides run the same Flax module on the same numpy data with the same optimizer
(``optax.adam(LEARNING_RATE)``) over the same eight devices:

* ``MLP``: 64-512-512-10 on 64 features.
* ``CNN``: conv3x3(32)-maxpool-conv3x3(64)-maxpool-dense128-dense10 on 8x8x1 images.

The hand-written side is the standard data-parallel pattern: a ``("data",)`` mesh with Auto axes,
params cast to replica-varying before ``grad`` and the gradients ``pmean``-ed, and state
donated.

Example:
  >>> data = make_dataset("mlp", batches=10, global_batch=256)
  >>> loop = ceiling_loop("mlp", make_mesh(), unroll=False)
  >>> state = init_state("mlp", make_mesh(), data.x[0])
  >>> state, losses = loop(state, *stage_chunks(data, 10, make_mesh())[0])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
import metrics
from estimator.data.staging import aligned_empty

DATA = "data"
LEARNING_RATE = 1e-3
NUM_CLASSES = 10


class MLP(nn.Module):
    """64-512-512-10 with ReLU."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(NUM_CLASSES)(x)


class CNN(nn.Module):
    """conv3x3(32)-pool-conv3x3(64)-pool-dense128-dense10 on NHWC images."""

    @nn.compact
    def __call__(self, x):
        for width in (32, 64):
            x = nn.relu(nn.Conv(width, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(NUM_CLASSES)(x)


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}
_ROW_SHAPES = {"mlp": (64,), "cnn": (8, 8, 1)}


def _module(model: str) -> nn.Module:
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    return MODELS[model]()


class Dataset(NamedTuple):
    """``x[b]``, ``y[b]``: batch ``b`` of the global batch, in numpy."""

    x: np.ndarray  # [batches, global_batch, *row_shape] float32
    y: np.ndarray  # [batches, global_batch] int32

    @property
    def global_batch(self) -> int:
        return self.x.shape[1]

    @property
    def batches(self) -> int:
        return self.x.shape[0]


def make_dataset(model: str, *, batches: int, global_batch: int, seed: int = 0) -> Dataset:
    """A learnable synthetic classification set (labels from a random linear teacher)."""
    rng = np.random.RandomState(seed)
    shape = _ROW_SHAPES[model]
    x = rng.randn(batches, global_batch, *shape).astype(np.float32)
    teacher = rng.randn(int(np.prod(shape)), NUM_CLASSES).astype(np.float32)
    y = (x.reshape(batches, global_batch, -1) @ teacher).argmax(-1).astype(np.int32)
    return Dataset(x, y)


# ----------------------------------------------------------------------------- estimator side
def _host_fn(loss, accuracy):
    """The benchmark host_call: two scalar summaries per step."""
    estimator.summary.scalar("host/loss", loss.mean())
    estimator.summary.scalar("host/accuracy", accuracy.mean())


def _metric_fn(labels, logits):
    return {"accuracy": metrics.accuracy(labels, logits.argmax(-1))}


def model_fn(features, labels, mode, params):
    """The estimator's model_fn: ``params["model"]`` picks the module."""
    logits = _module(params["model"])(features)
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if mode == estimator.ModeKeys.TRAIN:
        loss = per_row.mean()
        host_call = None
        if params.get("host_call"):
            accuracy = (logits.argmax(-1) == labels).mean()
            host_call = (_host_fn, [loss[None], accuracy[None]])
        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.adam(LEARNING_RATE), host_call=host_call
        )
    mask = estimator.padding_mask()
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(_metric_fn, [labels, logits]))


def input_fn_for(data: Dataset, *, cycle: bool, sleep: float = 0.0) -> Callable:
    """An input_fn yielding the dataset's batches in order (forever with ``cycle``).

    ``sleep`` seconds are spent before each batch, as a slow reader would.
    """

    def input_fn(params) -> Iterator:
        if params["batch_size"] != data.global_batch:
            raise ValueError(
                f"params['batch_size']={params['batch_size']}, expected {data.global_batch}"
            )
        while True:
            for b in range(data.batches):
                if sleep:
                    time.sleep(sleep)
                yield data.x[b], data.y[b]
            if not cycle:
                return

    return input_fn


def make_estimator(
    model: str,
    model_dir: str,
    *,
    global_batch: int,
    iterations_per_loop: int,
    unroll: bool | None = False,
    host_call: bool = False,
    compilation_cache_dir: str | bool = False,
) -> estimator.TPUEstimator:
    """A TPUEstimator over every device with the benchmark's model_fn.

    Defaults are TF's (summaries and step logs every 100 steps, a checkpoint at the end of
    each ``train``) except ``resume_input_position=False``, so each timed ``train`` call reads
    the dataset from its start exactly like the hand-written loops do.
    """
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(
            iterations_per_loop=iterations_per_loop, unroll_loops=unroll
        ),
        compilation_cache_dir=compilation_cache_dir,
        progress_bar=False,
        resume_input_position=False,
    )
    return estimator.TPUEstimator(
        model_fn,
        config=config,
        params={"model": model, "host_call": host_call},
        train_batch_size=global_batch,
        eval_batch_size=global_batch,
        predict_batch_size=global_batch,
    )


# ----------------------------------------------------------------------------- hand-written side
def make_mesh() -> Mesh:
    """Every device on one ``"data"`` axis (Auto axes: sharding is left to the compiler)."""
    return jax.make_mesh((len(jax.devices()),), (DATA,), axis_types=(AxisType.Auto,))


def _loss(model: str, params, x, y):
    logits = _module(model).apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def init_state(model: str, mesh: Mesh, sample_x: np.ndarray, seed: int = 0) -> tuple:
    """``(params, adam state)`` replicated over the mesh."""
    params = _module(model).init(jax.random.key(seed), sample_x[:1])["params"]
    state = (params, optax.adam(LEARNING_RATE).init(params))
    return jax.device_put(state, NamedSharding(mesh, P()))


def _accumulated_grads(model: str, params, x, y, k: int):
    """Mean loss and gradient over ``k`` micro-batches of the rows, summed by a ``lax.scan``
    (gradient accumulation as a user writes it by hand)."""
    parts = jax.tree.map(lambda a: a.reshape(k, -1, *a.shape[1:]), (x, y))

    def body(total, part):
        one = jax.value_and_grad(lambda p: _loss(model, p, *part))(params)
        return jax.tree.map(jnp.add, total, one), None

    zero = (lax.pcast(jnp.zeros(()), DATA, to="varying"), jax.tree.map(jnp.zeros_like, params))
    total, _ = lax.scan(body, zero, parts)
    return jax.tree.map(lambda a: a / k, total)


def train_step(model: str, num_microbatches: int = 1) -> Callable:
    """One replica's step: ``(state, (x, y)) -> (state, loss)``, run inside shard_map; with
    ``num_microbatches > 1`` its gradient is accumulated over that many micro-batches."""
    tx = optax.adam(LEARNING_RATE)

    def step(state, batch):
        params, opt_state = state
        x, y = batch
        varying = jax.tree.map(lambda a: lax.pcast(a, DATA, to="varying"), params)
        if num_microbatches == 1:
            loss, grads = jax.value_and_grad(lambda p: _loss(model, p, x, y))(varying)
        else:
            loss, grads = _accumulated_grads(model, varying, x, y, num_microbatches)
        grads, loss = lax.pmean(grads, DATA), lax.pmean(loss, DATA)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def ceiling_loop(model: str, mesh: Mesh, *, unroll: bool, num_microbatches: int = 1) -> Callable:
    """The ceiling: ``jit(shard_map(scan(step)))`` over ``[n, GB, ...]`` chunks, state donated."""
    step = train_step(model, num_microbatches)

    def loop(state, xs, ys):
        # unroll=0 unrolls completely; unroll=True would leave a 1-step scan a while loop.
        return lax.scan(step, state, (xs, ys), unroll=0 if unroll else 1)

    sharded = jax.shard_map(
        loop, mesh=mesh, in_specs=(P(), P(None, DATA), P(None, DATA)), out_specs=(P(), P())
    )
    return jax.jit(sharded, donate_argnums=0)


def per_step_fn(model: str, mesh: Mesh) -> Callable:
    """The typical loop's ``jit(train_step)``: one step per call on a ``[GB, ...]`` batch."""
    step = train_step(model)
    sharded = jax.shard_map(
        lambda s, x, y: step(s, (x, y)),
        mesh=mesh,
        in_specs=(P(), P(DATA), P(DATA)),
        out_specs=(P(), P()),
    )
    return jax.jit(sharded, donate_argnums=0)


def replicate(tree, mesh: Mesh):
    """``tree`` on every device of ``mesh``. On CPU every device reads one shared buffer.

    XLA:CPU places a 64-byte-aligned host array on all its devices without a copy, and the
    eval program runs about 10% faster on one shared copy of the weights than on eight.
    numpy's own arrays are shared or copied by chance of their alignment, which made the
    hand-written baseline bimodal between runs; this is its fastest placement, every time.
    """

    def aligned(x):
        host = aligned_empty(np.shape(x), np.asarray(x).dtype)
        host[...] = x
        return host

    return jax.device_put(jax.tree.map(aligned, tree), NamedSharding(mesh, P()))


def stage_chunks(data: Dataset, n: int, mesh: Mesh) -> list[tuple[jax.Array, jax.Array]]:
    """The dataset on the devices as ``[n, GB, ...]`` chunks (``n`` must divide it)."""
    if data.batches % n:
        raise ValueError(f"iterations_per_loop {n} must divide the {data.batches} batches")
    sharding = NamedSharding(mesh, P(None, DATA))
    chunks = []
    for c in range(data.batches // n):
        part = slice(c * n, (c + 1) * n)
        chunks.append(jax.device_put((data.x[part], data.y[part]), sharding))
    return jax.block_until_ready(chunks)


def eval_loop(model: str, mesh: Mesh) -> Callable:
    """A hand-written eval: ``(params, xs, ys) -> (correct[n, R], loss_sum[n, R])``.

    Each replica counts its own rows; the host sums the ``[n, R]`` counts. No cross-replica
    collective runs per step (a per-step ``psum`` costs more than it saves on CPU devices).
    """

    def step(params, batch):
        x, y = batch
        logits = _module(model).apply({"params": params}, x)
        correct = (logits.argmax(-1) == y).sum()[None]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()[None]
        return params, (correct, loss)

    def loop(params, xs, ys):
        return lax.scan(step, params, (xs, ys))[1]

    sharded = jax.shard_map(
        loop, mesh=mesh, in_specs=(P(), P(None, DATA), P(None, DATA)), out_specs=P(None, DATA)
    )
    return jax.jit(sharded)
