"""A checkpoint's JSON meta: its checksum, the legacy format, and a bound on its nesting.

The meta (``global_step``, ``input_pulls``, ``skipped_pulls``, ``input_state`` ...) is written
with a ``checksum``: SHA-256 of the canonical JSON of its other entries. ``moving_average``
says whether the ``train`` item holds an ``ExponentialMovingAverage`` shadow, so evaluate and
predict open the ``train`` item only when it does (a meta written before the flag existed
has no entry: the item is looked into, ``io/restore.py``). A meta is damaged (the step is
skipped for an older one and moved aside) when:

* its checksum does not match (a valid-JSON edit);
* it has no checksum but is not in the legacy format. Checkpoints written before checksums
  existed hold only the legacy entries (``global_step``, ``input_pulls`` and, optionally,
  ``input_state``/``input_states``); every version that writes a checksum also writes
  ``skipped_pulls``, so a meta with any other entry and no checksum had its checksum removed;
* it is nested more than ``MAX_META_DEPTH`` levels (an input's state is a few levels deep; a
  crafted or corrupted file 100,000 levels deep would otherwise crash the JSON parser with a
  ``RecursionError``).

Example:
  >>> meta = with_checksum({"global_step": 6, "input_pulls": 6, "skipped_pulls": 0})
  >>> checked_meta(meta, path="/runs/a/model.ckpt-6")["input_pulls"]
  6
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .. import storage
from ..core.errors import CheckpointError

MAX_META_DEPTH = 64
LEGACY_KEYS = frozenset({"global_step", "input_pulls", "input_state", "input_states"})


def with_checksum(meta: dict) -> dict:
    """``meta`` with a ``checksum`` of its other entries (SHA-256 of their canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return {**body, "checksum": _digest(body)}


def _digest(body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def depth(value: Any) -> int:
    """How deep lists and dicts nest in a JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)
    return deepest


def load_json(path: str, name: str, checkpoint: str) -> Any:
    """Parses a checkpoint's JSON file; a file nested too deeply to parse is damage.

    Raises:
      CheckpointError: the file is nested beyond what the parser can read.
      OSError, ValueError: unreadable or not JSON (the caller names the file).
    """
    text = storage.read_text(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise CheckpointError(
            f"checkpoint {checkpoint}: {name} is nested too deeply to parse (more than "
            f"{MAX_META_DEPTH} levels is damage)"
        ) from None


def checked_meta(meta: dict, *, path: str) -> dict:
    """``meta`` without its checksum, once checked (see the module docstring).

    Raises:
      CheckpointError: the meta is damaged.
    """
    levels = depth(meta)
    if levels > MAX_META_DEPTH:
        raise CheckpointError(
            f"checkpoint {path}: meta is nested {levels} levels deep (more than "
            f"{MAX_META_DEPTH} levels is damage, not an input's state)"
        )
    if "checksum" not in meta:
        extra = sorted(set(meta) - LEGACY_KEYS)
        if extra:
            raise CheckpointError(
                f"checkpoint {path}: meta has no checksum, but entries the format from before "
                f"checksums never had ({', '.join(extra)}): its checksum was removed"
            )
    elif with_checksum(meta)["checksum"] != meta["checksum"]:
        raise CheckpointError(
            f"checkpoint {path}: meta does not match its checksum (it was changed after "
            "it was written)"
        )
    return {k: v for k, v in meta.items() if k != "checksum"}
