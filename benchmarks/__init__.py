"""Throughput benchmarks: the estimator side by side with hand-written JAX loops.

Each benchmark is a module run from the repository root, for example::

    python -m benchmarks.train_throughput            # ~3 minutes, prints a markdown table
    python -m benchmarks.train_throughput --quick    # seconds: a smoke run with tiny sizes

Modules: ``train_throughput``, ``host_call_overhead``, ``eval_throughput``, ``startup``,
``input_overlap``, ``feature_costs`` (each trainer feature against the same feature written
by hand, ``_hand_written``), and the others docs/performance.md lists. They are not part
of the test suite (``tests/benchmarks_smoke_test.py`` only checks that each one runs and
prints its rows). See the README (Performance) for the latest numbers and how to read them.

Importing this package sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (unless
``XLA_FLAGS`` is already set) so that, on a CPU-only machine, every benchmark compares eight
simulated devices with eight-device hand-written baselines. It must therefore be imported
before JAX initialises its backends, which ``python -m benchmarks.<name>`` guarantees.
"""

import os

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
