"""TF's session protos, so ``session_config=tf.ConfigProto(...)`` ports by namespace only.

There is no TensorFlow session here: ``RunConfig`` accepts ``session_config`` and ignores it
with one warning. These stand-ins take TF's fields as keywords and keep them (for a reader's
eye, ``repr`` and equality), so the lines that build a session config in a ported main change
only their namespace: ``tf.ConfigProto`` -> ``estimator.ConfigProto``, ``tf.GraphOptions`` ->
``estimator.GraphOptions``, ``rewriter_config_pb2.RewriterConfig`` ->
``estimator.rewriter_config_pb2.RewriterConfig``. No field has an effect.

Example:
  >>> import estimator
  >>> from estimator import rewriter_config_pb2
  >>> config = estimator.ConfigProto(
  ...     graph_options=estimator.GraphOptions(
  ...         rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True)))
  >>> config.graph_options.rewrite_options.disable_meta_optimizer
  True
"""

from __future__ import annotations

import types
from typing import Any


class _Proto:
    """A TF proto message's stand-in: its fields as attributes, nothing more."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in sorted(self.__dict__.items()))
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # mutable, like a proto message


class ConfigProto(_Proto):
    """``tf.ConfigProto``: accepted for ``RunConfig(session_config=...)``, without effect."""


class GraphOptions(_Proto):
    """``tf.GraphOptions``, a ``ConfigProto`` field, without effect."""


class RewriterConfig(_Proto):
    """``rewriter_config_pb2.RewriterConfig`` (Grappler's options), without effect."""


#: ``from tensorflow.core.protobuf import rewriter_config_pb2`` ->
#: ``from estimator import rewriter_config_pb2``.
rewriter_config_pb2 = types.SimpleNamespace(RewriterConfig=RewriterConfig)

__all__ = ["ConfigProto", "GraphOptions", "RewriterConfig", "rewriter_config_pb2"]
