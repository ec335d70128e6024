"""The start-up parameter table (each variable's name, shape, dtype, count and the totals), and
when the progress bar is shown."""

from __future__ import annotations

import logging
import sys

import numpy as np

from estimator.driver import progress
from tests import helpers as h


def test_table_lists_every_variable_and_the_totals():
    table = progress.parameter_table(
        {
            "params": {"dense": {"kernel": np.zeros((3, 2), np.float32), "bias": np.zeros(2)}},
            "batch_stats": {"bn": {"mean": np.zeros(4, np.float32)}},
        }
    ).splitlines()
    assert table[0] == "Parameters: 3 variable(s), 8 trainable, 4 in other collections"
    assert table[1].split() == ["name", "shape", "dtype", "count"]
    assert table[2].split() == ["dense/bias", "(2,)", "float64", "2"]
    assert table[3].split() == ["dense/kernel", "(3,", "2)", "float32", "6"]
    assert table[4].split() == ["batch_stats/bn/mean", "(4,)", "float32", "4"]
    assert table[5].split() == ["total", "12"]


def test_big_models_are_capped_and_say_so():
    params = {f"layer_{i:03d}": {"kernel": np.zeros((10, 10))} for i in range(100)}
    lines = progress.parameter_table({"params": params}).splitlines()
    assert len(lines) == 1 + 1 + progress.MAX_TABLE_ROWS + 2
    assert lines[-2].strip() == (
        f"... {100 - progress.MAX_TABLE_ROWS} more variable(s) (6,000 elements) not listed "
        "(the whole table at DEBUG level)"
    )
    assert lines[-1].split() == ["total", "10,000"]
    full = progress.parameter_table({"params": params}, max_rows=None).splitlines()
    assert len(full) == 1 + 1 + 100 + 1


def test_training_logs_the_table_at_info(tmp_path, caplog):
    x, y = h.make_data(n=32)
    est = h.make_estimator(tmp_path, params={"hidden": 8}, ipl=2)
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=2)
    (table,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Parameters:")]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["hidden/kernel"] == ["hidden/kernel", "(6,", "8)", "float32", "48"]
    assert rows["total"] == ["total", str(6 * 8 + 8 + 8 * 3 + 3)]


class _Kernel:
    """What ``IPython.get_ipython()`` returns in a Jupyter kernel (its config names the app)."""

    config = {"IPKernelApp": {"connection_file": "kernel-1.json"}}


class _Terminal:
    config = {"TerminalInteractiveShell": {}}


def _ipython(shell):
    return type("IPython", (), {"get_ipython": staticmethod(lambda: shell)})


def test_the_bar_is_on_by_default_in_a_notebook_kernel(monkeypatch):
    """Issue 42: stderr is not a terminal in Jupyter, so the bar used to be off there."""
    monkeypatch.delenv("TPU_ESTIMATOR_NO_PROGRESS_BAR", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.setitem(sys.modules, "IPython", _ipython(_Kernel()))
    assert progress.progress_enabled(None)
    assert not progress.progress_enabled(False)
    monkeypatch.setenv("TPU_ESTIMATOR_NO_PROGRESS_BAR", "1")
    assert not progress.progress_enabled(None)  # the switch still turns it off
    monkeypatch.delenv("TPU_ESTIMATOR_NO_PROGRESS_BAR")
    monkeypatch.setitem(sys.modules, "IPython", _ipython(_Terminal()))  # IPython in a terminal
    assert not progress.progress_enabled(None)
    monkeypatch.setitem(sys.modules, "IPython", _ipython(None))  # imported, not running
    assert not progress.progress_enabled(None)
