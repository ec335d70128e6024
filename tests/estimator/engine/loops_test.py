"""The compiled loops (``engine/loops.py``) called directly, without an estimator.

The model is a small MLP with BatchNorm (statistics averaged over the 8 replicas) trained
with Adam. References: the same loop run one step per call, a hand-written single-device
optax loop over the global batch, and a single-device Flax ``apply`` for evaluation and
prediction.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.engine import loops
from estimator.engine.model import ModelFn
from estimator.parallel.mesh import DATA, make_mesh
from estimator.runtime import seed_key_data
from estimator.spec import ModeKeys, TPUEstimatorSpec

ROWS = 4  # per replica
STEPS = 3
LR = 0.05


class MLP(nn.Module):
    """``axis_name="data"`` inside the loops; None for the single-device reference."""

    axis_name: str | None = DATA

    @nn.compact
    def __call__(self, x, train: bool):
        # No bias before BatchNorm: its gradient is zero up to rounding, and Adam divides
        # that rounding noise by its own size (an update of lr * O(1) from noise).
        h = nn.Dense(8, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(h)
        return nn.Dense(3)(nn.relu(h))


def _metric_fn(labels, logits):
    return {}


def model_fn(features, labels, mode, params):
    logits = MLP(name="net")(features, mode == ModeKeys.TRAIN)
    if mode == ModeKeys.PREDICT:
        return TPUEstimatorSpec(mode, predictions={"logits": logits})
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.adam(LR), eval_metrics=(_metric_fn, [labels, logits])
    )


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh()
    replicas = mesh.shape[DATA]
    model = ModelFn(model_fn, {}, None)
    model.num_replicas = replicas
    holder = loops.SpecHolder()
    rng = np.random.RandomState(0)
    gb = ROWS * replicas
    x = rng.randn(STEPS, gb, 5).astype(np.float32)
    y = rng.randint(0, 3, (STEPS, gb)).astype(np.int32)
    init = loops.make_init(model, mesh, holder, mode=ModeKeys.TRAIN, batch_size=ROWS)
    variables = jax.device_get(init(seed_key_data(0), np.int32(0), x, y))
    return mesh, model, holder, variables, x, y


def _fresh(setup) -> loops.TrainState:
    """A new copy of the initial state each time (the train loop donates its input)."""
    _, _, holder, variables, _, _ = setup
    params = jax.tree.map(jnp.array, variables["params"])
    rest = {k: jax.tree.map(jnp.array, v) for k, v in variables.items() if k != "params"}
    tx = holder[ModeKeys.TRAIN].train_op
    return loops.TrainState(
        params,
        rest,
        tx.init(params),
        jnp.int32(0),
        jnp.asarray(seed_key_data(0)),
        jnp.int32(0),
    )


def _train_loop(setup, **kw):
    mesh, model, holder, *_ = setup
    return loops.make_train_loop(model, mesh, holder, batch_size=ROWS, **kw)


def _leaves(state: loops.TrainState) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(state))]


@pytest.mark.parametrize("unroll", [False, True], ids=["rolled", "unrolled"])
def test_steps_in_one_call_equal_one_step_per_call(setup, unroll):
    """Rolled, every step runs the one compiled while-loop body whatever the call's length,
    so the states are bitwise equal. Unrolled, XLA may fuse and reorder operations across
    neighbouring steps of the long call, so only float tolerance holds."""
    *_, x, y = setup
    loop = _train_loop(setup, unroll=unroll)
    together, (losses, _, _) = loop(_fresh(setup), x, y)
    state, single = _fresh(setup), []
    for i in range(STEPS):
        state, (loss, _, _) = loop(state, x[i : i + 1], y[i : i + 1])
        single.append(np.asarray(loss))
    assert np.asarray(losses).shape == (STEPS,)
    assert int(together.step) == int(state.step) == STEPS
    if unroll:
        np.testing.assert_allclose(np.asarray(losses), np.concatenate(single), rtol=1e-6)
        for a, b in zip(_leaves(together), _leaves(state), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(losses), np.concatenate(single))
        for a, b in zip(_leaves(together), _leaves(state), strict=True):
            np.testing.assert_array_equal(a, b)


def _reference_run(variables, x, y, *, steps=None):
    """A hand-written single-device Adam loop over the global batch: (losses, params,
    batch_stats). Each replica's loss is the mean over its rows and the loop averages
    the replicas' gradients, which with equal rows is the global mean's gradient."""
    net = MLP(axis_name=None)
    params = variables["params"]["net"]
    stats = variables["batch_stats"]["net"]
    tx = optax.adam(LR)
    opt = tx.init(params)

    def loss_fn(p, stats, xb, yb):
        logits, new = net.apply(
            {"params": p, "batch_stats": stats}, xb, True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        return loss, new["batch_stats"]

    losses = []
    for i in steps if steps is not None else range(len(x)):
        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x[i], y[i])
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return np.array(losses), params, stats


def test_eight_replicas_equal_a_hand_written_single_device_loop(setup):
    *_, variables, x, y = setup
    state, (losses, _, _) = _train_loop(setup)(_fresh(setup), x, y)
    want_losses, want_params, want_stats = _reference_run(variables, x, y)
    # Float tolerance: 8 per-replica means averaged vs one mean over 32 rows (reassociated).
    np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-5)
    got = jax.device_get(state)
    for a, b in zip(jax.tree.leaves(got.params["net"]), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(
        jax.tree.leaves(got.state["batch_stats"]["net"]), jax.tree.leaves(want_stats), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert int(got.opt_state[0].count) == STEPS  # Adam's own step count


def test_losses_come_back_in_step_order(setup):
    """Step i's loss is the loss of batch i at the state after steps 0..i-1 (the
    reference's), for batches given in two different orders."""
    *_, variables, x, y = setup
    loop = _train_loop(setup)
    for order in ([0, 1, 2], [2, 0, 1]):
        _, (losses, _, _) = loop(_fresh(setup), x[order], y[order])
        want, _, _ = _reference_run(variables, x, y, steps=order)
        np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)


