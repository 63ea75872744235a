"""Helpers shared by the tests (tests/ is on pytest's pythonpath)."""

import numpy as np
import pytest


def bits(a):
  """The raw bits of a float array (for bit-for-bit comparisons that also cover -0 and NaN payloads)."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(actual, expected, nan_payloads=False):
  """Bit-for-bit equality; NaNs only need to match as NaNs unless `nan_payloads` (payloads follow the hardware)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, actual.dtype, expected.shape,
                                                                           expected.dtype)
  both_nan = np.isnan(actual.astype(np.float32)) & np.isnan(expected.astype(np.float32))
  if nan_payloads:
    both_nan[...] = False
  differ = (bits(actual) != bits(expected)) & ~both_nan
  if differ.any():
    i = np.argwhere(differ)[:5]
    raise AssertionError(f"{differ.sum()} of {differ.size} elements differ, e.g. at {i.tolist()}: "
                         f"{actual[tuple(i.T)]} vs {expected[tuple(i.T)]}")


def extension_or_skip():
  """The compiled extension, or skip the test with the reason it is not available."""
  from xla_fp4 import kernels
  ok, reason = kernels.available()
  if not ok:
    pytest.skip(reason)
  return kernels.extension()


def _jit_reference():
  """The reference entry points under jit: eager dispatch compiles every primitive separately and is ~10x slower."""
  import jax
  from xla_fp4 import numerics as nv
  static = ("axis", "block_2d", "rounding")
  return (jax.jit(nv.quantize, static_argnames=static), jax.jit(nv.qdq, static_argnames=static),
          jax.jit(nv.dequantize, static_argnames=("dtype",)))


quantize, qdq, dequantize = _jit_reference()


def digest_np(x):
  """numerics.tensor_digest in numpy: the wrapping uint32 sum of the element bits (16-bit floats zero-extended)."""
  a = np.asarray(x)
  return int(a.view(np.uint32 if a.itemsize == 4 else np.uint16).astype(np.uint64).sum()) & 0xFFFFFFFF


def kernel_calls_row_major(module):
  """The `xla_fp4_*` custom calls in an MLIR module, after asserting that each fixes row-major layouts for its
  operands and results (left free, XLA may store a result transposed: docs/design.md §5)."""
  from jax._src.lib.mlir import ir
  calls = []

  def visit(op):
    target = op.attributes["call_target_name"] if op.name == "stablehlo.custom_call" else None
    if target is not None and ir.StringAttr(target).value.startswith("xla_fp4"):
      calls.append(op)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  for op in calls:
    for attr, values in (("operand_layouts", op.operands), ("result_layouts", op.results)):
      assert attr in op.attributes, f"{op} has no {attr}"
      layouts = [list(ir.DenseIntElementsAttr(a)) for a in ir.ArrayAttr(op.attributes[attr])]
      assert layouts == [list(range(ir.RankedTensorType(v.type).rank - 1, -1, -1)) for v in values], op
  return calls


def run_on_cpu(module, args):
  """Compile a StableHLO module (ir.Module; one lowered for CUDA and rewritten by the pass, say) for this machine's
  CPU, as JAX does, and run it on `args`: its results."""
  import jax
  from jax._src import compiler, xla_bridge
  from jax._src.lib import xla_client as xc
  backend = xla_bridge.get_backend("cpu")
  device = backend.devices()[0]
  executable = compiler.backend_compile_and_load(backend, module, xc.DeviceList((device,)),
                                                 compiler.get_compile_options(num_replicas=1, num_partitions=1), [])
  return executable.execute([jax.device_put(a, device) for a in args])


# ---- the subnormal rule's cases (tests/kernels/test_fp_mode_rule.py; on a GPU, test_cuda_kernels.py) ----

TINY = np.finfo(np.float32).tiny  # 2^-126, the smallest normal float32


def _blocks(rng, scale, n=8):
  """n 1x16 blocks of normal values of magnitude about `scale`, float32."""
  return (rng.standard_normal((n, 16)) * scale).astype(np.float32)


def subnormal_cases():
  """float32 tensors at the subnormal rule's edges (nvfp4_format.h FlushSubnormal), by name."""
  rng = np.random.default_rng(0)
  normal = _blocks(rng, 1.0)
  with_subnormal_inputs = normal.copy()
  with_subnormal_inputs[1] = TINY * rng.uniform(0.01, 0.99, 16).astype(np.float32)  # a block of subnormals
  with_subnormal_inputs[2, ::3] = TINY / 8  # subnormals beside normal values
  window = _blocks(rng, 1e-33)  # s_dec normal, but small blocks' scale * s_dec subnormal
  window[3] *= 1e-3
  window[4, :8] = TINY * 3
  return {
      "tiny tensor": _blocks(rng, 1e-36),  # s_dec = amax / 2688 is subnormal: NaN on a GPU before the rule
      "subnormal inputs": with_subnormal_inputs,
      "small blocks": window,
      "all subnormal": (TINY * rng.uniform(-0.9, 0.9, (4, 16))).astype(np.float32),
  }


def mx_subnormal_cases():
  """float32 (6, 32) blocks at the MX formats' subnormal edges: E8M0 scales 2^-127 and 2^-126, subnormal inputs."""
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((6, 32)) * 2.0**-125).astype(np.float32)  # amax about 2^-124: scales 2^-127 and 2^-126
  x[0] = np.abs(x[0]).clip(TINY, 1.4 * 2.0**-125)  # amax in [2^-126, 1.5 * 2^-125]: E2M1 scale 2^-127
  x[1, ::2] = TINY / 4
  x[2] = rng.standard_normal(32).astype(np.float32)
  x[2, 5] = TINY / 2
  return x
