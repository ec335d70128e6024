"""io/orbax_noise.py: Orbax's wait-for-previous-save warning goes to DEBUG (issue 42)."""

from __future__ import annotations

import logging

from absl import logging as absl_logging

from estimator.io import orbax_noise


def test_the_save_wait_warning_goes_to_debug_and_other_absl_warnings_pass(caplog):
    orbax_noise.install()
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="estimator"):
        # As orbax/checkpoint/checkpoint_manager.py logs it.
        absl_logging.warning(
            "Waiting for previous save to complete took %f seconds. If this"
            " number is high, consider checkpointing less frequently.",
            1.01,
        )
        absl_logging.warning("Something else from a library: %d", 7)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["Something else from a library: 7"]
    (moved,) = [r for r in caplog.records if r.name == "estimator"]
    assert moved.levelno == logging.DEBUG
    assert moved.getMessage().startswith("Orbax: Waiting for previous save to complete took 1.01")
