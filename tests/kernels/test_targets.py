"""One record per FFI target (python/xla_fp4/kernels/targets.py): the results a call returns, its twin, how shards
run it. Every user of a target (the kernels' Python calls, the pass's kernel sets, the partitioner) reads these."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from xla_fp4 import kernels, state
from xla_fp4.kernels import targets
from xla_fp4.numerics import telemetry
from xla_fp4.sharding import packed, partition, register

X = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
SCALAR_F32, SCALAR_U32 = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.uint32)
SCALAR_I32 = jax.ShapeDtypeStruct((), jnp.int32)
QUANTIZE = dict(block_2d=False, stochastic=True, rht=True, rht_seed=3)
FOS = dict(four_over_six=True)  # NVFP4's quantizers' refinement (the twins take it as the kernels do)


def _twin_results(target, operands, attrs):
  """jax.eval_shape of the twin, called as the pass's ReferenceKernels call it."""
  as_operands, params = target.twin_arguments(attrs)
  out = jax.eval_shape(lambda *a: target.twin(*a, **params), *operands, *[SCALAR_U32 for _ in as_operands])
  return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_twins_return_what_the_records_say(axis):
  cases = [(targets.QDQ, [X, SCALAR_F32, SCALAR_U32], dict(axis=axis, **QUANTIZE, apply_global_scale=False, **FOS)),
           (targets.QDQ_WITH_SCALE, [X], dict(axis=axis, **QUANTIZE, salt=5, **FOS)),
           (targets.BLOCK_AMAX, [X], dict(axis=axis, rht=False, rht_seed=0, digest=False)),
           (targets.BLOCK_AMAX, [X], dict(axis=axis, rht=True, rht_seed=0, digest=True)),
           (targets.QDQ_WITH_SCALE_STATS, [X, SCALAR_I32], dict(axis=axis, **QUANTIZE, salt=5, **FOS)),
           (targets.QDQ_AND_STATS, [X, SCALAR_F32, SCALAR_U32, SCALAR_I32], dict(axis=axis, **QUANTIZE, **FOS)),
           (targets.OUTPUT_STATS, [X, SCALAR_I32], {}),
           (targets.MX_QDQ, [X, SCALAR_U32], dict(axis=axis, **QUANTIZE, fp8=True))]
  assert {t for t, _, _ in cases} == {t for t in targets.ALL if t.twin is not None}
  for target, operands, attrs in cases:
    assert _twin_results(target, operands, attrs) == target.results(operands, attrs, None), target.name


def test_kernels_return_what_the_records_say():
  """The compiled kernels, through their Python calls (which shape their results from the records): x of 32x64."""
  x = jnp.ones((32, 64), jnp.float32)
  data, scales = kernels.quantize_packed(x, 1.0)
  got = {
      targets.BLOCK_AMAX: [kernels.block_amax(x, axis=0), *kernels.block_amax(x, axis=0, digest=True)],
      targets.QUANTIZE_PACKED: [data, scales],
      targets.QUANTIZE_PACKED_STATS: list(kernels.quantize_packed_stats(x, 1.0, axis=0)),
      targets.DEQUANTIZE_PACKED: [kernels.dequantize_packed(data, scales, 1.0, dtype=jnp.bfloat16)],
      targets.GEMM_PACKED: [kernels.gemm_packed(data, scales, data, scales, 1.0)],
      targets.RAGGED_GEMM_PACKED: [kernels.ragged_gemm_packed(data, scales, data[None], scales[None], [32], [1.0]),
                                   kernels.ragged_gemm_packed(data, scales, data[:16], scales[:16], [32, 0, 32],
                                                              [1.0] * 3, ragged_k=True)],
  }
  assert [(a.shape, a.dtype) for a in got[targets.BLOCK_AMAX]] == [((2, 64), jnp.float32)] * 2 + [((2, 64), jnp.uint32)]
  assert [(a.shape, a.dtype) for a in got[targets.QUANTIZE_PACKED]][0] == ((32, 32), jnp.uint8)
  assert [(a.shape, a.dtype) for a in got[targets.QUANTIZE_PACKED_STATS]] == [
      ((16, 64), jnp.uint8), ((2, 64), jnp.uint8), ((len(telemetry.FIELDS),), jnp.float32)]
  (unpacked,) = got[targets.DEQUANTIZE_PACKED]
  assert unpacked.shape == (32, 64) and unpacked.dtype == jnp.bfloat16
  assert got[targets.GEMM_PACKED][0].shape == (32, 32)
  assert [a.shape for a in got[targets.RAGGED_GEMM_PACKED]] == [(32, 32), (3, 32, 16)]


