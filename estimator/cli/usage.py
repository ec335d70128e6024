"""The command line's words: commands, flags, help texts and user errors (no JAX here).

Everything in this module runs before JAX is imported, so ``--help`` answers at once and a
typo costs no start-up: ``parse`` reads the arguments, ``help_text`` writes the help.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib.util
import os
import textwrap

from ..core.errors import EstimatorError

PROG = "tpu-estimator"
DEFAULT_COMMAND = "train_and_evaluate"
COMMANDS = {
    "train_and_evaluate": (
        "Train to max_steps, evaluating the checkpoints as they are written and once at the "
        "end; print the last evaluation (the default command)."
    ),
    "train": (
        "Train to the config's max_steps, resuming from the latest checkpoint in --model_dir; "
        "print the step reached."
    ),
    "evaluate": "Evaluate the latest checkpoint of --model_dir on the job's eval input.",
    "predict": (
        "Predict the job's predict input with the latest checkpoint of --model_dir and write "
        "the predictions to --output."
    ),
    "export": (
        "Export the latest checkpoint of --model_dir as a serving artifact that "
        "estimator.load_saved_model loads without the model code (docs/export.md)."
    ),
}


@dataclasses.dataclass(frozen=True)
class Option:
    """One flag: its value's name (None for a switch), help, and the commands that take it."""

    flag: str
    metavar: str | None  # None: a switch
    help: str
    commands: tuple[str, ...] = tuple(COMMANDS)


OPTIONS = (
    Option(
        "--config",
        "FILE|NAME",
        "a config file with get_config(), or the name of a packaged config (default: digits_mlp)",
    ),
    Option(
        "--model_dir",
        "DIR",
        "checkpoints, summaries and exports (default: a new temporary directory)",
    ),
    Option(
        "--output",
        "FILE",
        "where the predictions go: FILE.npz (one array per key) or JSON lines (any other "
        "name; '-' for stdout); default <model_dir>/predictions.jsonl",
        ("predict",),
    ),
    Option("--export_dir", "DIR", "where to export (default <model_dir>/export)", ("export",)),
    Option(
        "--num_processes",
        "N",
        "run as N local processes of one job, as N hosts of a pod would (CPU devices)",
    ),
    Option("--verbose", None, "show the traceback of an error"),
    Option("--help", None, "this help; with --config, also the config's fields"),
)
_BY_FLAG = {o.flag: o for o in OPTIONS} | {"-h": OPTIONS[-1]}
_OVERRIDE = "--config."
_WIDTH = 96


class UsageError(EstimatorError, ValueError):
    """A mistake on the command line or in a config: reported in one line, exit status 2."""


