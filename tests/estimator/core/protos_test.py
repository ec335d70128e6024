"""TF's session protos and ``tf.errors.NotFoundError``, ported by namespace only
(``core/protos.py``, ``core/errors.py``): the lines a TF main builds its session config and
catches a missing checkpoint with, run here unchanged but for ``tf.`` -> ``estimator.``."""

from __future__ import annotations

import logging

import pytest

import estimator
from estimator import rewriter_config_pb2
from tests import helpers as h


def test_efficientnets_session_config_lines_run_and_are_ignored_with_one_warning(tmp_path, caplog):
    config = estimator.ConfigProto(
        graph_options=estimator.GraphOptions(
            rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True)
        )
    )
    assert config.graph_options.rewrite_options.disable_meta_optimizer is True
    assert config == estimator.ConfigProto(
        graph_options=estimator.GraphOptions(
            rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True)
        )
    )
    assert "disable_meta_optimizer=True" in repr(config)
    with caplog.at_level(logging.WARNING, logger="estimator"):
        run_config = estimator.RunConfig(model_dir=str(tmp_path), session_config=config)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and "session_config" in ignored[0], ignored
    assert run_config.session_config is config


def test_mnists_config_proto_keeps_its_fields():
    config = estimator.ConfigProto(allow_soft_placement=True, log_device_placement=True)
    assert config.allow_soft_placement and config.log_device_placement
    assert config != estimator.ConfigProto(allow_soft_placement=True)
    with pytest.raises(TypeError):
        hash(config)  # a message is mutable, as TF's are


def test_not_found_error_catches_a_checkpoint_that_is_gone(tmp_path):
    """EfficientNet's and ResNet's eval loop: ``except tf.errors.NotFoundError`` around
    ``evaluate(checkpoint_path=ckpt)`` for a checkpoint rotated away."""
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, batch=16, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    gone = str(tmp_path / "model.ckpt-999")
    caught = None
    try:
        est.evaluate(h.eval_input_fn(x, y), steps=1, checkpoint_path=gone)
    except estimator.errors.NotFoundError as e:
        caught = e
    assert isinstance(caught, estimator.NoCheckpointError)
    assert estimator.errors.NotFoundError is estimator.NoCheckpointError
