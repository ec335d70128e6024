"""Imports tensorboardX without PyTorch.

tensorboardX's ``writer`` module runs ``import torch`` at import time, only so that it can
accept torch tensors; with torch installed that costs seconds of start-up (and memory) in a
JAX program that never passes one. Importing this module first imports tensorboardX with
``torch`` hidden, unless the program imported torch itself (then nothing changes). Every
module here that uses tensorboardX imports this one before it.

The window is the import of tensorboardX alone: a ``torch`` entry of ``None`` in
``sys.modules`` makes ``import torch`` raise ImportError, which tensorboardX catches; the
entry is removed right after, so a later ``import torch`` by the user works as usual.
"""

from __future__ import annotations

import sys


def _import_without_torch() -> None:
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX  # noqa: F401
        import tensorboardX.summary  # noqa: F401
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


_import_without_torch()
