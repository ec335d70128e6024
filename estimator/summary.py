"""``estimator.summary``: TF2's ``tf.summary`` for ``host_call`` (``core/summary.py``).

``import estimator.summary`` and ``from estimator.summary import scalar`` give the module in
``core/``, the same object ``estimator.summary`` is: its writers are one state.
"""

import sys

from .core import summary as _summary

sys.modules[__name__] = _summary
