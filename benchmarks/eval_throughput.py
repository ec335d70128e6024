"""Evaluation throughput: TPUEstimator.evaluate against a hand-written eval loop.

Run from the repository root::

    python -m benchmarks.eval_throughput [--quick] [--repeats N] [--no-memory]

Both evaluate the same trained parameters on the same numpy eval set over eight devices and
report the same accuracy (checked to be equal):

* ``hand-written``: ``jit(shard_map(scan(eval_step)))`` over the eval set pre-staged on the
  devices as ``[IPL, GB, ...]`` chunks; each step ``psum``-s the correct count and loss sum,
  so only two numbers per step come back to the host. Its params are placed with
  ``_workloads.replicate`` (on CPU one buffer every device shares: its fastest placement,
  the same on every run).
* ``hand-written, streamed``: the same loop fed from numpy, one ``device_put`` per chunk.
* ``estimator``: ``est.evaluate(input_fn)`` with ``eval_metrics=(metric_fn, [labels,
  logits])``: logits come back to the host and ``metrics.accuracy`` runs there, as in TF.

It also times the first ``evaluate`` after training (which compiles the eval loop) and a
second one, counting XLA compilations (the second must compile nothing), and each
evaluate's start: from the call to its hooks' ``after_create_session``, the moment the
variables are in place and the first loop is dispatched next (target: at most 0.1 s).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hooks
from benchmarks import _common as C
from benchmarks import _workloads as W


class Setting(NamedTuple):
    model: str
    unroll: bool | None  # TPUConfig.unroll_loops
    ipl: int
    batches: int  # eval batches (a multiple of ipl)

    @property
    def label(self) -> str:
        return f"{self.model} (unroll_loops={self.unroll})" if self.model == "cnn" else self.model


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("mlp", False, 2, 4)]
    # The CNN as configs/digits_cnn.py runs it (None: its training loop unrolled on CPU, its
    # eval loop rolled), and with every loop unrolled.
    return [
        Setting("mlp", False, 100, 400),
        Setting("cnn", None, 10, 100),
        Setting("cnn", True, 10, 100),
    ]


def global_batch(quick: bool) -> int:
    return 32 if quick else 256


def _params_from(est) -> Any:
    """The estimator's trained params (public API), nested as the module's own tree."""
    tree: dict = {}
    for name in est.get_variable_names():
        parts = name.split("/")
        if len(parts) < 3:  # global_step and other non-parameter entries
            continue
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = est.get_variable_value(name)
    (root,) = tree.values()  # the module model_fn built, e.g. MLP_0
    return root


class Prepared(NamedTuple):
    est: Any
    input_fn: Callable
    params: Any
    first: dict  # first evaluate: seconds, compiles, results


def prepare(s: Setting, data: W.Dataset, model_dir: str) -> Prepared:
    """Trains briefly, then runs and times the first evaluate (which compiles)."""
    est = W.make_estimator(
        s.model,
        model_dir,
        global_batch=data.global_batch,
        iterations_per_loop=s.ipl,
        unroll=s.unroll,
    )
    est.train(W.input_fn_for(data, cycle=True), steps=s.ipl)
    input_fn = W.input_fn_for(data, cycle=False)
    first = estimator_case(est, input_fn)()
    return Prepared(est, input_fn, _params_from(est), first)


def counted(fn: Callable[[], dict]) -> dict:
    """``fn()``'s dict plus its wall ``seconds`` and the XLA ``compiles`` it caused."""
    with C.CompileCounter().active() as counter:
        start = C.now()
        out = fn()
        seconds = C.now() - start
    return {**out, "seconds": seconds, "compiles": counter.compiled}


