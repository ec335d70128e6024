"""The compiled loops (``engine/loops.py``) called directly, without an estimator.

The model is a small MLP with BatchNorm (statistics averaged over the 8 replicas) trained
with Adam. References: the same loop run one step per call, a hand-written single-device
optax loop over the global batch, and a single-device Flax ``apply`` for evaluation and
prediction.

The second part runs the train program as training gets it (``Programs.train`` on a state
from ``fresh_train_state``), with the options read from the config: k steps in one call
against k calls, a non-finite step against a run without it, and state split over replicas
(ZeRO, FSDP) against the replicated run from the same values.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from estimator.core.runtime import seed_key_data
from estimator.core.spec import ModeKeys, TPUEstimatorSpec
from estimator.engine import loops
from estimator.engine.model import ModelFn
from estimator.engine.options import StepOptions
from estimator.engine.programs import Programs
from estimator.engine.state import fresh_train_state
from estimator.parallel.mesh import DATA, make_mesh
from tests import helpers as h
from tests.estimator.driver.jobs import make_job

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


def _train_loop(setup, **options):
    """The train loop with ``StepOptions(**options)`` (defaults: float32, replicated)."""
    mesh, model, holder, *_ = setup
    return loops.make_train_loop(model, mesh, holder, StepOptions(**options), batch_size=ROWS)


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


# ----------------------------------------------------------- through Programs, as training runs
# The train program as the driver gets it: ``Programs.train`` with the loop options read from
# the config, the state made by ``fresh_train_state``. One device comes from the driver tests'
# ``make_job``; eight replicas need a mesh ``make_job`` does not build, so ``_programs``
# assembles them the same way on ``make_mesh()``.

HIDDEN = 256  # the hidden kernel (6 x 256) is over zero.MIN_SHARDED_SIZE: split under ZeRO

OPTIMIZERS = {
    # Adam's slots mirror the gradient: a wrong scale or slice of it shows in mu and nu.
    "adam": optax.adam(LR),
    # A threshold far below the gradient's norm clips every step: each update then depends on
    # the norm over every leaf, those split over replicas and those kept whole.
    "clipped_momentum": optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(LR, 0.9)),
}


def _mlp_model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="out")(nn.relu(nn.Dense(HIDDEN, name="hidden")(features["x"])))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    tx = OPTIMIZERS[params.get("optimizer", "adam")]
    return TPUEstimatorSpec(mode, loss=loss, train_op=tx)


def _programs(tmp_path, *, replicas: int, optimizer: str = "adam", **cfg) -> Programs:
    if replicas == 1:
        return make_job(tmp_path, model_fn=_mlp_model_fn, batch=ROWS, **cfg).programs
    config = h.config(tmp_path, **cfg)
    mesh = make_mesh()
    assert mesh.shape[DATA] == replicas
    model = ModelFn(_mlp_model_fn, {"optimizer": optimizer}, config)
    model.num_replicas = replicas
    return Programs(model, mesh, config)


def _batches(replicas: int, *, nan_at: int | None = None) -> tuple[dict, np.ndarray]:
    """``STEPS`` stacked host batches, with a NaN in one value of step ``nan_at``."""
    rows = ROWS * replicas
    x, y = h.make_data(n=STEPS * rows)
    x = x.reshape(STEPS, rows, -1)
    if nan_at is not None:
        x[nan_at, 2, 0] = np.nan
    return {"x": x}, y.reshape(STEPS, rows)


class _Run:
    """A fresh train state from ``programs`` and the train program for it; ``start()`` gives
    a new copy of that state each time (the program may donate its input), with ``like``'s
    values when given."""

    def __init__(self, programs: Programs, *, like: _Run | None = None):
        self.mesh = programs.mesh
        state = fresh_train_state(programs, self.place(*_batches(self.mesh.shape[DATA])), ROWS)
        self.shardings = jax.tree.map(lambda a: a.sharding, state)
        self.values = jax.device_get(state) if like is None else like.values
        self.loop = programs.train_for(state, ROWS)

    def place(self, features, labels) -> tuple:
        """Host batches split over "data", as the input side places them."""
        return jax.device_put((features, labels), NamedSharding(self.mesh, P(None, DATA)))

    def start(self) -> loops.TrainState:
        return jax.tree.map(jax.device_put, self.values, self.shardings)

    def __call__(self, state, features, labels, steps=slice(None)):
        return self.loop(state, *self.place(*jax.tree.map(lambda a: a[steps], (features, labels))))


def _assert_states(got: loops.TrainState, want: loops.TrainState, **tol) -> None:
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if tol:
            np.testing.assert_allclose(a, b, **tol)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "unroll, tol",
    [
        # Rolled, each step runs the one compiled while-loop body: bitwise.
        (False, {}),
        # Unrolled, XLA may fuse and reorder across the long call's steps: float tolerance.
        (True, {"rtol": 1e-5, "atol": 1e-6}),
    ],
    ids=["rolled", "unrolled"],
)
def test_programs_k_steps_in_one_call_equal_k_calls_of_one_step(tmp_path, unroll, tol):
    run = _Run(_programs(tmp_path, replicas=1, tpu={"unroll_loops": unroll}))
    features, labels = _batches(1)
    together, (losses, _, finite) = run(run.start(), features, labels)
    state, single = run.start(), []
    for i in range(STEPS):
        state, (loss, _, _) = run(state, features, labels, slice(i, i + 1))
        single.append(np.asarray(loss))
    assert np.asarray(losses).shape == (STEPS,) and int(together.step) == int(state.step) == STEPS
    assert np.asarray(finite).all()
    if tol:
        np.testing.assert_allclose(np.asarray(losses), np.concatenate(single), rtol=tol["rtol"])
    else:
        np.testing.assert_array_equal(np.asarray(losses), np.concatenate(single))
    _assert_states(together, state, **tol)


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "kept"])
def test_programs_a_nonfinite_step_is_kept_out_only_when_skipping(tmp_path, skip):
    """A NaN in step 1's batch: skipping, the state is what steps 0 and 2 alone make, the
    step still counts and the skip is counted; not skipping, the NaN reaches the params and
    the call's finite flags say so (what the host checks before a save)."""
    # Rolled, so the reference's steps run the same while-loop body: bitwise.
    tpu = {"unroll_loops": False}
    run = _Run(_programs(tmp_path, replicas=1, skip_nonfinite_steps=skip, tpu=tpu))
    state, (losses, _, finite) = run(run.start(), *_batches(1, nan_at=1))
    losses = np.asarray(losses)
    assert int(state.step) == STEPS
    if not skip:  # step 2 starts from the poisoned params
        assert np.isfinite(losses).tolist() == [True, False, False]
        assert int(state.nonfinite) == 0 and not np.asarray(finite).all()
        assert not np.isfinite(np.asarray(state.params["out"]["kernel"])).all()
        return
    assert np.isfinite(losses).tolist() == [True, False, True]
    assert np.asarray(finite).all() and int(state.nonfinite) == 1
    reference, (want, _, _) = run(run.start(), *_batches(1), [0, 2])
    np.testing.assert_array_equal(losses[[0, 2]], np.asarray(want))
    assert int(reference.step) == 2 and int(reference.nonfinite) == 0
    _assert_states(state._replace(step=reference.step, nonfinite=reference.nonfinite), reference)


