"""Job configs: Python files with ``get_config()`` and ``--config.KEY=VALUE`` overrides.

A config is a file path or the name of a packaged config (``configs/<name>.py``). Override
values are Python literals checked against the field's type; a bare word is taken as a string
for a string field (``--config.text_source=zen``). Mistakes raise ``UsageError`` naming the
flag and the closest field. Nothing here imports JAX.

Example:
  >>> config = load_config("digits_mlp")
  >>> apply_overrides(config, {"max_steps": "200", "model_params.hidden": "(64,)"})
  >>> config.model_params.hidden
  (64,)
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
from typing import Any

import ml_collections

from .usage import UsageError, did_you_mean, packaged_configs

DEFAULT_CONFIG = "digits_mlp"
# Trainer features every config takes from the command line (--config.compute_dtype=bfloat16,
# --config.num_microbatches=4), added to a config that does not set them; "" is float32.
TRAINER_DEFAULTS = {"compute_dtype": "", "num_microbatches": 1}


def load_config(path: str | None = None) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file, or of the packaged config of that name.

    Raises:
      UsageError: no such file or packaged config (naming the closest), a file that is not
        Python (``--config /etc/passwd``) or has a syntax error, or no get_config.
    """
    path = path or DEFAULT_CONFIG
    if os.path.isfile(path):
        module = _exec_config_file(path)
    else:
        name = os.path.splitext(os.path.basename(path))[0]
        known = packaged_configs()
        if name not in known:
            raise UsageError(
                f"--config {path}: no such file or packaged config"
                + did_you_mean(name, known)
                + f"; packaged: {', '.join(known)}"
            )
        module = importlib.import_module(f"configs.{name}")
    if not callable(getattr(module, "get_config", None)):
        raise UsageError(f"--config {path}: the file defines no get_config()")
    return _with_trainer_defaults(module.get_config())


def _exec_config_file(path: str) -> Any:
    """The module a config file defines; a file that is not Python source is a usage error.

    The file is read as Python whatever its name (``spec_from_file_location`` gives no
    loader for a name without ``.py``, which used to end in an ``AttributeError``).
    """
    name = "_job_config_" + os.path.splitext(os.path.basename(path))[0].replace(".", "_")
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except OSError as e:
        raise UsageError(f"--config {path}: cannot be read ({e.strerror})") from None
    except Exception as e:
        # A syntax error (or null bytes: a binary file), or any failure of a file not named
        # .py, is not a config; an error inside a .py config keeps its traceback (a bug).
        not_source = isinstance(e, SyntaxError) or "null bytes" in str(e)
        if not not_source and path.endswith(".py"):
            raise
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise UsageError(
            f"--config {path}: not a Python config file{where}: "
            f"{type(e).__name__}: {getattr(e, 'msg', e)}; give a .py file that defines "
            "get_config(), or a packaged config's name"
        ) from None
    return module


def _with_trainer_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    missing = {k: v for k, v in TRAINER_DEFAULTS.items() if k not in config}
    if missing:
        with config.unlocked():
            config.update(missing)
    return config


def flat_fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """``dotted.key -> value`` of every leaf field."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(flat_fields(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe_fields(config: ml_collections.ConfigDict, name: str) -> str:
    """The fields of a config, one a line, as ``--config NAME --help`` shows them."""
    fields = flat_fields(config)
    width = max(map(len, fields), default=0) + 2
    lines = [f"fields of {name} (set one with --config.KEY=VALUE):"]
    lines += [f"  {key:<{width}}{value!r}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def _literal(flag: str, raw: str, current: Any) -> Any:
    """``raw`` as the value a field holding ``current`` expects."""
    if isinstance(current, bool) and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except SyntaxError as e:
        if current is None or isinstance(current, str):
            return raw  # a bare word for a string field: --config.text_source=zen
        raise UsageError(f"{flag}={raw}: syntax error in the value: {e.msg}") from None
    except ValueError:
        if current is None or isinstance(current, str):
            return raw
        raise UsageError(
            f"{flag}={raw}: expected {type(current).__name__} (like {current!r}); "
            f"{raw!r} is not a Python literal"
        ) from None
    if isinstance(current, str) and not isinstance(value, str):
        return raw
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(current, tuple) and isinstance(value, list | int):
        return tuple(value) if isinstance(value, list) else (value,)
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
    """Sets each ``dotted.key -> raw value`` in ``config``.

    Raises:
      UsageError: no such field (naming the closest), a value that is not a Python literal
        (a syntax error), or a value of the wrong type.
    """
    for key, raw in overrides.items():
        flag = f"--config.{key}"
        *parents, leaf = key.split(".")
        node = config
        for depth, part in enumerate(key.split(".")):
            if not isinstance(node, ml_collections.ConfigDict):
                group = ".".join(parents[:depth])
                raise UsageError(
                    f"{flag}: {group} is a field ({type(node).__name__} {node!r}), "
                    "not a group of fields"
                )
            if part not in node:
                where = ".".join(parents[:depth]) or "the config"
                raise UsageError(
                    f"{flag}: {where} has no field {part!r}"
                    + did_you_mean(key, flat_fields(config), prefix="--config.")
                )
            if depth < len(parents):
                node = node[part]
        current = node[leaf]
        if isinstance(current, ml_collections.ConfigDict):
            raise UsageError(f"{flag}: a group of fields; set one: --config.{key}.KEY=VALUE")
        value = _literal(flag, raw, current)
        try:
            node[leaf] = value
        except TypeError:
            raise UsageError(
                f"{flag}={raw}: expected {type(current).__name__} (like {current!r}), "
                f"got {type(value).__name__} {value!r}"
            ) from None
