"""Start-up: the programs a job compiles, the persistent compilation cache, the summary line;
a cold job's compilations (how many, which, on which thread, and with the same results).

Compilations are counted with JAX's monitoring events in fresh processes where a process
that already ran other tests would hide some (eager operations cached in memory); in process,
with the persistent cache off (conftest), where the job's own programs are counted.
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
from estimator.core import compilation
from estimator.core.compilation import CompileCounter
from estimator.core.runtime import seed_key_data
from estimator.core.spec import ModeKeys
from estimator.engine import tails
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[3]


def _run_job(model_dir: Path, cache_home: Path, *how: str) -> dict:
    """The _startup_job in a fresh process whose default cache lives under ``cache_home``."""
    env = {k: v for k, v in os.environ.items() if k != compilation.ENV_VAR}
    env["XDG_CACHE_HOME"] = str(cache_home)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.estimator._startup_job", str(model_dir), *how],
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

    assert len(list((cache / "estimator-executables").iterdir())) == 3  # kept by their trace
    assert cold["lowered"] >= 3

    warm = _run_job(tmp_path / "two", tmp_path / "home")
    assert warm["compiled"] == 0, warm["names"]
    assert warm["cache_hits"] == warm["events"] == cold["events"]
    assert warm["lowered"] == 0  # found by their trace: nothing lowered (engine/executables)
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


# ----------------------------------------------------------------------------- cold start
BATCH = 16


def _data(batches: int, short: int = 5):
    """``batches`` batches of 16 rows, the last one ``short`` rows short."""
    return h.make_data(n=batches * BATCH - short, seed=batches)


def test_train_then_evaluate_compiles_at_most_five_programs_and_a_second_evaluate_none(
    tmp_path,
):
    x, y = h.make_data(n=64)
    ex, ey = _data(7)  # 7 steps at IPL 4: the input ends inside the second loop
    est = h.make_estimator(tmp_path, ipl=4, compilation_cache_dir=False)
    with CompileCounter() as counter:
        est.train(h.train_input_fn(x, y), max_steps=8)
        first = est.evaluate(h.eval_input_fn(ex, ey))
    # init (one program), the train loop and the eval loop; the 3 steps after the first
    # loop run padded in the eval program (no 2- and 1-step programs).
    assert counter.compiled <= 5, counter.names
    assert sorted(counter.names) == ["jit(fresh)", "jit(loop)", "jit(loop)"], counter.names
    with CompileCounter() as again:
        second = est.evaluate(h.eval_input_fn(ex, ey))
    assert again.events == 0, again.names
    assert second == first


def _split_only(monkeypatch):
    """The tail policy before: always calls of their own (powers of two)."""
    monkeypatch.setattr(tails.CallCosts, "pad", lambda self, real, planned, loop: False)


@pytest.mark.parametrize("batches", [3, 7, 13])
def test_eval_tail_as_a_masked_call_gives_the_split_calls_results(tmp_path, monkeypatch, batches):
    """Inputs that end inside a loop: the padded call counts every example once, as the
    power-of-two calls did, and gives the same metrics and loss."""
    x, y = h.make_data(n=64)
    ex, ey = _data(batches)
    results = {}
    for policy in ("padded", "split"):
        if policy == "split":
            _split_only(monkeypatch)
        est = h.make_estimator(tmp_path / policy, ipl=4)
        est.train(h.train_input_fn(x, y), max_steps=8)
        with CompileCounter() as counter:
            results[policy] = est.evaluate(h.eval_input_fn(ex, ey))
        results[policy + " compiles"] = counter.names.count("jit(loop)")
    padded, split = results["padded"], results["split"]
    assert padded["global_step"] == split["global_step"] == 8
    assert padded["accuracy"] == pytest.approx(split["accuracy"], abs=1e-7)
    assert padded["loss"] == pytest.approx(split["loss"], rel=1e-6)
    # The reference the metrics must equal: the same model's predictions, example by example.
    est = h.make_estimator(tmp_path / "padded", ipl=4)
    logits = np.concatenate(
        [p["logits"] for p in est.predict(h.eval_input_fn(ex), yield_single_examples=False)]
    )
    assert logits.shape[0] == len(ex)
    assert padded["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == ey), abs=1e-6)
    assert results["padded compiles"] == 1  # one eval program, whatever the tail
    # Before: a program per length of the split (13 -> 4, 4, 4, 1).
    assert results["split compiles"] == len(set(tails.plan.split_steps(batches, 4)))


def test_unmasked_loss_is_exact_in_a_padded_tail(tmp_path, monkeypatch):
    """A model_fn without padding_mask() (a plain mean): the padded steps change nothing."""

    def plain_mean(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode == ModeKeys.EVAL:
            import optax

            logits = spec.eval_metrics[1][1]
            spec.loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return spec

    x, y = h.make_data(n=64)
    ex, ey = _data(6)
    results = {}
    for policy in ("padded", "split"):
        if policy == "split":
            _split_only(monkeypatch)
        est = h.make_estimator(tmp_path / policy, plain_mean, ipl=4)
        est.train(h.train_input_fn(x, y), max_steps=4)
        results[policy] = est.evaluate(h.eval_input_fn(ex, ey))
    assert results["padded"]["loss"] == pytest.approx(results["split"]["loss"], rel=1e-6)


def test_eval_program_compiled_during_training_is_the_one_used(tmp_path):
    x, y = h.make_data(n=64)
    ex, ey = _data(5)
    est = h.make_estimator(tmp_path, ipl=4, compilation_cache_dir=False)
    with CompileCounter() as counter:
        result, _ = estimator.train_and_evaluate(
            est,
            estimator.TrainSpec(h.train_input_fn(x, y), max_steps=8),
            estimator.EvalSpec(h.eval_input_fn(ex, ey), throttle_secs=10**6),
        )
    loop = est._job.programs.infer(ModeKeys.EVAL, BATCH // est.num_replicas)
    assert loop.used_ahead, "the evaluation did not run the program compiled ahead"
    # init, the train loop (compiled beside init) and the eval loop: each once.
    assert sorted(counter.names) == ["jit(fresh)", "jit(loop)", "jit(loop)"], counter.names
    # The same results as a separate evaluate of the same checkpoint.
    again = est.evaluate(h.eval_input_fn(ex, ey))
    assert again == result


def test_train_alone_compiles_no_eval_program(tmp_path):
    """Nothing is compiled that the job does not run: ``train`` does not know an evaluation
    follows, so no eval program is compiled ahead."""
    x, y = h.make_data(n=64)
    est = h.make_estimator(tmp_path, ipl=4, compilation_cache_dir=False)
    with CompileCounter() as counter:
        est.train(h.train_input_fn(x, y), max_steps=8)
    assert sorted(counter.names) == ["jit(fresh)", "jit(loop)"], counter.names


def test_compile_counter_reports_seconds_per_program(tmp_path):
    x, y = h.make_data(n=64)
    est = h.make_estimator(tmp_path, ipl=4, compilation_cache_dir=False)
    with CompileCounter() as counter:
        est.train(h.train_input_fn(x, y), max_steps=4)
    assert [name for name, _, _ in counter.programs] == counter.names
    assert all(seconds > 0 and not hit for _, seconds, hit in counter.programs)
    assert counter.compiled_seconds() == pytest.approx(counter.seconds)


def test_a_second_process_loads_every_program_compiled_ahead_from_the_cache(tmp_path):
    """train_and_evaluate compiles the train loop beside init and the eval program during
    training, on threads: those compiles go to the persistent cache like any other, so a
    fresh process with the same cache compiles nothing (only cache hits)."""
    cold = _run_job(tmp_path / "one", tmp_path / "home", "tae")
    assert cold["cache_hits"] == 0
    assert sorted(cold["names"]) == ["jit(fresh)", "jit(loop)", "jit(loop)"], cold["names"]
    warm = _run_job(tmp_path / "two", tmp_path / "home", "tae")
    assert warm["compiled"] == 0, warm["names"]
    assert warm["cache_hits"] == warm["events"] == cold["events"]
    assert warm["results"] == cold["results"]
