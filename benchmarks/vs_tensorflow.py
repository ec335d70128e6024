"""A small job next to TensorFlow's TPUEstimator: MLP 64-64-10 on digits, batch 64,
iterations_per_loop 4, 1,500 steps of Adam, then one evaluation of the data set.

Run from the repository root::

    python -m benchmarks.vs_tensorflow [--quick] [--repeats N]

Every run is a fresh Python process, timed whole (Python and framework imports included,
``process s``) and from just before the estimator is built to ``evaluate``'s return
(``job s``; each side's framework modules are imported before it starts), and to the end
of the first training loop (``first loop s``). Our side
runs three ways, interleaved per repeat: the persistent compilation cache ``off``, ``cold`` (an
empty cache directory) and ``warm`` (a second process on that directory). Both sides run on
one device (``use_tpu=False``).

TensorFlow's side runs only when ``TPU_ESTIMATOR_TF_PYTHON`` names the Python of a separate
environment with TensorFlow 2.15 (and its ``tensorflow_estimator``): TF 2.15 cannot share the
project's environment (its own numpy, protobuf and ml_dtypes pins). The data goes to that
process as an ``.npz`` file. Without the variable the TF row is left out and the ratio column
is empty. ``ratio to TF`` = our ``job s`` / TF's ``job s`` (median over repeats; < 1 is faster).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import hooks
from benchmarks import _common as C
from estimator.core.compilation import CompileCounter

TF_PYTHON_ENV = "TPU_ESTIMATOR_TF_PYTHON"
BATCH, IPL, HIDDEN, LEARNING_RATE = 64, 4, 64, 1e-3
MODES = ("off", "cold", "warm")


def steps(quick: bool) -> int:
    return 40 if quick else 1500


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: 1,797 images of 8x8 pixels in [0, 1], 10 classes."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


# ----------------------------------------------------------------------------- our side
def _ours(cache_dir: str | None, n_steps: int) -> dict:
    import flax.linen as nn
    import optax

    import estimator
    import metrics

    x, y = digits()

    def model_fn(features, labels, mode, params):
        h = nn.relu(nn.Dense(HIDDEN)(features))
        h = nn.relu(nn.Dense(HIDDEN)(h))
        logits = nn.Dense(10)(h)
        mask = estimator.padding_mask()
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        loss = (per_row * mask).sum() / mask.sum()
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=optax.adam(LEARNING_RATE),
            eval_metrics=(
                lambda labels, logits: {"accuracy": metrics.accuracy(labels, logits.argmax(-1))},
                [labels, logits],
            ),
        )

    def train_input_fn(params):
        b = params["batch_size"]
        while True:
            for i in range(0, len(x) - b + 1, b):
                yield x[i : i + b], y[i : i + b]

    def eval_input_fn(params):
        b = params["batch_size"]
        for i in range(0, len(x), b):
            yield x[i : i + b], y[i : i + b]

    # The framework is imported before the clock starts on both sides: TF's script resolves
    # its lazily loaded tf.compat.v1.estimator.tpu at module level; here the package's lazy
    # TPUEstimator is resolved the same way ("process s" counts every import).
    _ = estimator.TPUEstimator, estimator.RunConfig, estimator.TPUConfig
    model_dir = tempfile.mkdtemp(prefix="bench_vs_tf_")
    try:
        job_start = C.now()
        est = estimator.TPUEstimator(
            model_fn,
            config=estimator.RunConfig(
                model_dir=model_dir,
                tpu_config=estimator.TPUConfig(iterations_per_loop=IPL),
                compilation_cache_dir=cache_dir or False,
                progress_bar=False,
            ),
            use_tpu=False,
            train_batch_size=BATCH,
            eval_batch_size=BATCH,
        )
        first_loop = _FirstLoop(C.now)
        with CompileCounter() as counter:
            est.train(train_input_fn, max_steps=n_steps, hooks=[first_loop])
            results = est.evaluate(eval_input_fn)
        end = C.now()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    return {
        "job_s": end - job_start,
        "first_loop_s": first_loop.at - job_start,
        "accuracy": float(results["accuracy"]),
        "compiles": counter.compiled,
        "cache_hits": counter.cache_hits,
        "programs": [[name, seconds, hit] for name, seconds, hit in counter.programs],
    }


class _FirstLoop(hooks.SessionRunHook):
    """Records when the first training loop's outputs are back (``after_run``), on both
    sides the end of the first ``iterations_per_loop`` steps."""

    def __init__(self, clock):
        self.clock, self.at = clock, None

    def after_run(self, run_context, run_values):
        if self.at is None:
            self.at = self.clock()


def probe(key: str, quick: bool) -> None:
    """One job in this fresh process; ``key`` is the cache directory (``-``: off)."""
    C.print_probe_result(_ours(None if key == "-" else key, steps(quick)))


# ----------------------------------------------------------------------------- TF's side
TF_SCRIPT = r"""
import json, sys, tempfile, time
import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()
tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
data_path, n_steps, batch, ipl, hidden, lr = sys.argv[1:7]
n_steps, batch, ipl, hidden, lr = int(n_steps), int(batch), int(ipl), int(hidden), float(lr)
data = np.load(data_path)
x, y = data["x"], data["y"]
tpu = tf.compat.v1.estimator.tpu


