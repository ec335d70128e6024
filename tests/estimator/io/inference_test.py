"""rewrite_for_inference and validate_inference_rewrite_for_variables."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimator.io.inference import (
    InferenceProgram,
    rewrite_for_inference,
    validate_inference_rewrite_for_variables,
)
from estimator.strategy.device_assignment import DeviceAssignment


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(jnp.tanh(nn.Dense(16, name="hidden")(x)))


def _setup(batch=5):
    model = _MLP()
    x = np.random.RandomState(0).randn(batch, 6).astype(np.float32)
    variables = model.init(jax.random.key(1), x)
    return model, variables, x


def _numpy_reference(variables, x):
    p = jax.tree.map(np.asarray, variables["params"])
    h = np.tanh(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def _entry_parameter_shapes(compiled_text: str) -> list[str]:
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled_text).group(1)
    return re.findall(r"[a-z0-9]+\[[\d,]*\]", layout)


def test_compiled_program_has_no_variable_inputs():
    model, variables, x = _setup()
    program = rewrite_for_inference(model.apply, variables=variables, name="serving")
    assert isinstance(program, InferenceProgram) and program.num_variables == 4
    lowered = program.lower(x)
    assert lowered.as_text().startswith("module @jit_serving")
    # XLA's own record of the entry computation: one parameter, the input.
    assert _entry_parameter_shapes(lowered.compile().as_text()) == ["f32[5,6]"]
    # The variables are in the program as constants of their shapes.
    text = lowered.as_text()
    for shape in ("6x16xf32", "16x4xf32", "16xf32", "4xf32"):
        assert re.search(rf"stablehlo.constant dense<.*> : tensor<{shape}>", text), shape
    np.testing.assert_allclose(program(x), _numpy_reference(variables, x), rtol=1e-5, atol=1e-6)
    validate_inference_rewrite_for_variables(program, inputs=[x])


def test_inputs_given_runs_it_and_variables_are_read_once():
    model, variables, x = _setup()
    expected = _numpy_reference(variables, x)
    out = rewrite_for_inference(model.apply, [x], variables=variables)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    program = rewrite_for_inference(model.apply, variables=variables)
    variables["params"]["out"]["kernel"] = jnp.zeros((16, 4))  # later changes are not seen
    np.testing.assert_allclose(program(x), expected, rtol=1e-5, atol=1e-6)
    # A new batch size compiles again, still with the same folded values.
    np.testing.assert_allclose(program(x[:2]), expected[:2], rtol=1e-5, atol=1e-6)


def test_closure_variables_are_folded_too():
    model, variables, x = _setup()
    device_vars = jax.device_put(variables)
    program = rewrite_for_inference(lambda v: model.apply(device_vars, v))
    lowered = program.lower(jax.ShapeDtypeStruct(x.shape, x.dtype))
    assert program.num_variables == 4
    assert _entry_parameter_shapes(lowered.compile().as_text()) == ["f32[5,6]"]
    validate_inference_rewrite_for_variables(program, inputs=[x])


def test_validation_fails_on_a_program_that_was_not_rewritten():
    model, variables, x = _setup()
    lowered = jax.jit(model.apply).lower(variables, x)
    with pytest.raises(RuntimeError, match=r"takes 4 argument\(s\) beyond its 1 input"):
        validate_inference_rewrite_for_variables(lowered, inputs=[x])
    with pytest.raises(RuntimeError, match="did not fold in the variables"):
        validate_inference_rewrite_for_variables(lowered.compile(), inputs=[x])
    with pytest.raises(ValueError, match="needs inputs"):
        validate_inference_rewrite_for_variables(lowered)


def test_validation_of_exported_programs():
    model, variables, x = _setup()
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 6"), jnp.float32)
    program = rewrite_for_inference(model.apply, variables=variables)
    folded = jax.export.export(program.jitted)(spec)
    validate_inference_rewrite_for_variables(folded, inputs=[spec])
    beside = jax.export.export(jax.jit(model.apply))(variables, spec)
    with pytest.raises(RuntimeError, match="beyond its 1 input"):
        validate_inference_rewrite_for_variables(beside, inputs=[spec])


def test_device_assignment_places_the_program():
    model, variables, x = _setup()
    da = DeviceAssignment.build(topology=jax.devices()[3:5], computation_shape=1)
    out = rewrite_for_inference(model.apply, [x], device_assignment=da, variables=variables)
    assert out.devices() == {jax.devices()[3]}
    out = rewrite_for_inference(
        model.apply, [x], device_assignment=jax.devices()[2], variables=variables
    )
    assert out.devices() == {jax.devices()[2]}
    with pytest.raises(TypeError, match="device_assignment"):
        rewrite_for_inference(model.apply, device_assignment="tpu:0", variables=variables)
