"""``load_global_step`` and TF's private ``_load_global_step_from_checkpoint_dir`` (issue 41):
the newest checkpoint's global step, 0 where TF's helper gave 0."""

from __future__ import annotations

import estimator
from tests import helpers as h


def test_load_global_step_reads_the_newest_checkpoint_and_is_zero_without_one(tmp_path):
    model_dir = tmp_path / "run"
    assert estimator.load_global_step(str(model_dir)) == 0  # not there yet
    model_dir.mkdir()
    assert estimator.load_global_step(str(model_dir)) == 0  # empty
    x, y = h.make_data()
    est = h.make_estimator(model_dir, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    assert estimator.load_global_step(str(model_dir)) == 2
    est.train(h.train_input_fn(x, y), max_steps=4)
    step = estimator.load_global_step(str(model_dir))
    assert step == 4 and isinstance(step, int)
    # TF's private spelling, which ported mains call on the estimator module
    assert estimator._load_global_step_from_checkpoint_dir(str(model_dir)) == 4
    assert estimator.load_variable(str(model_dir), "global_step") == step
    # as TF: the newest checkpoint *in* the directory, so a step directory (none inside) is 0
    assert estimator.load_global_step(est.latest_checkpoint()) == 0


def test_the_private_name_stays_out_of_all():
    assert "load_global_step" in estimator.__all__
    assert "_load_global_step_from_checkpoint_dir" not in estimator.__all__
    assert estimator._load_global_step_from_checkpoint_dir is estimator.load_global_step