@pytest.fixture(scope="module")
def replicated_runs(tmp_path_factory):
    """The replicated 8-replica run of each optimizer, ``(run, its state and losses)``: made
    once, for both split layouts."""
    cache = {}

    def get(optimizer: str):
        if optimizer not in cache:
            path = tmp_path_factory.mktemp(f"replicated-{optimizer}")
            run = _Run(_programs(path, replicas=8, optimizer=optimizer))
            state, (losses, _, _) = run(run.start(), *_batches(8))
            cache[optimizer] = run, jax.device_get(state), np.asarray(losses)
        return cache[optimizer]

    return get


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "tpu", [{"shard_optimizer_state": True}, {"shard_params": True}], ids=["zero", "fsdp"]
)
def test_programs_state_split_over_replicas_trains_as_replicated(
    tmp_path, replicated_runs, tpu, optimizer
):
    """From the same initial values on 8 replicas: the same losses, step, parameters and
    optimizer slots. Float tolerance: a reduce-scatter sums the replicas' gradients in
    another order than ``pmean`` does."""
    replicated, want, want_losses = replicated_runs(optimizer)
    split = _Run(_programs(tmp_path, replicas=8, optimizer=optimizer, tpu=tpu), like=replicated)
    got, (got_losses, _, _) = split(split.start(), *_batches(8))
    split_leaves = [a for a in jax.tree.leaves(got.opt_state) if not a.sharding.is_fully_replicated]
    assert split_leaves, "no optimizer slot was split over replicas: nothing was compared"
    kernel = got.params["hidden"]["kernel"]
    assert kernel.sharding.is_fully_replicated is ("shard_params" not in tpu)
    assert int(got.step) == STEPS
    np.testing.assert_allclose(np.asarray(got_losses), want_losses, rtol=1e-6)
    _assert_states(got, want, rtol=1e-5, atol=1e-6)
