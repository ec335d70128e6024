"""The naive one-loss port caught (``engine/masked_chain.py``): which optimizer states are
flagged, and the one WARNING that names the variable sets.

The expected sets are written out per row from the params and masks each row builds; the
estimator-level check (the warning in a real ``train``) is in ``multi_loss_test.py``.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import optax
import pytest

from estimator.engine import masked_chain

PARAMS = {
    "D": {"k": jnp.zeros((3, 2)), "b": jnp.zeros(2)},
    "G": {"k": jnp.zeros((4, 3))},
    "H": {"k": jnp.zeros((2, 2))},
}
D = {"D": True, "G": False, "H": False}
G = {"D": False, "G": True, "H": False}
H = {"D": False, "G": False, "H": True}
ADAM = optax.adam(1e-3)


def _flagged(tx) -> list[list[set[str]]]:
    return masked_chain.masked_chains(jax.eval_shape(tx.init, PARAMS), PARAMS)


@pytest.mark.parametrize(
    "tx, flagged",
    [
        # slots over disjoint sets, whatever the optimizers
        (
            optax.chain(optax.masked(ADAM, D), optax.masked(optax.sgd(0.1, 0.9), G)),
            [[{"D/k", "D/b"}, {"G/k"}]],
        ),
        (
            optax.chain(optax.masked(ADAM, D), optax.masked(ADAM, G), optax.masked(ADAM, H)),
            [[{"D/k", "D/b"}, {"G/k"}, {"H/k"}]],
        ),
        # a chain inside another transformation's chain is still found
        (
            optax.chain(
                optax.clip_by_global_norm(1.0),
                optax.chain(optax.masked(ADAM, D), optax.masked(ADAM, G)),
            ),
            [[{"D/k", "D/b"}, {"G/k"}]],
        ),
        # not flagged: no per-variable state (plain SGD keeps none)
        (optax.chain(optax.masked(optax.sgd(0.1), D), optax.masked(optax.sgd(0.1), G)), []),
        # not flagged: the same variables under both
        (optax.chain(optax.masked(ADAM, D), optax.masked(optax.sgd(0.1, 0.9), D)), []),
        # not flagged: one masked optimizer beside an unmasked one
        (optax.chain(optax.masked(ADAM, D), ADAM), []),
        # not flagged: no mask at all
        (ADAM, []),
    ],
    ids=["two", "three", "nested", "stateless", "overlap", "one-masked", "unmasked"],
)
def test_masked_chains_flags_disjoint_per_variable_state(tx, flagged):
    assert _flagged(tx) == flagged


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test starts as a new process would: no warning given yet."""
    monkeypatch.setattr(masked_chain, "_WARNED", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_warn_names_the_sets_once_per_process(caplog, fresh_warnings):
    tx = optax.chain(optax.masked(ADAM, D), optax.masked(ADAM, G))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        masked_chain.warn(tx, PARAMS)
        masked_chain.warn(tx, PARAMS)
    (message,) = _warnings(caplog)
    assert "chains 2 optax.masked optimizers" in message
    assert "[D/* (2 variables)] and [G/k]" in message
    assert "estimator.group(estimator.minimize(d_loss" in message


@pytest.mark.parametrize(
    "tx",
    [
        optax.chain(optax.masked(optax.sgd(0.1), D), optax.masked(optax.sgd(0.1), G)),
        optax.GradientTransformation(lambda p: 1 / 0, lambda u, s, p=None: (u, s)),
    ],
    ids=["not-flagged", "init-fails"],
)
def test_warn_is_quiet_when_nothing_is_flagged_or_init_fails(caplog, fresh_warnings, tx):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        masked_chain.warn(tx, PARAMS)  # an init that fails raises later, with its own message
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "names, described",
    [
        ({"G/k"}, "G/k"),
        ({"D/k", "D/b"}, "D/* (2 variables)"),  # a common prefix stands for the set
        ({"net/D/k", "net/D/b", "net/G/k"}, "net/* (3 variables)"),
        ({"a/k", "b/k"}, "a/k, b/k"),  # no common prefix: listed
        ({"a", "b", "c", "d"}, "a, b, c, ... (4 variables)"),  # at most three shown
    ],
)
def test_sets_are_described_by_their_common_prefix(names, described):
    assert masked_chain._describe(names) == described
