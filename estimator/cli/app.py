"""The ``tpu-estimator`` command (also ``python -m estimator``).

Usage:
  tpu-estimator [train|evaluate|predict|train_and_evaluate|export]
                [--config configs/<job>.py] [--model_dir DIR] [--config.key=value ...]

With no subcommand it runs ``train_and_evaluate``; with no ``--config`` the default job
(``configs/digits_mlp.py``: an MLP on the bundled digits data).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile

import numpy as np

COMMANDS = ("train", "evaluate", "predict", "train_and_evaluate", "export")
log = logging.getLogger("estimator")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        prog="tpu-estimator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", nargs="?", default="train_and_evaluate", choices=COMMANDS)
    parser.add_argument("--config", default=None, help="a config file with get_config()")
    parser.add_argument("--model_dir", default=None, help="checkpoints and summaries")
    parser.add_argument("--export_dir", default=None, help="export: where to write")
    parser.add_argument(
        "--num_processes",
        type=int,
        default=1,
        help="start this many local processes (multi-host simulation)",
    )
    overrides: dict[str, str] = {}
    rest = []
    for arg in argv:
        if arg.startswith("--config."):
            key, sep, value = arg[len("--config.") :].partition("=")
            if not sep:
                parser.error(f"{arg}: expected --config.key=value")
            overrides[key] = value
        else:
            rest.append(arg)
    return parser.parse_args(rest), overrides


def _json_ready(results: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in results.items()}


def run(args: argparse.Namespace, overrides: dict[str, str]) -> dict:
    from ..train_and_evaluate import EvalSpec, TrainSpec, train_and_evaluate
    from . import jobs

    config = jobs.load_config(args.config)
    jobs.apply_overrides(config, overrides)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="tpu_estimator_")
    est, input_fns = jobs.build(config, model_dir)
    eval_steps = config.get("eval_steps", 0) or None
    if args.command == "train":
        est.train(input_fns["train"], max_steps=config.max_steps)
        return {"global_step": config.max_steps, "model_dir": model_dir}
    if args.command == "evaluate":
        return est.evaluate(input_fns["eval"], steps=eval_steps)
    if args.command == "predict":
        preds = list(est.predict(input_fns["predict"]))
        return {"num_predictions": len(preds), "model_dir": model_dir}
    if args.command == "export":
        path = jobs.export_from_config(est, config, args.export_dir or model_dir + "/export")
        return {"export_dir": path}
    results, _ = train_and_evaluate(
        est,
        TrainSpec(input_fns["train"], max_steps=config.max_steps),
        EvalSpec(
            input_fns["eval"],
            steps=eval_steps,
            throttle_secs=config.get("throttle_secs", 0),
            start_delay_secs=0,
        ),
    )
    return results


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.num_processes > 1:
        from ..cluster.launch import launch_local, strip_num_processes

        return launch_local(
            args.num_processes, strip_num_processes(sys.argv[1:] if argv is None else argv)
        )
    setup_logging()
    results = run(args, overrides)
    print(json.dumps(_json_ready(results), sort_keys=True, default=str))
    return 0


def setup_logging() -> None:
    """The command's progress lines on stderr, as TF printed its INFO logs.

    The library itself configures no logging (it logs to ``logging.getLogger("estimator")``,
    which propagates); the command is the application, so it configures the root handler.
    """
    logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger("estimator").setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