def model_fn(features, labels, mode, params):
    h = tf.compat.v1.layers.dense(features, hidden, activation=tf.nn.relu)
    h = tf.compat.v1.layers.dense(h, hidden, activation=tf.nn.relu)
    logits = tf.compat.v1.layers.dense(h, 10)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf.compat.v1.train.AdamOptimizer(lr).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())

    def metric_fn(labels, logits):
        return {"accuracy": tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, -1))}

    return tpu.TPUEstimatorSpec(mode, loss=loss, train_op=train_op,
                                eval_metrics=(metric_fn, [labels, logits]))


def train_input_fn(params):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return ds.batch(params["batch_size"], drop_remainder=True)


def eval_input_fn(params):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(params["batch_size"])


class FirstLoop(tf.compat.v1.train.SessionRunHook):
    at = None

    def after_run(self, run_context, run_values):
        if FirstLoop.at is None:
            FirstLoop.at = time.time()


job_start = time.time()
est = tpu.TPUEstimator(
    model_fn=model_fn, use_tpu=False, train_batch_size=batch, eval_batch_size=batch,
    config=tpu.RunConfig(model_dir=tempfile.mkdtemp(),
                         tpu_config=tpu.TPUConfig(iterations_per_loop=ipl)))
est.train(train_input_fn, max_steps=n_steps, hooks=[FirstLoop()])
results = est.evaluate(eval_input_fn)
end = time.time()
print("TF_RESULT " + json.dumps({"job_s": end - job_start, "first_loop_s": FirstLoop.at - job_start,
                                  "accuracy": float(results["accuracy"])}), flush=True)
"""


def tf_python() -> str | None:
    """The separate TensorFlow 2.15 environment's Python, if one is given."""
    path = os.environ.get(TF_PYTHON_ENV)
    return path if path and os.path.exists(path) else None


