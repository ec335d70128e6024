"""Imports one ported example at a time, with its absl flags.

The ported programs define their flags on absl's global ``FLAGS`` at import, as TF's
mains do; two of them in one process define the same names (``tpu``, ``model_dir``, ...)
and the second import raises ``DuplicateFlagError``. ``example(name)`` removes the flags
the previously loaded example defined, then imports (or re-imports) the one asked for;
asking for the example already loaded returns it as it is.
"""

from __future__ import annotations

import importlib
import sys
import types

from absl import flags

_DEFINED: dict[str, set[str]] = {}  # example -> the flag names its import defined


def example(name: str) -> types.ModuleType:
    module_name = f"examples.{name}"
    if name in _DEFINED:  # the loaded one: its flags are in place
        return sys.modules[module_name]
    for names in _DEFINED.values():
        for flag in names:
            if flag in flags.FLAGS:
                delattr(flags.FLAGS, flag)
    _DEFINED.clear()
    if module_name in sys.modules:
        module = importlib.reload(sys.modules[module_name])
    else:
        module = importlib.import_module(module_name)
    own = flags.FLAGS.flags_by_module_dict().get(module_name, [])  # not absl's own
    _DEFINED[name] = {flag.name for flag in own}
    return module
