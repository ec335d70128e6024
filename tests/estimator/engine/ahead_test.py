"""Programs compiled ahead on a thread (``engine/ahead.py``): a call of a length compiled
ahead runs that executable, any other call runs the jitted function, and the results are
the plain ``jax.jit`` call's either way. The evaluation's first call length is checked
against the planner's arithmetic written out in the test."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimator.core import compilation
from estimator.engine import ahead
from estimator.parallel.mesh import make_mesh


@contextlib.contextmanager
def _with_cache(path):
    """Sets the process's program cache to ``path`` (False: off), restored afterwards: an
    estimator run earlier in this process may have turned it on."""
    before = jax.config.jax_compilation_cache_dir
    compilation.configure_cache(path)
    try:
        yield
    finally:
        compilation.configure_cache(before or False)


@pytest.fixture(autouse=True)
def no_program_cache():
    with _with_cache(False):
        yield


def _loop(x, w):
    """A stand-in loop: ``x`` is stacked ``[steps, rows, d]``."""
    return jnp.tanh(x @ w).sum(axis=(1, 2))


def _args(steps: int, rows: int = 4, d: int = 3):
    rng = np.random.RandomState(steps)
    return rng.randn(steps, rows, d).astype(np.float32), rng.randn(d, 2).astype(np.float32)


def _specs(args):
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)


def _call():
    return ahead.AheadCall(jax.jit(_loop), steps_of=lambda args: args[0].shape[0])


def test_a_length_compiled_ahead_runs_that_program_with_the_same_result():
    call, done = _call(), []
    future = call.compile_ahead(4, _specs(_args(4)), on_done=done.append)
    future.result(timeout=120)  # generous: other jobs share the cores
    assert len(done) == 1 and done[0] >= 0.0  # seconds spent compiling
    args = _args(4)
    got = call(*args)
    assert 4 in call.used_ahead
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(_loop)(*args)))


def test_a_second_request_for_a_length_returns_the_first():
    call = _call()
    first = call.compile_ahead(2, _specs(_args(2)))
    assert call.compile_ahead(2, _specs(_args(2))) is first
    first.result(timeout=120)


def test_other_lengths_and_other_shapes_run_the_jitted_function():
    call = _call()
    call.compile_ahead(4, _specs(_args(4))).result(timeout=120)
    other_length = _args(3)
    np.testing.assert_array_equal(
        np.asarray(call(*other_length)), np.asarray(jax.jit(_loop)(*other_length))
    )
    assert 3 not in call.used_ahead
    wider = _args(4, rows=5)  # the same length, rows other than compiled for
    np.testing.assert_array_equal(np.asarray(call(*wider)), np.asarray(jax.jit(_loop)(*wider)))
    assert 4 not in call.used_ahead  # the program compiled ahead was dropped, not run
    args = _args(4)
    np.testing.assert_array_equal(np.asarray(call(*args)), np.asarray(jax.jit(_loop)(*args)))


def test_with_a_program_cache_every_length_runs_a_stored_executable(tmp_path):
    """With the program cache on, a length not compiled ahead is compiled (or loaded) once
    and run as if it had been; the results are still the plain jit call's."""
    with _with_cache(str(tmp_path / "cache")):
        call = _call()
        for steps in (3, 3, 5):
            args = _args(steps)
            np.testing.assert_array_equal(
                np.asarray(call(*args)), np.asarray(jax.jit(_loop)(*args))
            )
        assert call.used_ahead == {3, 5}


def test_attributes_of_the_jitted_function_pass_through():
    call = _call()
    lowered = call.lower(*_specs(_args(2)))
    assert "tanh" in lowered.as_text()


class _Chunk(NamedTuple):
    features: dict
    labels: np.ndarray | None


def test_chunk_signature_is_per_row():
    chunk = _Chunk(
        {"x": np.zeros((5, 16, 3, 2), np.float32), "id": np.zeros((5, 16), np.int32)},
        np.zeros((5, 16), np.int64),
    )
    sig = ahead.chunk_signature(chunk)
    leaves, treedef = jax.tree.flatten((chunk.features, chunk.labels))
    assert sig.treedef == treedef
    assert sig.shapes == ((), (3, 2), ())  # "id", "x", labels: steps and rows dropped
    assert sig.dtypes == (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.int64))


def test_eval_call_specs_are_placed_as_evaluation_places_its_arguments():
    mesh = make_mesh()
    chunk = _Chunk({"x": np.zeros((1, 8, 3), np.float32)}, np.zeros((1, 8), np.int32))
    sig = ahead.chunk_signature(chunk)
    replicated = NamedSharding(mesh, P())
    variables = {"params": {"w": jax.device_put(np.ones((3, 2), np.float32), replicated)}}
    rng = np.array([0, 7], np.uint32)
    v, step, key, features, labels, mask = ahead.eval_call_specs(
        mesh, variables, sig, rows=32, steps=6, rng=rng
    )
    batch = NamedSharding(mesh, P(None, "data"))
    assert (v["params"]["w"].shape, v["params"]["w"].sharding) == ((3, 2), replicated)
    assert (step.shape, step.dtype, step.sharding) == ((), np.int32, replicated)
    assert (key.shape, key.dtype, key.sharding) == ((2,), np.uint32, replicated)
    assert (features["x"].shape, features["x"].dtype) == ((6, 32, 3), np.float32)
    assert (labels.shape, labels.dtype) == ((6, 32), np.int32)
    assert (mask.shape, mask.dtype) == ((6, 32), np.float32)
    assert features["x"].sharding == labels.sharding == mask.sharding == batch


# rows, row bytes, local replicas, budget, IPL, steps, merge -> the first call's steps.
# step bytes = ceil(rows / replicas) * (row bytes + 4 for the mask); fit = budget // them.
FIRST_CALLS = [
    # 16 rows / 8 = 2 per replica x (28 + 4) = 64 B a step; fit 100: the whole loop of 10
    (16, 28, 8, 6400, 10, None, False, 10),
    # merging: fit 100 // 10 = 10 loops, at most 8 per call
    (16, 28, 8, 6400, 10, None, True, 80),
    # fit 35: 3 loops per call
    (16, 28, 8, 35 * 64, 10, None, True, 30),
    # fit 4 < IPL 10: c = 3 calls, divisor 2 needs 5 > 3: ceil(10 / 3) = 4
    (16, 28, 8, 4 * 64, 10, None, False, 4),
    # 7 steps in all, IPL 10: one short loop, its calls powers of two: 4 first
    (16, 28, 8, 6400, 10, 7, False, 4),
    (16, 28, 8, 6400, 10, 7, True, 4),
    # steps=20 with 3 loops' room: the two whole loops are merged only up to what is there
    (16, 28, 8, 35 * 64, 10, 20, True, 10),
    # no steps at all: no call
    (16, 28, 8, 6400, 10, 0, False, 0),
    # 9 rows over 8 replicas: 2 rows each (rounded up)
    (9, 28, 8, 6400, 10, None, False, 10),
]


@pytest.mark.parametrize("rows, row_bytes, replicas, budget, ipl, steps, merge, first", FIRST_CALLS)
def test_first_eval_call_follows_the_plan(
    rows, row_bytes, replicas, budget, ipl, steps, merge, first
):
    got = ahead.first_eval_call(
        rows=rows,
        row_bytes=row_bytes,
        local_replicas=replicas,
        budget=budget,
        iterations_per_loop=ipl,
        steps=steps,
        merge_loops=merge,
    )
    assert got == first


def test_the_pool_is_made_once():
    assert ahead.pool() is ahead.pool()
