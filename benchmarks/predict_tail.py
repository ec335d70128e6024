"""A short prediction at a long iterations_per_loop: only the input's steps run.

Run from the repository root::

    python -m benchmarks.predict_tail [--quick] [--repeats N]

Predicts 10 examples (one batch, padded to the global batch of 256) with the benchmark MLP at
``iterations_per_loop`` 1, 10 and 200, from the same checkpoint. Each estimator predicts once
(compiling its program), then the warm predictions run interleaved. Before the loop could be
cut short, every prediction ran a whole loop of IPL steps, all but one on padding (the issue
measured 0.06 s / 0.46 s / 2.10 s at IPL 1 / 50 / 200); now each runs one 1-step call.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile

import numpy as np

import estimator
from benchmarks import _common as C
from benchmarks import _workloads as W

EXAMPLES = 10


def model_fn(features, labels, mode, params):
    """The benchmark's model_fn, with a PREDICT branch returning the logits."""
    if mode == estimator.ModeKeys.PREDICT:
        logits = W.MODELS[params["model"]]()(features)
        return estimator.TPUEstimatorSpec(mode, predictions={"logits": logits})
    return W.model_fn(features, labels, mode, params)


def make_estimator(model_dir: str, batch: int, ipl: int) -> estimator.TPUEstimator:
    est = W.make_estimator("mlp", model_dir, global_batch=batch, iterations_per_loop=ipl)
    return estimator.TPUEstimator(
        model_fn,
        config=est.config,
        params=est.params,
        train_batch_size=batch,
        predict_batch_size=batch,
    )


def ipls(quick: bool) -> tuple[int, ...]:
    return (1, 8) if quick else (1, 10, 200)


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, lambda *a: None)
    if started is None:
        return ""
    args, repeats = started
    batch = 32 if args.quick else 256
    data = W.make_dataset("mlp", batches=2, global_batch=batch, seed=2)
    tmp = tempfile.mkdtemp(prefix="bench_predict_")
    try:
        trainer = make_estimator(tmp, batch, 1)
        trainer.train(W.input_fn_for(data, cycle=True), steps=1)
        x = data.x[0][:EXAMPLES]

        def input_fn(params):
            yield x

        first, cases = {}, {}
        for ipl in ipls(args.quick):
            est = make_estimator(tmp, batch, ipl)

            def run(est=est):
                out = list(est.predict(input_fn))
                assert len(out) == EXAMPLES, len(out)
                return out

            with C.CompileCounter().active() as counter:
                first[ipl] = (C.timed(run), counter.compiled)
            cases[ipl] = lambda run=run: C.timed(run)
        times = C.interleave(cases, repeats=repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref = times[ipls(args.quick)[0]]
    rows = [
        [
            ipl,
            first[ipl][0],
            first[ipl][1],
            statistics.median(times[ipl]),
            C.median_ratio(times[ipl], ref),
        ]
        for ipl in ipls(args.quick)
    ]
    return C.report(
        f"Predicting {EXAMPLES} examples",
        ["IPL", "first predict s", "compiles", "warm predict s", "time / IPL 1"],
        rows,
        [
            f"MLP 64-512-512-10, global batch {batch}, one input batch of {EXAMPLES} rows; "
            f"{repeats} interleaved repeats of the warm predict, medians (of per-repeat "
            "ratios).",
        ],
    )


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
