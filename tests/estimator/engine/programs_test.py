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
from estimator.engine.model import ModelFn
from estimator.engine.programs import Programs
from estimator.errors import EstimatorValueError
from estimator.parallel.mesh import make_mesh
from estimator.spec import ModeKeys
from tests import helpers as h


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
    "unroll_loops, mode, ipl, unrolled",
    [
        (None, ModeKeys.TRAIN, 10, True),  # a short CPU training loop: unrolled
        (None, ModeKeys.TRAIN, 11, False),
        (None, ModeKeys.EVAL, 4, False),  # forward-only loops stay rolled
        (None, ModeKeys.PREDICT, 1, False),
        (True, ModeKeys.EVAL, 100, True),  # a configured value wins everywhere
        (True, ModeKeys.TRAIN, 1000, True),
        (False, ModeKeys.TRAIN, 4, False),
    ],
)
def test_unrolled_follows_the_config_then_the_cpu_rule(tmp_path, unroll_loops, mode, ipl, unrolled):
    assert jax.default_backend() == "cpu"
    programs = _programs(tmp_path, unroll_loops=unroll_loops, iterations_per_loop=ipl)
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
