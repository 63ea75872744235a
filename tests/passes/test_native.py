"""The native backend (packed E2M1 operands + FP4 GEMM; here the C++ reference GEMM) against the emulate backend."""

import jax
import jax.numpy as jnp
import pytest

import xla_fp4
from xla_fp4 import kernels


def _f(x, w):
  return jnp.tanh(x @ w)


def _loss(w, x):
  return jnp.sum(_f(x, w) ** 2)


def _run(dtype=jnp.float32, **options):
  x = jax.random.normal(jax.random.key(0), (2, 16, 64), dtype)  # the wgrad contracts over two dims
  w = jax.random.normal(jax.random.key(1), (64, 48), dtype)
  xla_fp4.enable(strict=True, keep_head=False, **options)  # one layer: it is the head
  try:
    return jax.jit(_f)(x, w), jax.jit(jax.grad(_loss))(w, x)
  finally:
    xla_fp4.disable()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_equals_emulate_bit_for_bit_with_nearest_rounding(dtype):
  """The FP4 GEMM writes the dot's own output type (alpha applied to the f32 accumulator first, one rounding)."""
  emulated = _run(dtype, backend="emulate", stochastic_rounding=False)
  native = _run(dtype, backend="native", stochastic_rounding=False)
  for e, n in zip(emulated, native):
    assert e.dtype == n.dtype == dtype and jnp.array_equal(e, n)


def test_native_with_stochastic_rounding_stays_close():
  # Random bits follow element positions, and the native path transposes operands to K-major: different draws.
  (_, ge), (_, gn) = _run(backend="emulate"), _run(backend="native")
  assert float(jnp.linalg.norm(ge - gn) / jnp.linalg.norm(ge)) < 0.3


def test_auto_is_emulate_without_an_fp4_gemm():
  supported, reason = kernels.fp4_gemm_supported()
  if supported:
    pytest.skip(f"this machine has an FP4 GEMM: {reason}")
  assert "CUDA" in reason or "compute capability" in reason or "not built" in reason
  auto, emulated = _run(stochastic_rounding=False), _run(backend="emulate", stochastic_rounding=False)
  assert all(jnp.array_equal(a, e) for a, e in zip(auto, emulated))
