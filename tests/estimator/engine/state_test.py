"""Placing variables for evaluation: one shared host copy on CPU devices, values unchanged; a
note naming the labels' shape when model_fn fails to trace with them."""

import gc
import traceback

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimator.core import runtime
from estimator.engine import state
from estimator.engine.state import one_copy_on_cpu
from tests import helpers as h


def _buffers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.mark.parametrize("shape, dtype", [((64, 512), np.float32), ((3,), np.int8), ((0, 4), bool)])
def test_replicated_arrays_share_one_buffer_with_the_same_values(shape, dtype):
    mesh = jax.make_mesh((8,), ("data",))
    values = np.random.RandomState(0).rand(*shape) * 100
    x = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, P()))(values.astype(dtype))
    assert len(_buffers(x)) == 8 or x.size == 0  # what a program leaves: a copy per device
    y = one_copy_on_cpu({"w": x})["w"]
    if x.size:
        assert len(_buffers(y)) == 1
    assert y.sharding == x.sharding and y.dtype == x.dtype
    del x
    gc.collect()
    _ = [np.full(shape, 7, dtype) for _ in range(20)]  # reuse freed host memory
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a)(y)), values.astype(dtype))


def test_split_and_single_device_arrays_are_left_as_they_are():
    mesh = jax.make_mesh((8,), ("data",))
    split = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data")))
    single = jax.device_put(np.arange(4.0), jax.devices()[0])
    out = one_copy_on_cpu({"split": split, "single": single, "host": np.ones(2)})
    assert out["split"] is split and out["single"] is single
    assert isinstance(out["host"], np.ndarray)


@pytest.mark.parametrize(
    "elements, cheap", [(9_000, True), (runtime.SMALL_INIT_ELEMENTS + 1, False)]
)
def test_only_a_small_models_init_program_compiles_cheaply(elements, cheap):
    """On CPU the one-off init program of a small model skips XLA's optimisation passes and
    its fusion emitters (issue 31: 0.81 -> 0.38 s of the parity job's cold start); a large
    one keeps the defaults, which run faster."""
    options = runtime.init_compiler_options(elements)
    assert (options is not None) is cheap
    if cheap:
        assert options["xla_cpu_use_fusion_emitters"] is False
        assert options["xla_backend_optimization_level"] == 0


def test_the_cheap_init_program_gives_the_same_initial_variables(tmp_path, monkeypatch):
    x, y = h.make_data(n=32)

    def initial(name, options):
        monkeypatch.setattr(state, "init_compiler_options", lambda n: options)
        est = h.make_estimator(tmp_path / name, params={"lr": 0.0})
        est.train(h.train_input_fn(x, y), max_steps=1)
        return h.params_of(est)

    default = initial("default", None)
    cheap = initial("cheap", runtime.init_compiler_options(1))
    assert default.keys() == cheap.keys()
    for name, value in default.items():
        np.testing.assert_array_equal(cheap[name], value, err_msg=name)


def test_a_shape_error_from_labels_of_shape_b_1_gets_a_note_naming_their_shape(tmp_path):
    """Issue 42: ``indices and arr must have the same number of dimensions; 3 vs. 2`` from
    inside the loss, with nothing naming the labels."""
    x, y = h.make_data(n=32)
    est = h.make_estimator(tmp_path, ipl=2)
    with pytest.raises(ValueError) as raised:
        est.train(h.train_input_fn(x, y[:, None]), max_steps=2)
    notes = getattr(raised.value, "__notes__", [])
    (note,) = [n for n in notes if n.startswith("model_fn was traced with labels")]
    assert note.startswith("model_fn was traced with labels of shape (B, 1) (B = its batch rows)")
    assert "labels.reshape(-1)" in note
    assert note in "".join(traceback.format_exception(raised.value))  # shown with the error
