"""Start-up: the programs a job compiles, the persistent compilation cache, the summary line.

Compilations are counted with JAX's monitoring events in fresh processes: a process that
already ran other tests has eager operations cached in memory, which would hide them.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import estimator
from estimator import compilation
from estimator.compilation import CompileCounter
from estimator.runtime import seed_key_data
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[2]


def _run_job(model_dir: Path, cache_home: Path) -> dict:
    """The _startup_job in a fresh process whose default cache lives under ``cache_home``."""
    env = {k: v for k, v in os.environ.items() if k != compilation.ENV_VAR}
    env["XDG_CACHE_HOME"] = str(cache_home)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.estimator._startup_job", str(model_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STARTUP_JOB "))
    return json.loads(line.split(" ", 1)[1])


def test_fresh_process_compiles_at_most_four_programs_and_a_second_compiles_none(tmp_path):
    cold = _run_job(tmp_path / "one", tmp_path / "home")
    # init (variables and optimizer state in one program), train loop, eval loop: nothing
    # eager (no seed, slice or convert programs) and nothing twice.
    assert cold["events"] <= 4, cold["names"]
    assert cold["cache_hits"] == 0
    assert sorted(cold["names"]) == ["jit(fresh)", "jit(loop)", "jit(loop)"]
    cache = tmp_path / "home" / "tpu-estimator" / "jax"
    assert len(list(cache.iterdir())) >= 3  # the default per-user cache was written

    warm = _run_job(tmp_path / "two", tmp_path / "home")
    assert warm["compiled"] == 0, warm["names"]
    assert warm["cache_hits"] == warm["events"] == cold["events"]
    assert warm["results"] == cold["results"]  # the cached programs compute the same


@pytest.mark.parametrize("seed", [None, 0, 1, 1234, 2**31 - 1, 2**31, -1])
def test_seed_key_data_is_jax_key_data_computed_on_the_host(seed):
    want = np.asarray(jax.random.key_data(jax.random.key(0 if seed is None else seed)))
    got = seed_key_data(seed)
    assert got.dtype == np.uint32 and np.array_equal(got, want)


def test_compilation_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compilation.ENV_VAR, raising=False)
    default = str(tmp_path / "xdg" / "tpu-estimator" / "jax")
    assert compilation.resolve_cache_dir(None) == default
    assert compilation.resolve_cache_dir(True) == default
    assert compilation.resolve_cache_dir(False) is None
    assert compilation.resolve_cache_dir(tmp_path / "mine") == str(tmp_path / "mine")
    monkeypatch.setenv(compilation.ENV_VAR, str(tmp_path / "env"))
    assert compilation.resolve_cache_dir(None) == str(tmp_path / "env")
    assert compilation.resolve_cache_dir(tmp_path / "mine") == str(tmp_path / "mine")
    for off in ("0", "off", "False", "none"):
        monkeypatch.setenv(compilation.ENV_VAR, off)
        assert compilation.resolve_cache_dir(None) is None
    with pytest.raises(TypeError, match="compilation_cache_dir"):
        estimator.RunConfig(compilation_cache_dir=3)


def test_configure_cache_turns_jax_cache_on_bounded_and_off(tmp_path):
    try:
        assert compilation.configure_cache(tmp_path / "c") == str(tmp_path / "c")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_compilation_cache_max_size == compilation.DEFAULT_MAX_BYTES
        jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))
        assert list((tmp_path / "c").iterdir())  # written, however fast it compiled
    finally:
        assert compilation.configure_cache(False) is None
    assert jax.config.jax_compilation_cache_dir is None


def _adam_model_fn(features, labels, mode, params):
    spec = h.model_fn(features, labels, mode, params)
    if mode == estimator.ModeKeys.TRAIN:
        spec.train_op = optax.adam(0.05)
    return spec


def test_one_init_program_trains_like_a_separate_optimizer_init(tmp_path):
    """A scaffold init_fn takes the other path (variables first, optimizer state after):
    both must train to the same parameters, and neither may compile a loop twice."""
    x, y = h.make_data()

    def with_scaffold(features, labels, mode, params):
        spec = _adam_model_fn(features, labels, mode, params)
        spec.scaffold_fn = lambda: estimator.Scaffold(init_fn=lambda v: v)
        return spec

    runs = {}
    for name, fn in (("fused", _adam_model_fn), ("scaffold", with_scaffold)):
        est = estimator.TPUEstimator(
            fn, config=h.config(tmp_path / name, iterations_per_loop=2), train_batch_size=16
        )
        with CompileCounter() as counter:
            est.train(h.train_input_fn(x, y), max_steps=6)  # three loops
        assert counter.names.count("jit(loop)") == 1, counter.names
        runs[name] = h.params_of(est)
    h.assert_params_close(runs["fused"], runs["scaffold"], rtol=0, atol=0)


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_startup_summary_reports_time_to_first_step_and_compiles_at_debug(tmp_path):
    x, y = h.make_data()
    logger, logs = logging.getLogger("estimator"), _Logs()
    level = logger.level
    logger.addHandler(logs)
    logger.setLevel(logging.DEBUG)
    try:
        est = estimator.TPUEstimator(
            h.model_fn, config=h.config(tmp_path, iterations_per_loop=2), train_batch_size=16
        )
        est.train(h.train_input_fn(x, y), max_steps=4)
    finally:
        logger.removeHandler(logs)
        logger.setLevel(level)
    summary = [r for r in logs.records if r.getMessage().startswith("Training on")]
    assert len(summary) == 1 and summary[0].levelno == logging.INFO
    seconds = float(summary[0].getMessage().split("first step after ")[1].split(" s")[0])
    assert seconds > 0
    compiles = [r for r in logs.records if "XLA compilations before the first step" in r.msg]
    assert len(compiles) == 1 and compiles[0].levelno == logging.DEBUG
    assert "jit(fresh)" in compiles[0].getMessage() and "jit(loop)" in compiles[0].getMessage()
