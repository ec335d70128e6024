"""Character-level language-model data from text that ships with Python (nothing downloaded).

Text is encoded as UTF-8 bytes, so the vocabulary is the 256 byte values and ASCII text is
exactly character-level. Sources (``config.text_source``):

* ``"python_reference"`` (default): the Python language reference's help topics that
  ``pydoc`` shows (``pydoc_data.topics``, about 465 KB in CPython 3.11), concatenated in
  sorted topic order. Deterministic for a given Python version; the text differs slightly
  between versions, so results carry the corpus fingerprint (``corpus_info``).
* ``"zen"``: the Zen of Python (the ``this`` module's text, rot13-decoded; 857 bytes),
  identical in every Python 3 version. Too small to learn much; useful for smoke tests.
* any other string: a path to a UTF-8 text file.

The last ``eval_fraction`` of the bytes is held out for evaluation and prediction.

Example:
  >>> fns = char_lm(ml_collections.ConfigDict({"text_source": "zen", "seq_len": 32}))
  >>> features, labels = next(fns["train"]({"batch_size": 4}))   # int32 [4, 32] each
  >>> decode(features[0])
"""

from __future__ import annotations

import ast
import codecs
import hashlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

VOCAB_SIZE = 256


def _python_reference() -> str:
    try:
        from pydoc_data import topics
    except ImportError:
        raise FileNotFoundError(
            "text_source='python_reference' needs the stdlib package pydoc_data, which this "
            "Python installation lacks; use text_source='zen' or a path to a text file"
        ) from None
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _zen() -> str:
    # Parse the source rather than importing `this`, which prints the Zen on import.
    path = importlib.util.find_spec("this").origin
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(node.value.value, "rot13")
    raise ValueError(f"no Zen text found in {path}")


def load_text(source: str = "python_reference") -> bytes:
    """The UTF-8 bytes of a text source (see the module docstring).

    Raises:
      FileNotFoundError: ``source`` is neither a built-in source nor an existing file.
    """
    if source == "python_reference":
        return _python_reference().encode("utf-8")
    if source == "zen":
        return _zen().encode("utf-8")
    if not os.path.isfile(source):
        raise FileNotFoundError(
            f"text_source={source!r}: not 'python_reference', 'zen' or an existing file"
        )
    with open(source, "rb") as f:
        return f.read()


def corpus_info(source: str = "python_reference") -> dict[str, Any]:
    """Size and fingerprint of a source, to state with results measured on it."""
    data = load_text(source)
    return {"source": source, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}


def encode(text: str) -> np.ndarray:
    """Token ids (UTF-8 bytes) of ``text``, int32."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Text of token ids; invalid UTF-8 sequences become U+FFFD."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def split(data: bytes, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) token arrays: the last ``eval_fraction`` of the bytes is eval.

    Raises:
      ValueError: ``eval_fraction`` outside (0, 1).
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    tokens = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    cut = len(tokens) - max(int(round(len(tokens) * eval_fraction)), 1)
    return tokens[:cut], tokens[cut:]


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping ``[n, seq_len + 1]`` windows (inputs + next-token targets).

    Raises:
      ValueError: the text is shorter than one window.
    """
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"seq_len={seq_len} needs more than {len(tokens)} tokens of text")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens[idx]


def random_windows(
    tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless batches of windows at random offsets; batch ``i`` is a function of (seed, i)."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"seq_len={seq_len} needs more than {len(tokens)} training tokens")
    i = 0
    while True:
        starts = np.random.RandomState([seed, i]).randint(0, len(tokens) - seq_len, batch_size)
        w = tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]]
        yield w[:, :-1], w[:, 1:]
        i += 1


def _once(w: np.ndarray, batch_size: int, *, with_labels: bool):
    for i in range(0, len(w), batch_size):
        chunk = w[i : i + batch_size]
        yield (chunk[:, :-1], chunk[:, 1:]) if with_labels else chunk[:, :-1]


def char_lm(config) -> dict[str, Callable]:
    """Train/eval/predict input_fns of next-byte prediction.

    ``config`` fields (all optional): ``text_source``, ``seq_len`` (128), ``eval_fraction``
    (0.1), ``seed`` (0). Features and labels are int32 ``[batch, seq_len]``; labels are the
    features shifted by one. Eval and predict cover the held-out text once, in
    non-overlapping windows.
    """
    get = (lambda k, d: config.get(k, d)) if config is not None else (lambda k, d: d)
    seq_len = int(get("seq_len", 128))
    train, held_out = split(
        load_text(get("text_source", "python_reference")), float(get("eval_fraction", 0.1))
    )
    eval_windows = windows(held_out, seq_len)
    seed = int(get("seed", 0))
    return {
        "train": lambda params: random_windows(train, seq_len, params["batch_size"], seed=seed),
        "eval": lambda params: _once(eval_windows, params["batch_size"], with_labels=True),
        "predict": lambda params: _once(eval_windows, params["batch_size"], with_labels=False),
    }
