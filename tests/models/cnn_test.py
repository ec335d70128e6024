"""The small CNN: shapes, parameter count by hand, input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cnn


def test_output_shape_and_parameter_count_by_hand():
    module = cnn.CNN(features=(32, 64), dense=128, num_classes=10)
    variables = jax.eval_shape(
        lambda: module.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)), train=False)
    )
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"]))
    conv0, conv1 = 3 * 3 * 1 * 32 + 32, 3 * 3 * 32 * 64 + 64
    dense = (2 * 2 * 64) * 128 + 128  # 8x8 pooled twice -> 2x2x64
    assert count == conv0 + conv1 + dense + 128 * 10 + 10
    out = jax.eval_shape(lambda v: module.apply(v, jnp.zeros((2, 8, 8, 1)), train=False), variables)
    assert out.shape == (2, 10)


def test_flat_features_are_an_error_naming_the_shape():
    module = cnn.CNN()
    with pytest.raises(ValueError, match=r"\(2, 64\)"):
        module.init(jax.random.key(0), jnp.zeros((2, 64)), train=False)
