"""Running a loop's calls (``driver/dispatch.py``): chunks grouped into loops lazily, each
call fetched only once the next one is queued, and no device input kept by what is yielded.

The references are event logs and groupings the tests write out by hand.
"""

from __future__ import annotations

import doctest
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimator.driver import dispatch as dispatch_lib
from estimator.driver.dispatch import InputShape, concat_steps, dispatch, loops_of


class Chunk(NamedTuple):
    steps: int
    ends_loop: bool
    loop_steps: int = 0
    features: Any = None
    labels: Any = None
    mask: Any = None


def _stream(spec: list[tuple[int, bool, int]], pulled: list | None = None):
    for i, (steps, ends, loop_steps) in enumerate(spec):
        if pulled is not None:
            pulled.append(i)
        yield Chunk(steps, ends, loop_steps, features=i)


@pytest.mark.parametrize(
    "spec, loops",
    [
        ([], []),
        ([(4, True, 4)], [(4, [4])]),
        ([(2, False, 3), (1, True, 3), (2, True, 2)], [(3, [2, 1]), (2, [2])]),
        ([(4, True, 4)] * 3, [(4, [4])] * 3),
        # the input ends inside a loop: that loop ends with it
        ([(4, False, 10), (4, False, 10)], [(10, [4, 4])]),
        ([(12, True, 4), (3, True, 3)], [(4, [12]), (3, [3])]),  # a merged call is one loop
    ],
    ids=["empty", "one", "split", "three", "cut-short", "merged"],
)
def test_loops_of_groups_chunks_by_their_loop_ends(spec, loops):
    got = [(n, [c.steps for c in loop]) for n, loop in loops_of(_stream(spec))]
    assert got == loops


def test_loops_of_takes_chunks_only_as_they_are_asked_for():
    pulled: list[int] = []
    spec = [(2, False, 6), (2, False, 6), (2, True, 6), (1, True, 1)]
    loops = loops_of(_stream(spec, pulled))
    n, first = next(loops)
    assert n == 6 and pulled == [0]  # the loop's head only
    assert next(first).features == 0 and pulled == [0]
    assert next(first).features == 1 and pulled == [0, 1]
    assert next(first).features == 2 and pulled == [0, 1, 2]
    assert next(first, None) is None and pulled == [0, 1, 2]  # its end read nothing more
    n, second = next(loops)
    assert n == 1 and pulled == [0, 1, 2, 3]
    assert [c.features for c in second] == [3]
    assert next(loops, None) is None


def test_loops_of_starts_with_a_chunk_already_taken():
    stream = _stream([(1, True, 2), (3, True, 3)])
    head = next(stream)
    got = [(n, [c.steps for c in loop]) for n, loop in loops_of(stream, first=head)]
    assert got == [(2, [1]), (3, [3])]


@pytest.mark.parametrize("calls", [0, 1, 2, 5])
def test_each_call_is_fetched_once_the_next_is_queued(calls):
    events: list[tuple[str, int]] = []
    chunks = [Chunk(i + 1, i == calls - 1, loop_steps=i) for i in range(calls)]  # id: i

    def launch(chunk):
        events.append(("launch", chunk.loop_steps))
        return chunk.loop_steps

    def fetch(out):
        events.append(("fetch", out))
        return out * 10

    got = []
    for chunk, out in dispatch(chunks, launch=launch, fetch=fetch):
        events.append(("yield", out // 10))
        got.append((chunk.steps, out))
    assert got == [(i + 1, i * 10) for i in range(calls)]
    # launch i, then fetch and hand over i - 1: at most two calls launched and not fetched
    want: list[tuple[str, int]] = []
    for i in range(calls):
        want.append(("launch", i))
        if i:
            want += [("fetch", i - 1), ("yield", i - 1)]
    if calls:
        want += [("fetch", calls - 1), ("yield", calls - 1)]
    assert events == want


@pytest.mark.parametrize("calls", [0, 1, 3])
def test_not_ahead_the_consumer_sees_each_call_before_the_next_is_launched(calls):
    events: list[tuple[str, int]] = []
    chunks = [Chunk(i + 1, i == calls - 1, loop_steps=i) for i in range(calls)]

    def launch(chunk):
        events.append(("launch", chunk.loop_steps))
        return chunk.loop_steps

    for _, out in dispatch(chunks, launch=launch, fetch=lambda o: o, ahead=False):
        events.append(("yield", out))
    assert events == [e for i in range(calls) for e in (("launch", i), ("yield", i))]


@pytest.mark.parametrize("ahead", [True, False])
def test_outputs_the_consumer_drops_are_not_kept_alive_by_dispatch(ahead):
    """What a call returned (a kept input state) is freed once the consumer drops it: with
    ``ahead=False`` before the next call is launched, else before the one after."""

    class Out:
        pass

    alive: list[weakref.ref] = []
    freed_at_launch = []

    def launch(chunk):
        freed_at_launch.append([r() is None for r in alive])
        out = Out()
        alive.append(weakref.ref(out))
        return out

    chunks = [Chunk(1, i == 3, loop_steps=i) for i in range(4)]
    for _, out in dispatch(chunks, launch=launch, fetch=lambda o: o, ahead=ahead):
        del out
    lag = 1 if not ahead else 2  # calls launched since a call's outputs were last needed
    for i, freed in enumerate(freed_at_launch):
        assert freed == [j <= i - lag for j in range(i)], (i, freed)


def test_yielded_chunks_keep_the_input_shapes_not_the_arrays():
    features = {"x": jnp.ones((2, 4, 3), jnp.float32)}
    labels = jnp.zeros((2, 4), jnp.int32)
    mask = jnp.ones((2, 4), jnp.float32)
    chunk = Chunk(2, True, 2, features=features, labels=labels, mask=mask)
    ((got, out),) = list(dispatch([chunk], launch=lambda c: c.features["x"].sum(), fetch=float))
    assert out == 24.0  # launch saw the arrays
    leaves = jax.tree.leaves((got.features, got.labels, got.mask))
    assert all(isinstance(leaf, InputShape) for leaf in leaves)
    x = got.features["x"]
    assert (x.shape, np.dtype(x.dtype), x.sharding) == (
        (2, 4, 3),
        np.float32,
        features["x"].sharding,
    )
    assert (got.labels.shape, np.dtype(got.labels.dtype)) == ((2, 4), np.int32)
    assert (got.steps, got.ends_loop) == (2, True)


def test_labels_none_stay_none():
    chunk = Chunk(1, True, 1, features=jnp.ones((1, 2)), labels=None, mask=jnp.ones((1, 2)))
    ((got, _),) = list(dispatch([chunk], launch=lambda c: None, fetch=lambda o: o))
    assert got.labels is None and isinstance(got.features, InputShape)


@pytest.mark.parametrize("lengths", [[3], [2, 1], [4, 4, 2, 1]])
def test_concat_steps_joins_calls_in_order(lengths):
    rng = np.random.RandomState(0)
    whole = {"loss": rng.randn(sum(lengths)), "host": [rng.randn(sum(lengths), 2)]}
    bounds = np.cumsum([0, *lengths])
    parts = [
        jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], whole)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    got = concat_steps(parts)
    np.testing.assert_array_equal(got["loss"], whole["loss"])
    np.testing.assert_array_equal(got["host"][0], whole["host"][0])
    if len(parts) == 1:
        assert got is parts[0]  # nothing copied


def test_docstring_examples():
    assert doctest.testmod(dispatch_lib).failed == 0