def test_result_types_are_the_results_as_mlir_types():
  with mlir.make_ir_context(), ir.Location.unknown():
    x = ir.RankedTensorType.get([32, 64], ir.BF16Type.get())
    (maxima,) = targets.BLOCK_AMAX.result_types([x], dict(axis=0, rht=False, rht_seed=0, digest=False))
    assert str(maxima) == "tensor<2x64xf32>"
    maxima, digests = targets.BLOCK_AMAX.result_types([x], dict(axis=0, rht=False, rht_seed=0, digest=True))
    assert str(maxima) == "tensor<2x64xf32>" and str(digests) == "tensor<2x64xui32>"
    q, s = targets.QDQ_WITH_SCALE.result_types([x], dict(axis=1, **QUANTIZE, salt=0))
    assert str(q) == "tensor<32x64xbf16>" and str(s) == "tensor<f32>"
    scalar = ir.RankedTensorType.get([], ir.F32Type.get())
    data, scales = targets.QUANTIZE_PACKED.result_types([x, scalar, scalar], dict(QUANTIZE, axis=1))
    assert str(data) == "tensor<32x32xui8>" and str(scales) == "tensor<32x4xui8>"
    data, scales = targets.QUANTIZE_PACKED.result_types([x, scalar, scalar], dict(QUANTIZE, axis=0))
    assert str(data) == "tensor<16x64xui8>" and str(scales) == "tensor<2x64xui8>"


def test_the_partitioner_covers_exactly_the_block_local_targets():
  """The Shardy rule and the custom-call partitioner are installed for the records that say how shards run them."""
  assert set(partition.PARTITIONED) == {t.name for t in targets.ALL if t.block_local is not None} == {
      "xla_fp4_qdq", "xla_fp4_rht", "xla_fp4_block_amax", "xla_fp4_qdq_and_stats", "xla_fp4_output_stats",
      "xla_fp4_mx_qdq"}
  assert partition.PARTITIONED["xla_fp4_qdq"].key_operand == 2  # shards mix their index into the key
  assert partition.PARTITIONED["xla_fp4_mx_qdq"].block == 32 and partition.PARTITIONED["xla_fp4_qdq"].block == 16
  # telemetry's per-device statistics rows: the partitioned quantizers' (block-local and packed) and a wgrad output's
  assert {t.name for t in targets.ALL if t.device_stats} == {
      "xla_fp4_qdq_and_stats", "xla_fp4_quantize_packed_stats", "xla_fp4_output_stats"}
  with state.use(state.State()) as fresh:
    register.register()
  assert set(fresh.partitioners) == {t.name for t in targets.ALL if t.block_local or t.packed or t.side_effect}
  assert packed.callbacks(targets.GEMM_PACKED)["partition"].args == ("xla_fp4_gemm_packed",)
  assert packed.callbacks(targets.MX_GEMM_PACKED)["partition"].args == ("xla_fp4_mx_gemm_packed",)
  assert packed.PACKED["xla_fp4_mx_quantize_packed"].block == 32 and packed.PACKED["xla_fp4_quantize_packed"].block == 16
  assert packed.callbacks(targets.QUANTIZE_PACKED_STATS)["partition"].args == ("xla_fp4_quantize_packed_stats",)


def test_a_with_stats_form_computes_the_same_and_adds_the_row():
  """Target.with_stats (what the rewrite calls where a GEMM is probed): the step as one more operand, the plain form's
  results and then one statistics row, the same partitioning kind."""
  x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
  scalar, key = jax.ShapeDtypeStruct((), np.float32), jax.ShapeDtypeStruct((), np.uint32)
  stats_forms = {t: t.with_stats for t in targets.ALL if t.with_stats is not None}
  assert {t.name: s.name for t, s in stats_forms.items()} == {
      "xla_fp4_qdq": "xla_fp4_qdq_and_stats", "xla_fp4_qdq_with_scale": "xla_fp4_qdq_with_scale_stats",
      "xla_fp4_quantize_packed": "xla_fp4_quantize_packed_stats"}
  for plain, stats in stats_forms.items():
    attrs = {k: 0 if t is int else False for k, t in plain.attributes.items()}
    operands = [x] if plain is targets.QDQ_WITH_SCALE else [x, scalar, key]
    results, measured = plain.results(operands, attrs, None), stats.results(operands, attrs, None)
    assert measured[:-1] == results and measured[-1].shape == (len(telemetry.FIELDS),), plain.name
    assert stats.quantizes and (stats.sharded is None) == (plain.sharded is None) and stats.device_stats == (
        plain.sharded is not None)


def test_records_and_the_extension_list_the_same_targets():
  exported = kernels.extension().attributes()
  assert set(exported) == set(targets.BY_NAME)
  assert all(list(exported[t.name]) == list(t.attributes) for t in targets.ALL)
  assert np.all([t.name.startswith("xla_fp4_") for t in targets.ALL])
