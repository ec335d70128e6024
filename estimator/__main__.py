"""``python -m estimator``: the ``tpu-estimator`` command."""

import os
import sys

# `python -m` puts the current directory first on sys.path, where a project's own `models/`
# or `configs/` package would hide the ones installed beside `estimator` (the console script
# has no such entry). Look beside `estimator` first.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.abspath(sys.path[0] or os.curdir) != _ROOT:
    sys.path.insert(0, _ROOT)

from estimator.cli import main  # noqa: E402  (after the sys.path fix above)

sys.exit(main())
