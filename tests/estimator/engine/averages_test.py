"""``engine/averages.py``: the averages of non-parameter variables that
``ExponentialMovingAverage.apply(var_list)`` keeps, taken after the optimizer's update."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from estimator.engine.averages import VariablesAverageState, average_collections, blend, nest


def _state(count: int, decay: float, shadow: dict) -> VariablesAverageState:
    return VariablesAverageState(
        inner_state=optax.EmptyState(),
        num_updates=jnp.asarray(count, jnp.int32),
        use_for_eval=jnp.asarray(0, jnp.int32),
        decay=jnp.asarray(decay, jnp.float32),
        ExponentialMovingAverage=shadow,
    )


OLD = {"batch_stats": {"bn": {"mean": jnp.full(3, 5.0), "var": jnp.full(3, 2.0)}}}
NEW = {"batch_stats": {"bn": {"mean": jnp.full(3, 1.0), "var": jnp.full(3, 4.0)}}}


def _shadow(mean: float) -> dict:
    # a parameter's average (moved by the optimizer's update, not here) and one statistic
    return {"dense": {"kernel": jnp.ones(2)}, "batch_stats": {"bn": {"mean": jnp.full(3, mean)}}}


@pytest.mark.parametrize(
    "count, expected",
    [(1, 0.25 * 5.0 + 0.75 * 1.0), (2, 0.25 * 9.0 + 0.75 * 1.0)],
    ids=["first_update_starts_from_the_old_value", "later_updates_from_the_average"],
)
def test_statistics_move_toward_the_new_values(count, expected):
    got = average_collections(_state(count, 0.25, _shadow(9.0)), OLD, NEW)
    shadow = got.ExponentialMovingAverage
    np.testing.assert_allclose(shadow["batch_stats"]["bn"]["mean"], np.full(3, expected))
    assert "var" not in shadow["batch_stats"]["bn"]  # not chosen: not averaged
    np.testing.assert_array_equal(shadow["dense"]["kernel"], np.ones(2))  # params untouched
    assert int(got.num_updates) == count and float(got.decay) == 0.25


def test_found_inside_other_optimizer_state_and_the_rest_unchanged():
    inner = optax.ScaleByAdamState(jnp.zeros((), jnp.int32), {"w": jnp.ones(2)}, {"w": jnp.ones(2)})
    opt_state = (inner, _state(3, 0.5, _shadow(3.0)))
    got = average_collections(opt_state, OLD, NEW)
    assert got[0] is not None and np.array_equal(got[0].mu["w"], inner.mu["w"])
    np.testing.assert_allclose(got[1].ExponentialMovingAverage["batch_stats"]["bn"]["mean"], 2.0)
    assert average_collections(opt_state, OLD, {}) is opt_state  # no collections: no work


def test_blend_is_convex_and_keeps_the_dtype():
    s, v = jnp.full(2, 3.0, jnp.bfloat16), jnp.full(2, 1.0, jnp.float32)
    assert blend(jnp.float32(1.0), s, v).dtype == jnp.bfloat16
    np.testing.assert_array_equal(blend(jnp.float32(1.0), s, v), s)
    np.testing.assert_array_equal(blend(jnp.float32(0.0), s, v), v.astype(jnp.bfloat16))


def test_nest_inverts_names():
    assert nest({"a/b/c": 1, "a/d": 2, "e": 3}) == {"a": {"b": {"c": 1}, "d": 2}, "e": 3}
