"""Public TPUEstimator programs ported to this package, changing only what TF-specific math needs.

Each changed line carries a ``# changed:`` comment saying why; every other estimator-facing
line is as the TF program wrote it. See docs/porting.md.
"""
