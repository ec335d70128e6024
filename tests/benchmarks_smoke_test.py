"""Smoke test: every benchmark runs end to end with ``--quick`` and prints its table rows.

Not a timing assertion: the numbers of a quick run on a shared CI machine mean nothing. It
checks that each ``python -m benchmarks.<name>`` entry point still works against the current
estimator (the hand-written baselines, the estimator runs, the table) and that the rows the
docs describe are there.
"""

from __future__ import annotations

import importlib
import re

import jax
import pytest

# (module, rows expected as (first cells...) of the table)
EXPECTED = {
    "train_throughput": [
        ("mlp", "—", "per-step jit"),
        ("mlp", "2", "ceiling"),
        ("mlp", "2", "estimator"),
    ],
    "host_call_overhead": [
        ("mlp", "2", "ceiling"),
        ("mlp", "2", "estimator, no host_call"),
        ("mlp", "2", "estimator, host_call every step"),
    ],
    "eval_throughput": [
        ("mlp", "2", "hand-written"),
        ("mlp", "2", "hand-written, streamed"),
        ("mlp", "2", "estimator"),
    ],
    "input_overlap": [("mlp", "2", "1x")],
    "startup": [("estimator", "cold"), ("estimator", "warm")],
    "sharded_state": [("replicated",), ("shard_optimizer_state",), ("shard_params",)],
    "vs_tensorflow": [("estimator", "cold"), ("estimator", "warm")],
    "memory_vs_ipl": [("1", "default", "1"), ("4", "1", "4")],
    "predict_tail": [("1",), ("8",)],
    "accelerator": [
        ("ResNet-50 train", "hand-written jit(scan)"),
        ("ResNet-50 train", "estimator"),
        ("Transformer LM train", "hand-written jit(scan)"),
        ("Transformer LM train", "estimator"),
        ("Transformer LM train", "estimator, host_call every step"),
        ("Transformer LM eval", "hand-written jit(scan)"),
        ("Transformer LM eval", "estimator"),
        ("Transformer LM memory", "replicated"),
        ("Transformer LM memory", "shard_optimizer_state"),
        ("Transformer LM memory", "shard_params"),
    ],
    "trainer_features": [
        ("plain",),
        ("compute_dtype=bfloat16",),
        ("bf16 by hand (dtype=)",),
        ("num_microbatches=4",),
        ("plain, batch x8",),
        ("num_microbatches=4, batch x8",),
        ("plain, batch x16",),
        ("num_microbatches=4, batch x16",),
        ("64", "2"),  # micro-batches against hand-written accumulation
        ("512", "16"),
        ("1024", "32"),
        ("1",),
        ("4",),
    ],
    "ema_overhead": [
        ("mlp", "2", "estimator, adam"),
        ("mlp", "2", "estimator, adam + ExponentialMovingAverage"),
    ],
    "reporting_overhead": [("mlp", "2", "reporting off"), ("mlp", "2", "reporting on")],
    "feature_costs": [
        ("plain",),
        ("bf16 compute",),
        ("4 micro-batches",),
        ("moving average",),
        ("host_call every step",),
        ("ZeRO-1",),
        ("FSDP",),
    ],
    "auto_loop": [("mlp", "1"), ("mlp", "2"), ("mlp", "auto")],
}


def _rows(text: str) -> list[list[str]]:
    """Every table row of ``text``, the headers (the line above each ``|---`` line) left out."""
    lines = text.splitlines()
    rows = [
        ln
        for i, ln in enumerate(lines)
        if ln.startswith("| ") and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))
    ]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


def _matches(row: list[str], expected: tuple[str, ...]) -> bool:
    """The row starts with the expected cells (a cell may add details after a space)."""
    return all(c == e or c.startswith(e + " ") for c, e in zip(row, expected, strict=False))


@pytest.fixture
def fast_compiles():
    """Compiles with most XLA optimizations off (as the repo's end-to-end tests do)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_benchmark_runs_quick_and_prints_its_rows(name, capsys, fast_compiles, monkeypatch):
    monkeypatch.delenv("TPU_ESTIMATOR_TF_PYTHON", raising=False)  # no TensorFlow row
    expected = EXPECTED[name]
    # one benchmark per test: a failure names it, and test workers share them out
    module = importlib.import_module(f"benchmarks.{name}")
    text = module.main(["--quick"])
    assert text in capsys.readouterr().out, name
    rows = _rows(text)
    assert len(rows) == len(expected), (name, rows)
    for row, want in zip(rows, expected, strict=True):
        assert _matches(row, want), (name, row, want)
        numbers = [
            float(c.replace(",", ""))
            for c in row[len(want) :]
            if re.fullmatch(r"[\d,]+(\.\d+)?(e[-+]\d+)?", c)
        ]
        # the first number is a throughput or a time; none is negative
        assert numbers and numbers[0] > 0 and min(numbers) >= 0, (name, row)
    assert "Machine:" in text, name
    if name == "eval_throughput":
        # every loop reports the hand-written loop's accuracy; a repeated evaluate
        # compiles nothing
        assert len({r[_column(text, "accuracy")] for r in rows}) == 1, rows
        compiles = _column(text, "compiles per call")
        assert [r[compiles] for r in rows if r[2] == "estimator"] == ["0"], rows
    if name in ("startup", "vs_tensorflow"):  # a warm start loads every program
        compiles = _column(text, "XLA compiles")
        assert rows[1][compiles].startswith("0 ("), rows
    if name == "train_throughput":  # a warm estimator's train call compiles nothing
        compiles = _column(text, "compiles/call")
        assert [r[compiles] for r in rows if r[2] == "estimator"] == ["0"], rows


def _column(text: str, title: str) -> int:
    header = next(ln for ln in text.splitlines() if ln.startswith("| "))
    return [c.strip() for c in header.strip("|").split("|")].index(title)
