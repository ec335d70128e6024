"""Runs the docstring examples of every hooks module."""

import doctest
import importlib

import pytest

MODULES = [
    "hooks",
    "hooks.base",
    "hooks.timer",
    "hooks.logging_hook",
    "hooks.stop_at_step",
    "hooks.checkpoint_saver",
    "hooks.step_counter",
    "hooks.nan_tensor",
    "hooks.profiler",
    "hooks.early_stopping",
    "hooks.event_reader",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
