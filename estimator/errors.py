"""``estimator.errors``: the estimator's exceptions, under TF's ``tf.errors`` namespace
(``errors.NotFoundError``) as well (``core/errors.py``, the same module object)."""

import sys

from .core import errors as _errors

sys.modules[__name__] = _errors