def hand_written_case(
    s: Setting, data: W.Dataset, params: Any, *, streamed: bool
) -> Callable[[], dict]:
    mesh = W.make_mesh()
    loop = W.eval_loop(s.model, mesh)
    params = W.replicate(params, mesh)  # one shared copy on CPU, every run
    staged = None if streamed else W.stage_chunks(data, s.ipl, mesh)
    sharding = NamedSharding(mesh, P(None, W.DATA))

    def chunk(c: int):
        if staged is not None:
            return staged[c]
        part = slice(c * s.ipl, (c + 1) * s.ipl)
        return jax.device_put((data.x[part], data.y[part]), sharding)

    def evaluate() -> dict:
        correct = 0
        for c in range(data.batches // s.ipl):
            right, _ = jax.device_get(loop(params, *chunk(c)))  # blocks every loop
            correct += int(right.sum())
        return {"accuracy": correct / (data.batches * data.global_batch)}

    jax.block_until_ready(loop(params, *chunk(0)))  # compile
    return lambda: counted(evaluate)


class StartStamp(hooks.SessionRunHook):
    """Stamps the moment evaluate's session is created: its variables restored and placed,
    its hooks begun, the first loop dispatched next."""

    def __init__(self):
        self.at: float | None = None

    def after_create_session(self, session, coord) -> None:
        self.at = C.now()


def estimator_case(est, input_fn: Callable) -> Callable[[], dict]:
    def evaluate() -> dict:
        stamp = StartStamp()
        entered = C.now()
        accuracy = est.evaluate(input_fn, hooks=[stamp])["accuracy"]
        return {"accuracy": accuracy, "start_s": stamp.at - entered}

    return lambda: counted(evaluate)


def cases(s: Setting, data: W.Dataset, prep: Prepared) -> dict[str, Callable[[], dict]]:
    return {
        "hand-written": hand_written_case(s, data, prep.params, streamed=False),
        "hand-written, streamed": hand_written_case(s, data, prep.params, streamed=True),
        "estimator": estimator_case(prep.est, prep.input_fn),
    }


def dataset_for(s: Setting, quick: bool) -> W.Dataset:
    return W.make_dataset(s.model, batches=s.batches, global_batch=global_batch(quick), seed=1)


# ----------------------------------------------------------------------------- memory
CASES = ("hand-written", "hand-written, streamed", "estimator")


def probe(key: str, quick: bool) -> None:
    """Peak memory of one evaluate in a fresh process: the estimator restores the checkpoint
    in ``<model_dir>`` (``key`` is ``index:case:model_dir``); the hand-written loop evaluates
    freshly initialised params of the same shapes."""
    index, name, model_dir = key.split(":", 2)
    s = settings(quick)[int(index)]
    data = dataset_for(s, quick)
    mem = C.MemoryProbe()
    mem.start()
    if name == "estimator":
        est = W.make_estimator(
            s.model,
            model_dir,
            global_batch=data.global_batch,
            iterations_per_loop=s.ipl,
            unroll=s.unroll,
        )
        est.evaluate(W.input_fn_for(data, cycle=False))
    else:
        params = W.init_state(s.model, W.make_mesh(), data.x[0])[0]
        hand_written_case(s, data, params, streamed=name.endswith("streamed"))()
    C.print_probe_result(mem.result())


# ----------------------------------------------------------------------------- main
def rows(s: Setting, examples: int, times: dict, mem: dict, index: int) -> list[list]:
    out = []
    ref = [t["seconds"] for t in times["hand-written"]]
    ref_mem = mem.get(f"{index}:hand-written")
    for name, runs in times.items():
        seconds = [t["seconds"] for t in runs]
        accuracies = {round(t["accuracy"], 6) for t in runs}
        m = mem.get(f"{index}:{name}")
        out.append(
            [
                s.label,
                s.ipl,
                name,
                examples / statistics.median(seconds),
                C.median_ratio(ref, seconds),
                max(t["compiles"] for t in runs),
                ", ".join(f"{a:.4f}" for a in sorted(accuracies)),
                m,
                None if m is None or not ref_mem else m / ref_mem,
            ]
        )
    return out


COLUMNS = [
    "model",
    "IPL",
    "loop",
    "examples/s",
    "ratio to hand-written",
    "compiles per call",
    "accuracy",
    "peak MiB",
    "memory / hand-written",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe)
    if started is None:
        return ""
    args, repeats = started
    out, notes = [], []
    tmp = tempfile.mkdtemp(prefix="bench_eval_")
    try:
        for i, s in enumerate(settings(args.quick)):
            data = dataset_for(s, args.quick)
            model_dir = tempfile.mkdtemp(dir=tmp)
            prep = prepare(s, data, model_dir)
            times = C.interleave(cases(s, data, prep), repeats=repeats)
            second = times["estimator"][0]
            starts = [t["start_s"] * 1e3 for t in times["estimator"]]
            notes.append(
                f"{s.label}: first evaluate after train {prep.first['seconds']:.2f} s with "
                f"{prep.first['compiles']} XLA compilations; second evaluate "
                f"{second['seconds']:.2f} s with {second['compiles']} compilations. Start "
                f"(evaluate's entry to its first loop): first {prep.first['start_s'] * 1e3:.0f} "
                f"ms, timed calls median {statistics.median(starts):.0f} ms "
                f"({min(starts):.0f}-{max(starts):.0f})."
            )
            keys = [f"{i}:{name}:{model_dir}" for name in CASES]
            mem = C.probe_all(
                __spec__.name, keys, quick=args.quick, skip=args.no_memory or args.quick
            )
            mem = {f"{i}:{k.split(':')[1]}": v for k, v in mem.items()}
            out += rows(s, data.batches * data.global_batch, times, mem, i)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes += [
        f"Global batch {global_batch(args.quick)}, {repeats} interleaved repeats; medians of "
        "per-repeat ratios. 'compiles per call': XLA compilations during a timed call (max "
        "over repeats).",
        "Peak MiB: growth of peak host RSS over the baseline, one evaluate per fresh process "
        "(the estimator restoring its checkpoint, compiling and evaluating).",
    ]
    return C.report("Evaluation throughput", COLUMNS, out, notes)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
