"""Tests for hooks.base: the lifecycle types and fetch resolution."""

import collections

import numpy as np
import pytest

import hooks
from hooks import base


def test_session_run_args_is_tf_like_namedtuple():
    args = hooks.SessionRunArgs("loss")
    assert args == ("loss", None, None)
    assert args.fetches == "loss" and args.feed_dict is None and args.options is None


def test_session_run_values_defaults():
    values = hooks.SessionRunValues({"a": np.zeros(2)})
    assert values.options is None and values.run_metadata is None


def test_context_steps_and_stop():
    ctx = hooks.SessionRunContext("args", "session", steps=[3, 4], examples_per_step=8)
    assert ctx.original_args == "args" and ctx.session == "session"
    assert ctx.steps.dtype == np.int64 and ctx.steps.tolist() == [3, 4]
    assert ctx.examples_per_step == 8
    assert not ctx.stop_requested
    ctx.request_stop()
    assert ctx.stop_requested
    ctx.steps = np.array([5])
    assert ctx.steps.tolist() == [5]


def test_context_defaults():
    ctx = hooks.SessionRunContext(None, None)
    assert ctx.steps.shape == (0,) and ctx.steps.dtype == np.int64
    assert ctx.examples_per_step == 0


def test_base_hook_methods_are_noops():
    hook = hooks.SessionRunHook()
    ctx = hooks.SessionRunContext(None, None)
    hook.begin()
    hook.after_create_session(None, None)
    assert hook.before_run(ctx) is None
    hook.after_run(ctx, hooks.SessionRunValues(None))
    hook.end(None)
    assert not ctx.stop_requested


def test_nan_loss_error():
    err = hooks.NanLossDuringTrainingError(
        "NaN loss during training at global step 3.", global_step=3
    )
    assert isinstance(err, RuntimeError)
    assert err.global_step == 3 and "global step 3" in str(err)
    assert hooks.NanLossDuringTrainingError().global_step is None


Pair = collections.namedtuple("Pair", ["x", "y"])


@pytest.mark.parametrize(
    "fetches, expected",
    [
        ("loss", [1.0, 2.0]),
        (["loss", "step"], [[1.0, 2.0], [1, 2]]),
        (("loss",), ([1.0, 2.0],)),
        ({"b": "step", "a": {"c": ["loss"]}}, {"b": [1, 2], "a": {"c": [[1.0, 2.0]]}}),
        (Pair("loss", "step"), Pair([1.0, 2.0], [1, 2])),
        (collections.OrderedDict(z="loss"), collections.OrderedDict(z=[1.0, 2.0])),
        (None, None),
    ],
)
def test_resolve_fetches_mirrors_structure(fetches, expected):
    available = {"loss": np.array([1.0, 2.0]), "step": np.array([1, 2])}
    for lookup in (available, available.__getitem__):
        got = hooks.resolve_fetches(fetches, lookup)
        if not isinstance(fetches, str):
            assert type(got) is type(expected)
        np.testing.assert_equal(got, expected)


def test_resolve_fetches_errors():
    with pytest.raises(KeyError):
        hooks.resolve_fetches("missing", {})
    with pytest.raises(TypeError, match="Fetches must be"):
        hooks.resolve_fetches(3, {})


def test_fetch_names():
    assert hooks.fetch_names({"x": ["loss", ("step", "loss")], "y": "h"}) == ["loss", "step", "h"]
    assert hooks.fetch_names(None) == []


def test_fake_session_satisfies_protocol():
    from tests.hooks._fakes import FakeSession

    assert isinstance(FakeSession(), base.HookSession)


def test_public_names():
    for name in hooks.__all__:
        assert getattr(hooks, name) is not None