def did_you_mean(word: str, choices, *, prefix: str = "") -> str:
    """`` (did you mean X?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


@dataclasses.dataclass
class Invocation:
    """What the command line asks for."""

    command: str = DEFAULT_COMMAND
    command_given: bool = False
    config: str | None = None
    model_dir: str | None = None
    output: str | None = None
    export_dir: str | None = None
    num_processes: int = 1
    verbose: bool = False
    help: bool = False
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)


def parse(argv: list[str]) -> Invocation:
    """Reads ``argv`` (without the program name).

    Raises:
      UsageError: an unknown command or flag (with the closest known one), a flag of another
        command, a missing value, or a malformed ``--config.KEY=VALUE``.
    """
    inv, positional, rest = Invocation(), [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg.startswith(_OVERRIDE):
            key, sep, value = arg[len(_OVERRIDE) :].partition("=")
            if not sep or not key:
                raise UsageError(f"{arg}: expected {_OVERRIDE}KEY=VALUE, e.g. --config.max_steps=1")
            inv.overrides[key] = value
        elif arg.startswith("-") and arg != "-":
            _read_option(inv, arg, rest)
        else:
            positional.append(arg)
    _read_command(inv, positional)
    _check_options(inv)
    return inv


def _read_option(inv: Invocation, arg: str, rest: list[str]) -> None:
    """Sets the option ``arg`` on ``inv``, taking its value from ``rest`` when not ``=``-joined."""
    flag, sep, value = arg.partition("=")
    option = _BY_FLAG.get(flag)
    if option is None:
        raise UsageError(f"unknown option {flag}" + did_you_mean(flag, _BY_FLAG))
    if option.metavar is None:
        if sep:
            raise UsageError(f"{flag} takes no value")
        setattr(inv, option.flag[2:], True)
        return
    if not sep:
        if not rest or rest[0].startswith("--"):
            raise UsageError(f"{flag} needs a value: {flag} {option.metavar}")
        value = rest.pop(0)
    setattr(inv, option.flag[2:], value)


def _read_command(inv: Invocation, positional: list[str]) -> None:
    if not positional:
        return
    if positional[0] not in COMMANDS:
        raise UsageError(
            f"unknown command {positional[0]!r}"
            + did_you_mean(positional[0], COMMANDS)
            + f"; commands: {', '.join(COMMANDS)}"
        )
    if len(positional) > 1:
        raise UsageError(f"unexpected argument {positional[1]!r} after the command")
    inv.command, inv.command_given = positional[0], True


def _check_options(inv: Invocation) -> None:
    """Options of another command, and the number of processes."""
    for option in OPTIONS:
        if inv.command not in option.commands and getattr(inv, option.flag[2:]) is not None:
            raise UsageError(
                f"{option.flag} is an option of {' and '.join(option.commands)}, "
                f"not of {inv.command}"
            )
    try:
        inv.num_processes = int(inv.num_processes)
    except ValueError:
        raise UsageError(
            f"--num_processes {inv.num_processes!r}: expected a whole number"
        ) from None
    if inv.num_processes < 1:
        raise UsageError(f"--num_processes {inv.num_processes}: expected at least 1")


def packaged_configs() -> dict[str, str]:
    """``name -> first docstring line`` of each packaged config, read without importing it."""
    spec = importlib.util.find_spec("configs")
    if spec is None or not spec.submodule_search_locations:
        return {}
    out = {}
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and not name.startswith("_"):
                with open(os.path.join(folder, name)) as f:
                    doc = ast.get_docstring(ast.parse(f.read())) or ""
                out[name[:-3]] = doc.strip().split("\n")[0]
    return out


def _parser(command: str | None) -> argparse.ArgumentParser:
    shown = command or DEFAULT_COMMAND
    parser = argparse.ArgumentParser(
        prog=f"{PROG} {command}" if command else PROG,
        usage=(
            f"{PROG} {command or '[COMMAND]'} [--config NAME] [--model_dir DIR] "
            "[--config.KEY=VALUE ...] [options]"
        ),
        description=textwrap.fill(COMMANDS[command], _WIDTH) if command else _OVERVIEW,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=_WIDTH),
        add_help=False,
    )
    group = parser.add_argument_group("options")
    for option in OPTIONS:
        if command is None or shown in option.commands:
            flags = ("-h", "--help") if option.flag == "--help" else (option.flag,)
            extra = {"metavar": option.metavar} if option.metavar else {"action": "store_true"}
            help_ = option.help
            if command is None and len(option.commands) < len(COMMANDS):
                help_ = f"{'/'.join(option.commands)}: {help_}"
            group.add_argument(*flags, help=help_, **extra)
    group.add_argument(
        "--config.KEY=VALUE",
        action="store_true",
        help="set a config field; VALUE is a Python literal checked against the field's type "
        "(--config NAME --help lists the fields)",
    )
    return parser


_OVERVIEW = """\
TensorFlow's TPUEstimator on JAX: train, evaluate, predict with or export the job a config
file describes. With no command, train_and_evaluate; with no --config, the default job
(digits_mlp: an MLP on scikit-learn's digits). Results are printed as one JSON line on
stdout, log lines go to stderr."""


EXAMPLES = {
    "train_and_evaluate": "--config digits_cnn --model_dir /tmp/cnn",
    "train": "train --config digits_cnn --model_dir /tmp/cnn --config.max_steps=200",
    "evaluate": "evaluate --config digits_cnn --model_dir /tmp/cnn",
    "predict": "predict --config digits_cnn --model_dir /tmp/cnn --output /tmp/cnn/p.npz",
    "export": "export --config digits_cnn --model_dir /tmp/cnn --export_dir /tmp/serving",
}


def _table(title: str, rows: dict[str, str]) -> list[str]:
    width = max(map(len, rows)) + 2
    lines = [title]
    for name, text in rows.items():
        wrapped = textwrap.wrap(text, _WIDTH - width - 2) or [""]
        lines.append(f"  {name:<{width}}{wrapped[0]}")
        lines += [" " * (width + 2) + more for more in wrapped[1:]]
    return lines + [""]


def _epilog(command: str | None) -> str:
    lines = []
    if command is None:
        lines += _table("commands:", COMMANDS)
        lines += [f"{PROG} COMMAND --help describes one command.", ""]
    configs = packaged_configs()
    if configs:
        lines += _table(
            "packaged configs (--config NAME; --config NAME --help lists its fields):", configs
        )
    lines += ["examples:"]
    shown = [command] if command else ["train_and_evaluate", "train", "predict"]
    lines += [f"  {PROG} {EXAMPLES[c]}" for c in shown]
    if command is None:
        lines += [f"  {PROG} --config transformer_lm --help    # the fields to override"]
    return "\n".join(lines)


def help_text(inv: Invocation) -> str:
    """The help for ``inv.command`` (the overview when no command was given)."""
    command = inv.command if inv.command_given else None
    return _parser(command).format_help() + "\n" + _epilog(command) + "\n"
