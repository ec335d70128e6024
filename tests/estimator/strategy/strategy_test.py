"""Tests for TPUStrategy, DeviceAssignment and the replica context (8 simulated devices)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from estimator.core.input_context import InputContext
from estimator.parallel.mesh import MODEL
from estimator.parallel.partitioning import shard_variables, unbox
from estimator.parallel.replica_context import (
    ReduceOp,
    get_replica_context,
    in_replicated_computation,
    replica_scope,
)
from estimator.strategy.device_assignment import DeviceAssignment
from estimator.strategy.strategy import (
    PerReplica,
    TPUStrategy,
    ValueContext,
    get_strategy,
    has_strategy,
)

R = 8  # replicas of the default strategy: one per simulated device


@pytest.fixture(scope="module")
def strategy():
    return TPUStrategy()


@pytest.fixture(scope="module")
def mp_strategy():
    return TPUStrategy(device_assignment=DeviceAssignment.build(computation_shape=[1, 1, 1, 2]))


# ------------------------------------------------------------------ DeviceAssignment


@pytest.mark.parametrize(
    ("kwargs", "replicas", "cores"),
    [
        ({}, 8, 1),
        ({"computation_shape": 2}, 4, 2),
        ({"computation_shape": [1, 1, 1, 2]}, 4, 2),
        ({"computation_shape": 4, "num_replicas": 1}, 1, 4),
        ({"computation_shape": 8}, 1, 8),
        ({"num_replicas": 3}, 3, 1),
    ],
)
def test_device_assignment_build(kwargs, replicas, cores):
    da = DeviceAssignment.build(**kwargs)
    assert (da.num_replicas, da.num_cores_per_replica) == (replicas, cores)
    assert da.devices.shape == (replicas, cores)
    assert (
        da.tpu_device(replica=replicas - 1, logical_core=cores - 1)
        == jax.devices()[replicas * cores - 1]
    )
    assert da.lookup_replicas() == list(range(replicas))
    assert TPUStrategy(device_assignment=da).num_replicas_in_sync == replicas


def test_device_assignment_topology_is_a_device_list():
    da = DeviceAssignment.build(jax.devices()[4:], computation_shape=2)
    assert (da.num_replicas, da.num_cores_per_replica) == (2, 2)
    assert da.tpu_device(replica=0, logical_core=0) == jax.devices()[4]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"computation_shape": 3}, ValueError),
        ({"computation_shape": 0}, ValueError),
        ({"computation_shape": 2, "num_replicas": 5}, ValueError),
        ({"topology": "not devices"}, TypeError),
    ],
)
def test_device_assignment_errors(kwargs, error):
    with pytest.raises(error):
        DeviceAssignment.build(**kwargs)


# ------------------------------------------------------------- scope and replica context


def test_get_strategy_in_and_out_of_scope(strategy, mp_strategy):
    assert not has_strategy()
    assert get_strategy().num_replicas_in_sync == 1
    with strategy.scope():
        assert get_strategy() is strategy and has_strategy()
        with mp_strategy.scope():
            assert get_strategy() is mp_strategy
        assert get_strategy() is strategy
    assert not has_strategy()


def test_cluster_resolver_connect_is_called():
    class Resolver:
        connected = 0

        def connect(self):
            self.connected += 1

    resolver = Resolver()
    assert TPUStrategy(resolver).cluster_resolver is resolver
    assert resolver.connected == 1


def test_default_replica_context_is_one_replica():
    ctx = get_replica_context()
    assert not in_replicated_computation()
    assert (ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group) == (1, 0)
    assert ctx.all_reduce(ReduceOp.SUM, 3.0) == 3.0
    with replica_scope(1, axis_name=None) as pushed:
        assert in_replicated_computation() and get_replica_context() is pushed
    with pytest.raises(ValueError, match="axis_name"):
        replica_scope(4, axis_name=None).__enter__()


def test_replica_context_inside_run(strategy):
    x = np.arange(2 * R, dtype=np.float32)

    def fn(v):
        ctx = get_replica_context()
        assert in_replicated_computation() and ctx.strategy is strategy
        return {
            "id": ctx.replica_id_in_sync_group,
            "n": ctx.num_replicas_in_sync,
            "sum": ctx.all_reduce(ReduceOp.SUM, v),
            "mean": ctx.all_reduce("mean", v),
            "gather": ctx.all_gather(v, axis=0),
            "const": ctx.all_reduce(ReduceOp.SUM, 1.0),
        }

    out = strategy.run(fn, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
    per_replica = x.reshape(R, 2)
    np.testing.assert_array_equal(out["id"].stacked, np.arange(R))
    np.testing.assert_array_equal(out["n"].stacked, np.full(R, R))
    np.testing.assert_allclose(out["sum"].values[3], per_replica.sum(0))
    np.testing.assert_allclose(out["mean"].values[5], per_replica.mean(0))
    np.testing.assert_array_equal(out["gather"].values[7], x)
    np.testing.assert_array_equal(out["const"].stacked, np.full(R, R))


@pytest.mark.parametrize("distribute_params", [False, True])
def test_gradient_is_the_global_mean(strategy, distribute_params):
    """The gradient trap: a replicated parameter's mean gradient must not come out R times."""
    rng = np.random.RandomState(0)
    x, w = rng.randn(4 * R, 3).astype(np.float32), rng.randn(3).astype(np.float32)

    def loss_fn(w, x):
        return jnp.mean(jnp.sin(x @ w))

    def grad_fn(w, x):
        return get_replica_context().all_reduce(ReduceOp.MEAN, jax.grad(loss_fn)(w, x))

    if distribute_params:
        w_in = strategy.experimental_distribute_values_from_function(lambda _: w)
    else:
        w_in = w
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    grads = strategy.run(grad_fn, args=(w_in, batch))
    for g in strategy.experimental_local_results(grads):
        np.testing.assert_allclose(g, jax.grad(loss_fn)(w, x), rtol=1e-5)


