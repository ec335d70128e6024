"""The programs of one estimator (``engine/programs.py``): each built once per kind and batch
size, the specs model_fn's traces recorded, the loop options read from the config, and the
cases where nothing is compiled ahead."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from estimator.core.compilation import CompileCounter
from estimator.core.errors import EstimatorValueError
from estimator.core.runtime import seed_key_data
from estimator.core.spec import ModeKeys
from estimator.engine.model import ModelFn
from estimator.engine.programs import Programs
from estimator.engine.state import fresh_train_state
from estimator.parallel.mesh import DATA, make_mesh
from tests import helpers as h
from tests.estimator.driver.jobs import make_job


def _programs(tmp_path, **tpu) -> Programs:
    ipl = tpu.pop("iterations_per_loop", 4)
    config = h.config(tmp_path, iterations_per_loop=ipl, tpu=tpu)
    mesh = make_mesh(num_cores_per_replica=config.tpu_config.num_cores_per_replica)
    model = ModelFn(h.model_fn, {}, config)
    model.num_replicas = mesh.shape["data"]
    return Programs(model, mesh, config)


def test_each_program_is_built_once_per_kind_and_batch_size(tmp_path):
    programs = _programs(tmp_path)
    assert programs.init(ModeKeys.TRAIN, 2) is programs.init(ModeKeys.TRAIN, 2)
    assert programs.init(ModeKeys.TRAIN, 2) is not programs.init(ModeKeys.TRAIN, 4)
    assert programs.init(ModeKeys.TRAIN, 2) is not programs.init(ModeKeys.EVAL, 2)
    assert programs.infer(ModeKeys.EVAL, 2) is programs.infer(ModeKeys.EVAL, 2)
    assert programs.infer(ModeKeys.EVAL, 2) is not programs.infer(ModeKeys.PREDICT, 2)
    assert programs.train(2) is programs.train(2)
    assert programs.train(2) is not programs.train(4)
    assert programs.costs(ModeKeys.EVAL, 2) is programs.costs(ModeKeys.EVAL, 2)
    assert programs.costs(ModeKeys.EVAL, 2) is not programs.costs(ModeKeys.PREDICT, 2)


def _stacked(programs: Programs, steps: int, rows: int) -> tuple:
    """``(features, labels, mask)`` of ``steps`` stacked batches, placed as the input side
    places them (split over "data")."""
    x, y = h.make_data(n=steps * rows)
    batch = ({"x": x.reshape(steps, rows, -1)}, y.reshape(steps, rows), np.ones((steps, rows)))
    return jax.device_put(batch, NamedSharding(programs.mesh, P(None, DATA)))


def test_a_second_call_of_a_kind_and_batch_compiles_nothing(tmp_path):
    """Every program a train call and an evaluation and a prediction at one batch size run,
    called twice: the second round compiles nothing (the first compiles, which shows the
    counter sees these programs)."""
    programs = make_job(tmp_path, batch=8).programs
    features, labels, _ = _stacked(programs, 2, 8)
    state = fresh_train_state(programs, (features, labels), 8)
    per_step_flags = programs.per_step_flags(state)

    def one_round():
        nonlocal state
        for steps in (2, 1):  # 2: the call compiled ahead with the state; 1: a short tail
            features, labels, _ = _stacked(programs, steps, 8)
            loop = programs.train(8, per_step_flags=per_step_flags)
            state, _ = loop(state, features, labels)
        variables = {"params": state.params, **state.state}
        for mode in (ModeKeys.EVAL, ModeKeys.PREDICT):
            loop = programs.infer(mode, 8)
            args = (variables, np.int32(0), seed_key_data(0), *_stacked(programs, 2, 8))
            jax.block_until_ready(loop(*args))

    with CompileCounter() as first:
        one_round()
    with CompileCounter() as second:
        one_round()
    assert first.compiled >= 3, first.names  # the 1-step train, eval and predict programs
    assert second.compiled == 0, second.names
    assert int(state.step) == 6


@pytest.mark.parametrize(
    "share, skip_nonfinite, per_step, donated",
    [
        (1 / 16, False, False, False),  # a small state: kept for a replay, checked per call
        (1e-12, False, True, True),  # a state too large to keep twice: per-step flags
        (1 / 16, True, False, True),  # skipped steps: nothing to replay, the state donated
    ],
)
def test_train_for_is_the_program_training_runs_and_memory_is_measured_on(
    tmp_path, monkeypatch, share, skip_nonfinite, per_step, donated
):
    """The train program for a state: the per-call program that keeps its input (one more
    copy of the state in the loop's memory) only where that copy is cheap; otherwise the
    per-step one, whose input state is donated (its outputs alias it)."""
    from estimator.engine import programs as programs_module

    monkeypatch.setattr(programs_module, "KEPT_STATE_SHARE", share)
    programs = make_job(tmp_path, batch=8, skip_nonfinite_steps=skip_nonfinite).programs
    features, labels, _ = _stacked(programs, 2, 8)
    state = fresh_train_state(programs, (features, labels), 8)
    loop = programs.train_for(state, 8)
    assert programs.per_step_flags(state) is per_step
    assert loop is programs.train(8, per_step_flags=per_step)

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    compiled = loop.lower(*jax.tree.map(abstract, (state, features, labels))).compile()
    aliased = compiled.memory_analysis().alias_size_in_bytes
    assert (aliased > 0) is donated, aliased


def test_infer_runs_eval_or_predict_only(tmp_path):
    with pytest.raises(EstimatorValueError, match="EVAL or PREDICT"):
        _programs(tmp_path).infer(ModeKeys.TRAIN, 2)


def test_a_trace_records_the_spec_of_its_mode(tmp_path):
    programs = _programs(tmp_path)
    assert not programs.traced(ModeKeys.TRAIN)
    x, y = h.make_data(n=16)
    features, labels = {"x": x[None]}, y[None]  # one step of 16 rows, 2 per replica
    rng = np.array([0, 0], np.uint32)
    shapes = jax.eval_shape(programs.init(ModeKeys.TRAIN, 2), rng, np.int32(0), features, labels)
    assert programs.traced(ModeKeys.TRAIN) and not programs.traced(ModeKeys.EVAL)
    spec = programs.spec(ModeKeys.TRAIN)
    assert spec.mode == ModeKeys.TRAIN and hasattr(spec.train_op, "update")
    assert shapes["params"]["hidden"]["kernel"].shape == (6, 16)


@pytest.mark.parametrize(
    "unroll_loops, backend, mode, ipl, unrolled",
    [
        (None, "cpu", ModeKeys.TRAIN, 10, True),  # a short CPU training loop: unrolled
        (None, "cpu", ModeKeys.TRAIN, 11, False),
        (None, "tpu", ModeKeys.TRAIN, 10, False),  # the CPU rule is for CPU only
        (None, "cpu", ModeKeys.EVAL, 4, False),  # forward-only loops stay rolled
        (None, "cpu", ModeKeys.PREDICT, 1, False),
        (True, "cpu", ModeKeys.EVAL, 100, True),  # a configured value wins everywhere
        (True, "cpu", ModeKeys.PREDICT, 100, True),
        (True, "cpu", ModeKeys.TRAIN, 1000, True),
        (False, "cpu", ModeKeys.TRAIN, 1, False),
    ],
)
def test_unrolled_follows_the_config_then_the_cpu_rule(
    tmp_path, monkeypatch, unroll_loops, backend, mode, ipl, unrolled
):
    programs = _programs(tmp_path, unroll_loops=unroll_loops, iterations_per_loop=ipl)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert programs.unrolled(mode) is unrolled


@pytest.mark.parametrize(
    "dims, specs",
    [
        (None, (None, None)),
        ([[1, 2, 1]], (P(None, "model", None), None)),
        ([[1, 2], None], (P(None, "model"), None)),
        ([[1, 1, 2], [1, 2]], (P(None, None, "model"), P(None, "model"))),
        (
            [{"x": [1, 2], "ids": None}, [2, 1]],
            ({"x": P(None, "model"), "ids": None}, P("model", None)),
        ),
    ],
)
def test_input_specs_from_input_partition_dims(tmp_path, dims, specs):
    tpu = {"num_cores_per_replica": 2, "input_partition_dims": dims} if dims else {}
    assert _programs(tmp_path, **tpu).input_specs() == specs


@pytest.mark.parametrize(
    "tpu, replicated",
    [
        ({"compute_dtype": "float16"}, True),  # the state carries a loss scale
        ({"shard_params": True}, True),  # split over replicas: the compiler places it
        ({"shard_optimizer_state": True}, True),
        ({"num_cores_per_replica": 2}, False),  # a variable split over "model"
    ],
)
def test_train_program_is_not_compiled_ahead_where_its_input_placement_is_unknown(
    tmp_path, tpu, replicated
):
    programs = _programs(tmp_path, **tpu)
    spec = P() if replicated else P(None, "model")
    shardings = {"params": {"w": NamedSharding(programs.mesh, spec)}}
    shapes = {"params": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}}
    assert programs.compile_train_ahead(shapes, shardings, example=None) is False


class _Layout:
    def __init__(self, broadcast: bool, process_rows: int | None):
        self.broadcast, self.process_rows = broadcast, process_rows


@pytest.mark.parametrize(
    "layout, tpu",
    [
        (_Layout(True, 16), {}),  # broadcast input: rows not known per process
        (_Layout(False, None), {}),  # no eval batch size
        (_Layout(False, 16), {"shard_params": True}),  # parameters split over replicas
    ],
)
def test_eval_program_is_not_compiled_ahead_without_its_shapes(tmp_path, layout, tpu):
    programs = _programs(tmp_path, **tpu)

    class State:
        params = {"w": np.zeros((2, 2), np.float32)}
        state: dict = {}

    class Chunk:
        features = {"x": np.zeros((1, 16, 6), np.float32)}
        labels = np.zeros((1, 16), np.int32)

    assert programs.compile_eval_ahead(State(), Chunk(), layout, steps=None) is False


def test_estimator_config_validates_input_partition_dims():
    with pytest.raises(ValueError, match="num_cores_per_replica"):
        estimator.TPUConfig(input_partition_dims=[[1, 2]])
