"""io/export.py's log lines: what a run without TensorFlow says about its exports."""

from __future__ import annotations

import logging

from estimator.io import export, tf_saved_model
from tests import helpers as h


def test_without_tensorflow_the_warning_is_said_once_per_process(tmp_path, caplog, monkeypatch):
    """Issue 42: an exporter exporting at every evaluation warned each time (11 in one run)."""
    monkeypatch.setattr(tf_saved_model, "tensorflow_available", lambda: False)
    monkeypatch.setattr(export, "_NO_TF_SAID", [False])
    x, y = h.make_data(n=32)
    est = h.make_estimator(tmp_path / "run", ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    serving = export.build_raw_serving_input_receiver_fn({"x": x[:16]})
    with caplog.at_level(logging.DEBUG, logger="estimator"):
        for _ in range(3):
            est.export_saved_model(str(tmp_path / "export"), serving)
    said = [r for r in caplog.records if r.getMessage().startswith("TensorFlow is not installed")]
    assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert {r.name for r in said} == {"estimator"}