# ------------------------------------------------------------------------- run


def test_run_compiles_once_per_signature(strategy):
    traces = []

    def fn(x, scale):
        traces.append(1)
        return x * scale

    x4, x6 = np.ones((R, 4), np.float32), np.ones((R, 6), np.float32)
    for _ in range(3):
        out = strategy.run(fn, args=(PerReplica.from_stacked(x4), 2.0))
    assert len(traces) == 1
    np.testing.assert_array_equal(out.stacked, 2 * x4)
    strategy.run(fn, args=(PerReplica.from_stacked(x6), 2.0))
    assert len(traces) == 2
    out = strategy.run(fn, args=(PerReplica.from_stacked(x4), 3.0))  # a Python constant
    assert len(traces) == 3
    np.testing.assert_array_equal(out.values[0], 3 * x4[0])
    strategy.run(fn, args=(PerReplica.from_stacked(x4),), kwargs={"scale": 3.0})
    assert len(traces) == 4


def test_run_queues_many_steps_without_deadlock(strategy):
    """More queued collective programs than XLA:CPU survives (~64) unless run bounds them."""
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )

    def step(v):
        return get_replica_context().all_reduce(ReduceOp.MEAN, v) + 1.0

    for _ in range(80):
        x = strategy.run(step, args=(x,))
    np.testing.assert_allclose(x.stacked, np.full(R, (R - 1) / 2 + 80))


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (PerReplica.from_stacked(np.zeros((3, 2))), ValueError, "3 replicas"),
        (PerReplica([np.zeros(i + 1) for i in range(R)]), ValueError, "different shapes"),
        ({1, 2}, TypeError, "hashable"),
    ],
)
def test_run_argument_errors(strategy, value, error, message):
    with pytest.raises(error, match=message):
        strategy.run(lambda v: 0.0, args=(value,))


def test_run_inside_jit_loops_on_device(strategy):
    """Like a tf.function looping over strategy.run: several steps in one compiled call."""

    def step(v):
        return get_replica_context().all_reduce(ReduceOp.SUM, v) / R + 1.0

    @jax.jit
    def three_steps(v):
        for _ in range(3):
            v = strategy.run(step, args=(v,))
        return v

    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )
    np.testing.assert_allclose(three_steps(x).stacked, np.full(R, (R - 1) / 2 + 3))


# --------------------------------------------------------------------- reduce


def _stacked_values():
    return np.arange(R * 2 * 3, dtype=np.float32).reshape(R, 2, 3)


@pytest.mark.parametrize("source", ["values_from_function", "run"])
@pytest.mark.parametrize(
    ("op", "axis", "reference"),
    [
        (ReduceOp.SUM, None, lambda s: s.sum(0)),
        (ReduceOp.MEAN, None, lambda s: s.mean(0)),
        (ReduceOp.SUM, 0, lambda s: s.sum((0, 1))),
        (ReduceOp.MEAN, 0, lambda s: s.mean((0, 1))),
        ("sum", -1, lambda s: s.sum((0, 2))),
        ("mean", 1, lambda s: s.mean((0, 2))),
    ],
)
def test_reduce_against_numpy(strategy, source, op, axis, reference):
    s = _stacked_values()
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: s[ctx.replica_id_in_sync_group]
    )
    if source == "run":
        value = strategy.run(_identity, args=(value,))
    np.testing.assert_allclose(strategy.reduce(op, value, axis=axis), reference(s), rtol=1e-6)


