"""digits_mlp and digits_cnn reach the accuracy the README (Model zoo) states, in short test runs.

the README (Model zoo) states >= 95% eval accuracy for both (measured: see the table there).
"""

import pytest

from tests.configs._jobs import build_job


@pytest.mark.parametrize(
    "name, overrides",
    [
        # The default job's 600 steps, in one device loop (one compile).
        ("digits_mlp", {"iterations_per_loop": 600}),
        # 120 of its 600 steps, unrolled 2-step loops (conv in a rolled loop is slow on CPU).
        (
            "digits_cnn",
            {"max_steps": 120, "model_params.decay_steps": 120, "iterations_per_loop": 2},
        ),
    ],
)
def test_digits_job_reaches_95_percent(name, overrides, tmp_path):
    quiet = {"log_step_count_steps": 0, "save_summary_steps": 0, "save_checkpoints_steps": 1000}
    est, fns, config = build_job(name, tmp_path, **quiet, **overrides)
    assert est.num_replicas == 8
    est.train(fns["train"], max_steps=config.max_steps)
    results = est.evaluate(fns["eval"])
    assert results["global_step"] == config.max_steps
    assert results["accuracy"] >= 0.95, results
