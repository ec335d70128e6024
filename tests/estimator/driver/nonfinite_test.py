"""The all-finite guarantee checked once per compiled call (issue 39, docs/performance.md
finding 14): a state that turns non-finite at step k of a call of several steps is named as
step k (found by a replay), and nothing after step k - 1 is checkpointed; the same where
keeping the call's input is not cheap and every step is checked."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.driver import nonfinite
from estimator.engine import programs as programs_lib
from estimator.io import checkpoint as ckpt_lib
from tests import helpers as h

IPL = 6
BAD_STEP = 8  # the second step of the second loop (steps 7-12), never a call's last


def _saved_steps(model_dir) -> list[int]:
    return sorted(int(p.name.split("-")[-1]) for p in Path(model_dir).glob("model.ckpt-*[0-9]"))


def _nan_params_at(step: int) -> optax.GradientTransformation:
    """sgd whose update makes every parameter NaN at global ``step`` (its loss is finite)."""
    inner = optax.sgd(0.1)

    def init(params):
        return (inner.init(params), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state[0], params)
        count = state[1] + 1
        nan = jnp.where(count == step, jnp.nan, 0.0).astype(jnp.float32)
        return jax.tree.map(lambda u: u + nan, updates), (inner_state, count)

    return optax.GradientTransformation(init, update)


def _inf_moment_at(step: int) -> optax.GradientTransformation:
    """adam whose second moment of one leaf is Inf from global ``step`` on: the parameters
    and the loss stay finite (that leaf's update is 0), only the optimizer state is not."""
    inner = optax.adam(1e-2)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        adam = state[0]
        leaves, treedef = jax.tree.flatten(adam.nu)
        leaves[0] = jnp.where(adam.count == step, jnp.inf, leaves[0])
        return updates, (adam._replace(nu=jax.tree.unflatten(treedef, leaves)), *state[1:])

    return optax.GradientTransformation(inner.init, update)


_OPTIMIZERS = {"nan_params": _nan_params_at, "inf_moment": _inf_moment_at}


def _model_fn(features, labels, mode, params):
    spec = h.model_fn(features, labels, mode, params)
    if mode == estimator.ModeKeys.TRAIN:
        spec.train_op = _OPTIMIZERS[params["poison"]](params["bad_step"])
    return spec


def _estimator(model_dir, poison: str, **tpu):
    return h.make_estimator(
        model_dir,
        ipl=IPL,
        save_checkpoints_steps=IPL,
        keep_checkpoint_max=None,
        model_fn=_model_fn,
        params={"poison": poison, "bad_step": BAD_STEP},
        tpu=tpu,
    )


@pytest.fixture
def calls(monkeypatch):
    """Records each checked call as (its steps, whether its input was kept for a replay)."""
    seen = []
    check = nonfinite.FiniteGuard.check

    def spy(self, flags, losses, steps, source):
        seen.append((len(steps), source is not None))
        return check(self, flags, losses, steps, source)

    monkeypatch.setattr(nonfinite.FiniteGuard, "check", spy)
    return seen


@pytest.mark.parametrize("poison, named", [("nan_params", "hidden/kernel"), ("inf_moment", "nu")])
@pytest.mark.parametrize("check", ["per call", "per step"])
@pytest.mark.parametrize("call_steps", [IPL, 3])
def test_state_nonfinite_inside_a_call_is_named_at_its_step(
    tmp_path, monkeypatch, calls, poison, named, check, call_steps
):
    if check == "per step":  # keeping the input is "not cheap": every step is checked
        monkeypatch.setattr(programs_lib, "KEPT_STATE_SHARE", 0.0)
    x, y = h.make_data()
    # A small budget splits each loop into calls of 3 steps (the spy below confirms it).
    tpu = {} if call_steps == IPL else {"max_staged_input_bytes": 224}
    est = _estimator(tmp_path, poison, **tpu)
    with pytest.raises(estimator.NanLossDuringTrainingError) as info:
        est.train(h.train_input_fn(x, y), max_steps=2 * IPL)
    assert info.value.global_step == BAD_STEP, str(info.value)
    message = str(info.value)
    assert f"global step {BAD_STEP} " in message
    bad = message.split("non-finite:")[1].split(";")[0]
    assert named in bad and "loss" not in bad, message
    assert _saved_steps(tmp_path) == [IPL]  # nothing after step BAD_STEP - 1 was saved
    restored = ckpt_lib.Checkpoints(str(tmp_path), read_only=True).restore(IPL)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(restored))
    # The calls were as intended: several steps each, the failing one last checked.
    assert {n for n, _ in calls} == {call_steps}, calls
    assert calls[-1] == (call_steps, check == "per call"), calls
    # A restart resumes from the finite checkpoint and meets the same error at the same step.
    with pytest.raises(estimator.NanLossDuringTrainingError, match=f"global step {BAD_STEP} "):
        _estimator(tmp_path, poison, **tpu).train(h.train_input_fn(x, y), max_steps=2 * IPL)


def test_finite_training_keeps_inputs_and_checks_once_per_call(tmp_path, calls):
    """Nothing non-finite: one check per call (no per-step flags, no replay compiled), and
    the kept inputs are released as each call is checked."""
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, ipl=IPL, save_checkpoints_steps=IPL)
    est.train(h.train_input_fn(x, y), max_steps=2 * IPL)
    assert calls == [(IPL, True), (IPL, True)]
    built = [key for key in est._job.programs._cache if key[0] == "train"]
    assert built == [("train", 2, False)]  # the per-step program was never built


# ----------------------------------------------------------------------------- the guard alone
def _flags(bad_leaf: int | None, leaves: int = 3) -> np.ndarray:
    flags = np.ones(leaves, bool)
    if bad_leaf is not None:
        flags[bad_leaf] = False
    return flags


def test_guard_without_replay_names_the_first_step_of_the_call():
    """With non-finite steps skipped a finite state stays finite: only the state the call
    started from can be non-finite, so the error names the call's first step."""
    guard = nonfinite.FiniteGuard(["a", "b", "c"], per_step=False, replay_loop=None)
    guard.check(_flags(None), np.zeros(4), np.arange(5, 9), None)  # finite: no error
    with pytest.raises(estimator.NanLossDuringTrainingError, match="global step 5 ") as info:
        guard.check(_flags(1), np.zeros(4), np.arange(5, 9), None)
    assert "non-finite: b;" in str(info.value)


def test_guard_replays_and_says_so_when_the_replay_stays_finite():
    replayed = []

    def replay_loop():
        def loop(state, features, labels):
            replayed.append(state)
            n = len(features)
            return state, (np.full(n, 0.5), None, np.ones((n, 3), bool))

        return loop

    guard = nonfinite.FiniteGuard(["a", "b", "c"], per_step=False, replay_loop=replay_loop)
    source = nonfinite.Replay("state", np.zeros((4, 2)), np.zeros((4, 2)))
    with pytest.raises(estimator.NanLossDuringTrainingError, match="did not reproduce") as info:
        guard.check(_flags(2), np.zeros(4), np.arange(5, 9), source)
    assert replayed == ["state"] and info.value.global_step == 8