def _identity(x):
    return x


def test_reduce_structure(strategy):
    s = _stacked_values()
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: {
            "a": s[ctx.replica_id_in_sync_group],
            "b": (np.float32(ctx.replica_id_in_sync_group),),
        }
    )
    out = strategy.reduce(ReduceOp.SUM, value)
    np.testing.assert_allclose(out["a"], s.sum(0))
    np.testing.assert_allclose(out["b"][0], sum(range(R)))


@pytest.mark.parametrize(
    ("op", "reference"),
    [(ReduceOp.SUM, np.sum), (ReduceOp.MEAN, np.mean)],
)
def test_reduce_uneven_batch_along_axis(strategy, op, reference):
    """Per-replica batches of 1..R rows: MEAN divides by the total row count, as TF does."""
    parts = [np.arange(i + 1, dtype=np.float32) * (i + 1) for i in range(R)]
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group]
    )
    assert not value.is_stacked
    np.testing.assert_allclose(
        strategy.reduce(op, value, axis=0), reference(np.concatenate(parts)), rtol=1e-6
    )
    with pytest.raises(ValueError, match="different shapes"):
        strategy.reduce(op, value)


def test_reduce_plain_value_follows_tf(strategy):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(strategy.reduce(ReduceOp.MEAN, x), x)
    with pytest.raises(ValueError, match="non-distributed"):
        strategy.reduce(ReduceOp.SUM, x)
    np.testing.assert_allclose(strategy.reduce(ReduceOp.SUM, x, axis=0), R * x.sum(0))
    np.testing.assert_allclose(strategy.reduce(ReduceOp.MEAN, x, axis=1), x.mean(1))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_concatenates_replicas(strategy, axis):
    s = _stacked_values()
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: s[ctx.replica_id_in_sync_group]
    )
    expected = np.concatenate(list(s), axis=axis)
    np.testing.assert_array_equal(strategy.gather(value, axis), expected)
    ragged = PerReplica([np.arange(i + 1) for i in range(R)])
    np.testing.assert_array_equal(
        strategy.gather({"r": ragged, "p": 1}, 0)["r"], np.concatenate(ragged.values)
    )


# ----------------------------------------------------------- distributing inputs


def test_values_from_function_and_local_results(strategy):
    contexts = []

    def value_fn(ctx):
        contexts.append(ctx)
        return {
            "id": np.int32(ctx.replica_id_in_sync_group),
            "x": np.full((2,), ctx.replica_id_in_sync_group),
        }

    value = strategy.experimental_distribute_values_from_function(value_fn)
    assert contexts == [ValueContext(i, R) for i in range(R)]
    local = strategy.experimental_local_results(value)
    assert len(local) == R
    for i, v in enumerate(local):
        assert int(v["id"]) == i
        np.testing.assert_array_equal(v["x"], [i, i])
    doubled = strategy.run(lambda v: v["x"] * 2, args=(value,))
    np.testing.assert_array_equal(
        np.stack(strategy.experimental_local_results(doubled)),
        2 * np.repeat(np.arange(R)[:, None], 2, 1),
    )
    assert strategy.experimental_local_results(5.0) == (5.0,)
    assert strategy.experimental_local_results(doubled)[3].devices() == {jax.devices()[3]}


def test_distribute_dataset_splits_global_batches(strategy):
    batches = [(np.arange(16 * k, 16 * (k + 1)).reshape(16, 1), np.arange(16)) for k in range(2)]
    dist = strategy.experimental_distribute_dataset(batches)
    for _ in range(2):  # re-iterable
        seen = list(dist)
        assert len(seen) == 2
    features, labels = seen[1]
    assert features.stacked.shape == (R, 2, 1)
    np.testing.assert_array_equal(np.concatenate(features.values), batches[1][0])
    rows = strategy.run(lambda f, lab: (f[:, 0], lab), args=seen[0])
    np.testing.assert_array_equal(
        np.concatenate(strategy.experimental_local_results(rows[0])), np.arange(16)
    )


