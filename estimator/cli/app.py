"""The ``tpu-estimator`` command (also ``python -m estimator``).

  tpu-estimator [COMMAND] [--config FILE|NAME] [--model_dir DIR] [--config.KEY=VALUE ...]

``tpu-estimator --help`` lists the commands, options and packaged configs;
``tpu-estimator --config NAME --help`` the fields of a config. The arguments are read and
checked before JAX is imported (``usage`` and ``configs`` import neither JAX nor the
estimator), so help answers at once and a typo costs no start-up; ``run`` imports the
estimator only once they are good, and once ``checks.check_job`` found nothing it can see
without JAX (config fields, paths, a ``--model_dir`` with no checkpoint for evaluate, predict
and export). The result is one JSON line on stdout; log lines go to
stderr. A user's mistake (a flag, a config field, a --model_dir without a checkpoint) exits
with status 2 and one line, another deliberate error of the framework with status 1 and its
message; ``--verbose`` adds the traceback.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterable
from typing import IO, Any

import numpy as np

from .. import storage
from ..core.errors import CheckpointMismatchError, EstimatorError, NoCheckpointError
from . import checks, configs, usage
from .usage import PROG, Invocation, UsageError

log = logging.getLogger("estimator")


def main(argv: list[str] | None = None, *, out: IO[str] | None = None) -> int:
    """Runs a command line and returns its exit status.

    Args:
      argv: the arguments without the program name. None: this process's own
        (``sys.argv[1:]``), run as the program (the console script, ``python -m estimator``),
        which then keeps stdout for the result: whatever else is written there (a library's
        print, or C++ code such as Gloo's ``Rank ... connected`` lines) goes to stderr with
        the log lines, so ``tpu-estimator > result.json`` holds exactly the result.
      out: where the help, the result line and ``--output -`` predictions go (default stdout).
    """
    if argv is None:
        argv = sys.argv[1:]
        out = out or _take_stdout()
    out = out or sys.stdout
    verbose = "--verbose" in argv
    try:
        inv = usage.parse(argv)
        if inv.help:
            out.write(_help(inv))
            return 0
        if inv.num_processes > 1:
            return _launch(inv, argv, out)
        configure_logging()
        result = run(inv, out=out)
    except UsageError as e:
        return _fail(e, verbose)
    except (NoCheckpointError, CheckpointMismatchError) as e:  # a --model_dir that does not fit
        return _fail(e, verbose, hint="--verbose shows the traceback")
    except EstimatorError as e:  # raised on purpose: its message says what went wrong
        return _fail(e, verbose, hint="--verbose shows the traceback", status=1)
    except KeyboardInterrupt as e:  # Ctrl-C: train saved a checkpoint and says so in one line
        if verbose:
            traceback.print_exception(e)
        sys.stderr.write(f"{PROG}: {str(e).strip() or 'interrupted'}\n")
        return 128 + signal.SIGINT
    if result is not None:
        out.write(json.dumps(_json_ready(result), sort_keys=True, default=str) + "\n")
        out.flush()
    return 0


def _help(inv: Invocation) -> str:
    """The command's help; with ``--config``, also that config's fields (overrides applied)."""
    text = usage.help_text(inv)
    if inv.config is not None:
        config = configs.load_config(inv.config)
        configs.apply_overrides(config, inv.overrides)
        text += "\n" + configs.describe_fields(config, inv.config)
    return text


def _take_stdout() -> IO[str]:
    """A stream to the process's stdout; file descriptor 1 itself then goes to stderr."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return results


def configure_logging() -> None:
    """The application's logging: the estimator's INFO lines and every warning on stderr.

    Leaves a root logger that already has handlers alone (the caller configured logging).
    """
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        root.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _fail(error: BaseException, verbose: bool, *, hint: str | None = None, status: int = 2) -> int:
    if verbose:
        traceback.print_exception(error)
    lines = str(error).strip().splitlines() or [type(error).__name__]
    if len(lines) > 10:
        lines = lines[:10] + [f"... ({len(lines) - 10} more lines; --verbose shows them)"]
    sys.stderr.write(f"{PROG}: error: " + "\n".join(lines) + "\n")
    if hint and not verbose:
        sys.stderr.write(f"({hint})\n")
    return status


def _model_dir(inv: Invocation) -> str:
    if inv.model_dir is None:
        if inv.command in checks.READS_A_MODEL:
            raise UsageError(
                f"{inv.command} reads a trained model: give --model_dir DIR "
                f"(train one with: {PROG} train --model_dir DIR)"
            )
        return tempfile.mkdtemp(prefix="tpu_estimator_")
    if storage.is_url(inv.model_dir):
        return storage.absolute(inv.model_dir)
    if os.path.exists(inv.model_dir) and not os.path.isdir(inv.model_dir):
        raise UsageError(f"--model_dir {inv.model_dir} is a file, not a directory")
    return inv.model_dir


def run(inv: Invocation, *, out: IO[str] | None = None) -> dict[str, Any] | None:
    """Runs one command; returns the result to print (None on processes other than 0).

    Every result names the ``global_step`` of the model it trained or read and the
    ``model_dir`` (a new temporary directory when none was given).
    """
    config = configs.load_config(inv.config)
    configs.apply_overrides(config, inv.overrides)
    # What needs no JAX is checked first, so a user's mistake answers in well under a second
    # (and before a temporary model_dir is made).
    checks.check_job(
        inv.command,
        config,
        model_dir=inv.model_dir,
        output=inv.output,
        export_dir=inv.export_dir,
    )
    model_dir = _model_dir(inv)
    # The estimator (and JAX) only now that the arguments are good; see the module docstring.
    import jax

    from ..train_and_evaluate import EvalSpec, TrainSpec, train_and_evaluate
    from . import jobs

    est, input_fns = jobs.build(config, model_dir)
    if inv.model_dir is None:
        log.info("No --model_dir given: using %s", model_dir)
    eval_steps = config.get("eval_steps", 0) or None
    result: dict[str, Any] | None = {}
    if inv.command == "train":
        est.train(input_fns["train"], max_steps=config.max_steps)
    elif inv.command == "evaluate":
        result = est.evaluate(input_fns["eval"], steps=eval_steps)
    elif inv.command == "predict":
        output = inv.output or storage.join(model_dir, "predictions.jsonl")
        predictions = est.predict(input_fns["predict"], gather_to_process_0=jax.process_count() > 1)
        if jax.process_index() == 0:  # it gets every example; the other processes run along
            count = write_predictions(predictions, output, out=out or sys.stdout)
            log.info("Wrote %d predictions to %s", count, "stdout" if output == "-" else output)
            result = None if output == "-" else {"num_predictions": count, "output": output}
        else:
            collections.deque(predictions, maxlen=0)
    elif inv.command == "export":
        export_dir = inv.export_dir or storage.join(model_dir, "export")
        result = {"export_dir": jobs.export_from_config(est, config, export_dir)}
    else:
        result, _ = train_and_evaluate(
            est,
            TrainSpec(input_fns["train"], max_steps=config.max_steps),
            EvalSpec(
                input_fns["eval"],
                steps=eval_steps,
                throttle_secs=config.get("throttle_secs", 0),
                start_delay_secs=0,
            ),
        )
    # Every process lists the checkpoints (with many processes Orbax does that together).
    step = None if inv.command in ("evaluate", "train_and_evaluate") else jobs.global_step(est)
    if result is None or jax.process_index() != 0:
        return None
    return {"global_step": step, **result, "model_dir": model_dir}


def write_predictions(predictions: Iterable, path: str, *, out: IO[str]) -> int:
    """Writes predictions: ``*.npz`` holds one array per key (examples stacked on axis 0),
    any other name one JSON object per line (``-``: ``out``). Returns how many were written.
    """
    if path.endswith(".npz"):
        columns: dict[str, list] = {}
        for p in predictions:
            for key, value in (p if isinstance(p, dict) else {"output": p}).items():
                columns.setdefault(key, []).append(np.asarray(value))
        buffer = io.BytesIO()
        np.savez(buffer, **{k: np.stack(v) for k, v in columns.items()})
        storage.write_bytes(path, buffer.getvalue())
        return len(next(iter(columns.values()), []))
    count = 0
    with contextlib.nullcontext(out) if path == "-" else storage.open_file(path, "w") as f:
        for p in predictions:
            row = (
                {k: np.asarray(v).tolist() for k, v in p.items()}
                if isinstance(p, dict)
                else (np.asarray(p).tolist())
            )
            f.write(json.dumps(row) + "\n")
            count += 1
    return count


def _launch(inv: Invocation, argv: list[str], out: IO[str]) -> int:
    from ..cluster.launch import launch_local, strip_num_processes  # imports JAX: see above

    configure_logging()
    # The children print only their result (process 0's) on stdout: pass it on to `out`.
    with contextlib.redirect_stdout(out):
        return launch_local(inv.num_processes, strip_num_processes(argv))


def _json_ready(result: dict) -> dict:
    return {
        k: (v.tolist() if isinstance(v, np.ndarray | np.generic) else v) for k, v in result.items()
    }