def _run_tf(python: str, data_path: str, quick: bool, tmp: str) -> dict:
    script = os.path.join(tmp, "tf_job.py")
    with open(script, "w") as f:
        f.write(TF_SCRIPT)
    args = [data_path, steps(quick), BATCH, IPL, HIDDEN, LEARNING_RATE]
    start = time.time()
    proc = subprocess.run(
        [python, script, *map(str, args)], capture_output=True, text=True, timeout=900
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("TF_RESULT "):
            out = json.loads(line.split(" ", 1)[1])
            return {
                **out,
                "wall_s": time.time() - start,
                "compiles": None,
                "cache_hits": None,
                "programs": None,
            }
    raise RuntimeError(f"the TensorFlow job failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def _run_ours(cache_dir: str | None, quick: bool) -> dict:
    """Our job in a fresh process on one CPU device, as TensorFlow runs it (no simulated
    devices: an empty ``XLA_FLAGS`` keeps ``benchmarks`` from adding them)."""
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA reads a non-empty value that is only spaces as a file name and aborts.
    kept = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).split()
    os.environ["XLA_FLAGS"] = " ".join(kept)
    try:
        start = time.time()
        out = C.run_probe(__spec__.name, cache_dir or "-", ["--quick"] if quick else [])
        return {**out, "wall_s": time.time() - start}
    finally:
        os.environ["XLA_FLAGS"] = flags


def measure(quick: bool, repeats: int, modes: tuple[str, ...]) -> dict:
    """``{case: [result per repeat]}``, cases interleaved within each repeat."""
    python = tf_python()
    cases = [f"estimator:{m}" for m in modes] + (["tensorflow"] if python else [])
    out: dict = {c: [] for c in cases}
    tmp = tempfile.mkdtemp(prefix="bench_vs_tf_")
    try:
        data_path = os.path.join(tmp, "digits.npz")
        x, y = digits()
        np.savez(data_path, x=x, y=y)
        for r in range(repeats):
            cache_dir = os.path.join(tmp, f"cache{r}")
            for mode in modes:
                out[f"estimator:{mode}"].append(
                    _run_ours(None if mode == "off" else cache_dir, quick)
                )
            if python:
                out["tensorflow"].append(_run_tf(python, data_path, quick, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _keyed(programs: list) -> dict:
    """``{(name, k): seconds}``: the k-th program of that name (threads may finish programs
    of different names in either order, but those of one name in the job's order)."""
    seen: dict = {}
    out = {}
    for name, seconds, _ in programs:
        k = seen[name] = seen.get(name, -1) + 1
        out[(name, k)] = seconds
    return out


def _compile_seconds(runs: list[dict]) -> str | None:
    """Median seconds per program (cache hits: loads), named as JAX names them."""
    if runs[0]["programs"] is None:
        return None
    keyed = [_keyed(r["programs"]) for r in runs]
    parts = []
    for key in keyed[0]:
        values = [k[key] for k in keyed if key in k]
        name = key[0].removeprefix("jit(").removesuffix(")")
        parts.append(f"{name} {statistics.median(values):.2f}")
    return " ".join(parts) or "none"


def rows(results: dict) -> list[list]:
    tf_runs = results.get("tensorflow")
    out = []
    for case, runs in results.items():
        med = lambda k, rs=runs: statistics.median(r[k] for r in rs)  # noqa: E731
        ratio = first_ratio = None
        if tf_runs and case != "tensorflow":
            ratio = C.median_ratio([r["job_s"] for r in runs], [r["job_s"] for r in tf_runs])
            first_ratio = C.median_ratio(
                [r["first_loop_s"] for r in runs], [r["first_loop_s"] for r in tf_runs]
            )
        loop, _, mode = case.partition(":")
        compiles = None
        if runs[0]["compiles"] is not None:
            compiles = f"{int(med('compiles'))} ({int(med('cache_hits'))} cache hits)"
        out.append(
            [
                loop,
                mode or "—",
                med("first_loop_s"),
                med("job_s"),
                med("wall_s"),
                compiles,
                _compile_seconds(runs),
                med("accuracy"),
                first_ratio,
                ratio,
            ]
        )
    return out


COLUMNS = [
    "framework",
    "compilation cache",
    "first loop s",
    "job s",
    "process s",
    "XLA compiles",
    "compile s per program",
    "accuracy",
    "first loop to TF",
    "ratio to TF",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return ""
    args, repeats = started
    modes = ("cold", "warm") if args.quick else MODES
    results = measure(args.quick, repeats, modes)
    notes = [
        f"MLP {HIDDEN}-{HIDDEN}-10 on digits (1,797 examples), batch {BATCH}, "
        f"iterations_per_loop {IPL}, {steps(args.quick)} steps of Adam, then one evaluation "
        f"of every example; one CPU device (no simulated devices); {repeats} repeats, medians.",
        "'first loop s': from before the estimator is built to the end of the first training "
        f"loop ({IPL} steps: a hook's after_run, on both sides); 'job s': to evaluate's "
        "return; 'process s': the whole process, Python and framework imports included. "
        "'compile s per program': median XLA compile (or cache load) seconds of each program "
        "(init, train loop, eval loop); compiles ahead run on threads, so they overlap. "
        "'... to TF': median over repeats of ours / TF's, same repeat (< 1 is faster).",
        "TensorFlow: "
        + (
            f"2.15 TPUEstimator(use_tpu=False) from {tf_python()}."
            if tf_python()
            else f"not run ({TF_PYTHON_ENV} does not name a TensorFlow 2.15 Python)."
        ),
        f"Python {sys.version.split()[0]}.",
    ]
    return C.report("Against TensorFlow's TPUEstimator", COLUMNS, rows(results), notes)


if __name__ == "__main__":
    main()