def test_distribute_dataset_error_names_the_shape(strategy):
    dist = strategy.experimental_distribute_dataset([{"image": np.zeros((10, 3))}])
    with pytest.raises(ValueError, match=r"\['image'\].*\(10, 3\)"):
        next(iter(dist))


def test_distribute_datasets_from_function(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        batch = ctx.get_per_replica_batch_size(4 * R)
        return [np.full((batch, 3), i, np.float32) for i in range(2 * R + 3)]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert contexts == [
        InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=R)
    ]
    steps = list(dist)
    assert len(steps) == 2  # the 3 batches of an incomplete third step are dropped
    for k, step in enumerate(steps):
        assert step.stacked.shape == (R, 4, 3)
        for r, v in enumerate(strategy.experimental_local_results(step)):
            np.testing.assert_array_equal(v, np.full((4, 3), k * R + r))
    assert len(contexts) == 1


# ---------------------------------------------------------- training loops and model parallelism


class _Mlp(nn.Module):
    """Kernels carry partitioning metadata: hidden units are split over the model axis."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(32, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        strategy = get_strategy()
        h = strategy.experimental_split_to_logical_devices(
            nn.relu(h), [1, strategy.num_cores_per_replica]
        )
        return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("model", None)))(h)


_TX = optax.sgd(0.1, momentum=0.9)
_GLOBAL_BATCH, _STEPS = 32, 3


def _data():
    rng = np.random.RandomState(1)
    x = rng.randn(_STEPS * _GLOBAL_BATCH, 16).astype(np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int32)
    return [
        (x[i : i + _GLOBAL_BATCH], y[i : i + _GLOBAL_BATCH])
        for i in range(0, len(x), _GLOBAL_BATCH)
    ]


def _loss(params, x, y):
    logits = _Mlp().apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, *batch)
    grads = get_replica_context().all_reduce(ReduceOp.MEAN, grads)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _custom_loop(strategy):
    variables = _Mlp().init(jax.random.key(0), jnp.ones((1, 16)))
    params = shard_variables(strategy.mesh, variables)["params"]
    opt_state = _TX.init(params)
    losses = []
    for batch in strategy.experimental_distribute_dataset(_data()):
        params, opt_state, loss = strategy.run(_train_step, args=(params, opt_state, batch))
        losses.append(float(strategy.reduce(ReduceOp.MEAN, loss)))
    return params, losses


def _reference_loop():
    params = unbox(_Mlp().init(jax.random.key(0), jnp.ones((1, 16))))["params"]
    opt_state = _TX.init(params)
    step = jax.jit(_train_step)
    losses = []
    for batch in _data():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


@pytest.fixture(scope="module")
def reference():
    with replica_scope(1, axis_name=None):
        return _reference_loop()


_RUNS = {}


def _trained(cores):
    """(strategy, params, losses) of the custom loop with ``cores`` per replica, run once."""
    if cores not in _RUNS:
        da = DeviceAssignment.build(computation_shape=cores)
        strategy = TPUStrategy(device_assignment=da)
        _RUNS[cores] = (strategy, *_custom_loop(strategy))
    return _RUNS[cores]


@pytest.mark.parametrize("cores", [1, 2])
def test_custom_loop_matches_single_device_reference(cores, reference):
    strategy, params, losses = _trained(cores)
    assert strategy.num_replicas_in_sync == 8 // cores
    ref_params, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for replica_params in strategy.experimental_local_results(params):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            replica_params,
            ref_params,
        )


def test_model_parallel_equals_data_parallel_with_half_shards(mp_strategy, strategy):
    variables = _Mlp().init(jax.random.key(0), jnp.ones((1, 16)))
    kernels = {}
    for name, s in [("dp", strategy), ("mp", mp_strategy)]:
        placed = shard_variables(s.mesh, variables)["params"]
        kernels[name] = placed["Dense_0"]["kernel"].addressable_shards[0].data.shape
    assert kernels == {"dp": (16, 32), "mp": (16, 16)}

    mp, mp_params, mp_losses = _trained(2)
    dp, dp_params, dp_losses = _trained(1)
    assert (mp.num_replicas_in_sync, mp.num_cores_per_replica) == (4, 2)
    np.testing.assert_allclose(mp_losses, dp_losses, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        mp.experimental_local_results(mp_params)[0],
        dp.experimental_local_results(dp_params)[0],
    )
    trained = mp_params["Dense_0"]["kernel"].stacked  # (4, 16, 32), still split over "model"
    assert trained.sharding.spec[2] == MODEL
    assert {s.data.shape for s in trained.addressable_shards} == {(1, 16, 16)}
