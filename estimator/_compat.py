"""Workarounds for other libraries' process-wide side effects, in one place."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def root_logging_untouched() -> Iterator[None]:
    """Undoes handlers other libraries put on the root logger inside the block.

    absl calls ``logging.basicConfig()`` on its first log call when the root logger has no
    handler, and Orbax logs through absl while it is imported. Left alone, that makes an
    application's own later ``logging.basicConfig(filename=...)`` a silent no-op.
    """
    before = list(logging.root.handlers)
    try:
        yield
    finally:
        for handler in list(logging.root.handlers):
            if handler not in before:
                logging.root.removeHandler(handler)