def test_a_nonfinite_step_is_skipped_and_counted(setup):
    """With ``skip_nonfinite``, a NaN in step 1's batch leaves the state as steps 0 and 2
    alone leave it; the step counter still advances and the skip is counted."""
    *_, x, y = setup
    bad = x.copy()
    bad[1, 5, 0] = np.nan  # one value on replica 1
    loop = _train_loop(setup, skip_nonfinite=True)
    state, (losses, _, _) = loop(_fresh(setup), bad, y)
    losses = np.asarray(losses)
    assert np.isfinite(losses[[0, 2]]).all() and not np.isfinite(losses[1])
    assert int(state.step) == 3 and int(state.nonfinite) == 1
    reference, (want, _, _) = loop(_fresh(setup), x[[0, 2]], y[[0, 2]])
    np.testing.assert_allclose(losses[[0, 2]], np.asarray(want), rtol=1e-6)
    ref = jax.device_get(reference)
    got = jax.device_get(state)
    for a, b in zip(
        jax.tree.leaves((got.params, got.state, got.opt_state)),
        jax.tree.leaves((ref.params, ref.state, ref.opt_state)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _eval_args(setup, mask):
    *_, variables, x, y = setup
    return variables, np.int32(0), seed_key_data(0), x, y, mask


def _reference_logits(variables, x):
    net = MLP(axis_name=None)
    v = {"params": variables["params"]["net"], "batch_stats": variables["batch_stats"]["net"]}
    return np.stack([np.asarray(net.apply(v, xb, False)) for xb in x])


def test_eval_loop_gives_each_replicas_masked_loss_and_every_row(setup):
    mesh, model, holder, variables, x, y = setup
    replicas = mesh.shape[DATA]
    mask = np.ones(y.shape, np.float32)
    mask[2, -6:] = 0.0  # the last step's final rows are padding (replica 6 partly, 7 wholly)
    loop = loops.make_eval_loop(model, mesh, holder, mode=ModeKeys.EVAL, batch_size=ROWS)
    losses, (labels, logits) = loop(*_eval_args(setup, mask))
    want_logits = _reference_logits(variables, x)
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(labels), y)
    per_row = np.asarray(optax.softmax_cross_entropy_with_integer_labels(want_logits, y))
    per_replica = (per_row * mask).reshape(STEPS, replicas, ROWS).sum(-1)
    counts = mask.reshape(STEPS, replicas, ROWS).sum(-1)
    want = per_replica / np.maximum(counts, 1.0)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5, atol=1e-6)
    assert np.asarray(losses)[2, 7] == 0.0  # a replica of padding only: masked to nothing


def test_predict_loop_returns_predictions_in_row_order(setup):
    mesh, model, holder, variables, x, _ = setup
    loop = loops.make_eval_loop(model, mesh, holder, mode=ModeKeys.PREDICT, batch_size=ROWS)
    preds = loop(*_eval_args(setup, np.ones(x.shape[:2], np.float32)))
    np.testing.assert_allclose(
        np.asarray(preds["logits"]), _reference_logits(variables, x), rtol=1e-5, atol=1e-6
    )
