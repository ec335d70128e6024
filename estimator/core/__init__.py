"""The vocabulary every layer uses: errors, configuration, the spec and its contexts, the
compilation cache, the runtime, ``estimator.summary`` and the ``Saver``.

Nothing here imports another folder of the package except ``storage`` (paths and bucket
URLs, which ``summary``'s event files go through).
"""
