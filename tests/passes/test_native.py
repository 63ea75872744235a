"""The native backend (packed E2M1 operands + FP4 GEMM; here the C++ reference GEMM) against the emulate backend."""

import jax
import jax.numpy as jnp
import numpy as np
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_equals_emulate_bit_for_bit_with_stochastic_rounding(dtype):
  """Random bits follow element positions in the operand as quantized: the packed quantizer reads every operand here
  in place (the weight and the wgrad's operands along their first axis, xla_fp4_quantize_packed axis=0), as the
  emulated forms do, so both draw the same bits. (When it read K-major copies, the two drew different bits: 0.3
  relative apart.)"""
  emulated, native = _run(dtype, backend="emulate"), _run(dtype, backend="native")
  for e, n in zip(emulated, native):
    assert e.dtype == n.dtype == dtype and jnp.array_equal(e, n)


def _walk(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield inner.operation
        yield from _walk(inner.operation)


def test_the_packed_quantizer_reads_every_operand_in_place():
  """An MLP's train step: each operand of the FP4 GEMMs (activations, weights, output gradients, the wgrad's operands
  with two contracting dims) is quantized as the program holds it (a reshape at most), never from a transposed copy;
  the weights and the wgrads' operands along their first axis (axis = 0), whose uint8 codes are then transposed. A
  dgrad reads its forward's packed weight (16x16 tiles) along the other axis instead of packing the weight again."""
  from xla_fp4 import config
  from xla_fp4.kernels import registry
  from xla_fp4.passes import pipeline

  registry.register("cpu")

  def loss(ws, x):
    w1, w2 = ws
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

  x = jax.random.normal(jax.random.key(0), (2, 16, 64))
  ws = (jax.random.normal(jax.random.key(1), (64, 96)), jax.random.normal(jax.random.key(2), (96, 32)))
  module = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(ws, x).compiler_ir("stablehlo")
  cfg = config.load(environ={}, enabled=True, backend="native", keep_head=False, keep_first=0, keep_last=0)
  result = pipeline.transform(module, cfg)
  with result.module.context:
    named = lambda target: [op for op in _walk(result.module.operation) if op.name == "stablehlo.custom_call"  # noqa
                            and str(op.attributes["call_target_name"]) == f'"{target}"']
    calls, pairs = named("xla_fp4_quantize_packed"), named("xla_fp4_quantize_packed_pair")
    # 2 fprops, 2 dgrads, 2 wgrads: two operands each, the dgrads' weights shared; x, h and both output gradients
    # read along both axes, each by one pair quantizer (rewrite/pairs.py)
    assert (len(calls), len(pairs)) == (2, 4), (len(calls), len(pairs))
    assert all(getattr(c.operands[0].owner, "name", "an argument") != "stablehlo.transpose" for c in calls + pairs)
    axes = [str(c.attributes["mhlo.backend_config"]) for c in calls]
    gemms = [str(op.attributes["mhlo.backend_config"]) for op in _walk(result.module.operation)
             if op.name == "stablehlo.custom_call"
             and str(op.attributes["call_target_name"]) == '"xla_fp4_gemm_packed"']
  assert sum("b_transposed = true" in g for g in gemms) == 2, gemms  # the dgrads
  assert sum("axis = 0" in a for a in axes) == 2, axes  # the fprops' weights


def test_a_weight_read_as_the_forward_lhs_is_packed_once_too():
  """Equinox's `w @ x` (vmapped): the forward reads the weight as the GEMM's lhs, the dgrad as its rhs along the other
  axis; the dgrad takes the forward's packed copy as Bᵀ, and the gradients equal the emulate backend's."""
  from xla_fp4 import config
  from xla_fp4.kernels import registry
  from xla_fp4.passes import pipeline

  registry.register("cpu")

  def loss(ws, x):
    w1, w2 = ws  # (out, in), as Equinox holds them
    h = jnp.tanh(jax.vmap(lambda v: w1 @ v)(x))
    return jnp.sum(jnp.tanh(jax.vmap(lambda v: w2 @ v)(h)) ** 2)

  x = jax.random.normal(jax.random.key(0), (64, 64))
  ws = (jax.random.normal(jax.random.key(1), (96, 64)) / 8, jax.random.normal(jax.random.key(2), (32, 96)) / 10)
  step = jax.jit(jax.grad(loss))
  module = step.lower(ws, x).compiler_ir("stablehlo")
  options = dict(keep_head=False, keep_first=0, keep_last=0, stochastic_rounding=False)
  result = pipeline.transform(module, config.load(environ={}, enabled=True, backend="native", **options))
  with result.module.context:
    calls = [op for op in _walk(result.module.operation) if op.name == "stablehlo.custom_call"]
    targets_ = [str(op.attributes["call_target_name"]) for op in calls]
    gemms = [str(op.attributes["mhlo.backend_config"]) for op, t in zip(calls, targets_)
             if t == '"xla_fp4_gemm_packed"']
  assert len(gemms) == 5, gemms  # w1's dgrad (into x) is not needed
  assert sum("b_transposed = true" in g for g in gemms) == 1, gemms  # w2's dgrad
  # 5 GEMMs x 2 operands, w2 packed once: w1, w2 and the first layer's output gradient (its wgrad's) alone, x, h and
  # the second layer's output gradient each by one pair quantizer (its fprop's or dgrad's and its wgrad's copies)
  assert (targets_.count('"xla_fp4_quantize_packed"'), targets_.count('"xla_fp4_quantize_packed_pair"')) == (3, 3)
  got = {}
  for backend in ("emulate", "native"):
    xla_fp4.enable(backend=backend, **options)
    got[backend] = step(ws, x)
  xla_fp4.disable()
  for n, e in zip(got["native"], got["emulate"]):
    assert jnp.allclose(n, e, rtol=1e-5, atol=1e-7), float(jnp.max(jnp.abs(n - e)))


def test_a_value_read_along_both_axes_is_packed_in_one_read():
  """A two-layer MLP's step under the native backend: the activation that a fprop and its wgrad read, and the output
  gradient that a dgrad and its wgrad read, are each packed by one xla_fp4_quantize_packed_pair (both copies from one
  read of the value: rewrite/pairs.py), the weights once each (16x16 tiles); the step equals the emulate backend's bit
  for bit in both roundings, as the pair's copies are the single quantizers'."""
  def loss(ws, x):
    w1, w2 = ws
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

  x = jax.random.normal(jax.random.key(0), (2, 16, 64), jnp.bfloat16)
  ws = (jax.random.normal(jax.random.key(1), (64, 96), jnp.bfloat16) / 8,
        jax.random.normal(jax.random.key(2), (96, 32), jnp.bfloat16) / 10)
  for stochastic in (False, True):
    results = {}
    for backend in ("emulate", "native"):
      xla_fp4.enable(strict=True, keep_head=False, keep_first=0, keep_last=0, backend=backend,
                     stochastic_rounding=stochastic)
      try:
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        results[backend] = step(ws, x)
        hlo = step.lower(ws, x).compile().as_text()
      finally:
        xla_fp4.disable()
    # x, h (fprop 1 / wgrad 1, fprop 2 / wgrad 2) and both output gradients (dgrad / wgrad)
    assert hlo.count('custom_call_target="xla_fp4_quantize_packed_pair"') == 4, hlo
    assert hlo.count('custom_call_target="xla_fp4_quantize_packed"') == 2, hlo  # w1, w2
    for e, n in zip(jax.tree.leaves(results["emulate"]), jax.tree.leaves(results["native"])):
      assert jnp.array_equal(e, n), (stochastic, float(jnp.max(jnp.abs(e - n))))


def test_auto_is_emulate_without_an_fp4_gemm():
  supported, reason = kernels.fp4_gemm_supported()
  if supported:
    pytest.skip(f"this machine has an FP4 GEMM: {reason}")
  assert "CUDA" in reason or "compute capability" in reason or "not built" in reason
  auto, emulated = _run(stochastic_rounding=False), _run(backend="emulate", stochastic_rounding=False)
  assert all(jnp.array_equal(a, e) for a, e in zip(auto, emulated))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4+4/6"])
def test_every_format_runs_packed_and_equals_its_emulation(fmt):
  """XLA_FP4_FORMAT=mxfp4/mxfp8, and NVFP4 with Four Over Six, under the native backend: every GEMM is the packed GEMM
  of the format (no emulated quantizer left), and forward and gradient equal the emulate backend's in both roundings:
  the packed quantizer's codes decode to the emulated quantizer's values and both GEMMs multiply exact q·scale, so
  MXFP4 and NVFP4 (whose sums of E2M1 products stay exact in float32 here) are bit for bit, MXFP8 within float32
  summation order."""
  x = jax.random.normal(jax.random.key(0), (2, 16, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (64, 96), jnp.float32)
  options = dict(four_over_six=True) if fmt == "nvfp4+4/6" else dict(format=fmt)
  gemm, quantizer = (("xla_fp4_gemm_packed", "xla_fp4_qdq") if fmt == "nvfp4+4/6" else
                     ("xla_fp4_mx_gemm_packed", "xla_fp4_mx_qdq"))
  for stochastic in (False, True):
    results = {}
    for backend in ("emulate", "native"):
      xla_fp4.enable(strict=True, keep_head=False, backend=backend, stochastic_rounding=stochastic, **options)
      try:
        step = jax.jit(jax.grad(_loss))
        results[backend] = (jax.jit(_f)(x, w), step(w, x))
        hlo = step.lower(w, x).compile().as_text()
      finally:
        xla_fp4.disable()
      if backend == "native":
        assert hlo.count(f'custom_call_target="{gemm}"') == 2  # the dgrad and the wgrad
        assert f'"{quantizer}' not in hlo
    for e, n in zip(results["emulate"], results["native"]):
      if fmt != "mxfp8":
        assert jnp.array_equal(e, n), (stochastic, float(jnp.max(jnp.abs(e - n))))
      else:
        np.testing.assert_allclose(n, e, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(e))))
