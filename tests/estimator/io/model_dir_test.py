"""Which model_dir the estimator uses, the paths Orbax could not read back, and what a
checkpoint path names (``io/model_dir.py``); no checkpoint is written."""

from __future__ import annotations

import logging
import os

import pytest

from estimator.core.errors import EstimatorValueError, NoCheckpointError
from estimator.io import model_dir as model_dir_lib


@pytest.mark.parametrize("name", ["run[1]", "a\\b", "run*", "run?", "x]"])
def test_a_glob_character_anywhere_in_the_path_is_refused(tmp_path, name):
    with pytest.raises(EstimatorValueError, match="glob characters"):
        model_dir_lib.check_model_dir(str(tmp_path / name / "model"))


def test_other_punctuation_is_accepted(tmp_path):
    model_dir_lib.check_model_dir(str(tmp_path / "run 1, lr=0.1 (#2) {a}; ~$%&+@!'"))


def test_the_argument_and_the_config_must_agree(tmp_path):
    here = str(tmp_path / "a")
    assert model_dir_lib.resolve_model_dir(here, None) == here
    assert model_dir_lib.resolve_model_dir(None, here) == here
    relative = os.path.relpath(here)  # the same directory, spelled another way
    assert model_dir_lib.resolve_model_dir(relative, here) == relative
    with pytest.raises(EstimatorValueError, match="differs from config.model_dir"):
        model_dir_lib.resolve_model_dir(here, str(tmp_path / "b"))


def test_no_model_dir_is_a_new_temporary_one_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        chosen = model_dir_lib.resolve_model_dir(None, None)
    try:
        assert os.path.isdir(chosen) and not os.listdir(chosen)
        assert "Using temporary folder as model directory" in caplog.text
    finally:
        os.rmdir(chosen)


def test_a_chosen_model_dir_is_checked(tmp_path):
    with pytest.raises(EstimatorValueError, match="glob"):
        model_dir_lib.resolve_model_dir(None, str(tmp_path / "run*"))


@pytest.fixture
def dirs(tmp_path):
    """A model_dir with step 4, one in the layout from before (``checkpoints/7``), an empty
    directory."""
    (tmp_path / "new" / "model.ckpt-4").mkdir(parents=True)
    (tmp_path / "old" / "checkpoints" / "7").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    return tmp_path


def test_a_checkpoint_path_names_a_step_or_a_model_dir(dirs):
    new, old = str(dirs / "new"), str(dirs / "old")
    assert model_dir_lib.resolve_path(None, new) == (new, None)  # this estimator's latest
    assert model_dir_lib.resolve_path(str(dirs / "new" / "model.ckpt-4"), "x") == (new, 4)
    assert model_dir_lib.resolve_path(new, "x") == (new, None)
    assert model_dir_lib.resolve_path(str(dirs / "old" / "checkpoints" / "7"), "x") == (old, 7)
    assert model_dir_lib.resolve_path(str(dirs / "old" / "checkpoints"), "x") == (old, None)
    assert model_dir_lib.resolve_path(old, "x") == (old, None)


@pytest.mark.parametrize(
    "path,match",
    [("new/model.ckpt-5", "does not exist"), ("empty", "is not a checkpoint")],
)
def test_a_path_that_names_no_checkpoint_is_an_error(dirs, path, match):
    with pytest.raises(NoCheckpointError, match=match):
        model_dir_lib.resolve_path(str(dirs / path), "x")


def test_the_checkpoint_directory_follows_the_layout_found(dirs):
    assert model_dir_lib.checkpoint_dir(str(dirs / "new")) == str(dirs / "new")
    assert model_dir_lib.checkpoint_dir(str(dirs / "old")) == str(dirs / "old" / "checkpoints")
    assert model_dir_lib.checkpoint_dir(str(dirs / "missing")) == str(dirs / "missing")
