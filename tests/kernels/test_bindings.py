"""The extension's bindings as this Python and this jax see them: its registrations and attributes are the Python
records' (kernels.TARGETS, kernels.ATTRIBUTES), the backend_config the pass writes is what jax.ffi emits, and a call
that breaks a kernel's contract fails with an error that says what was wrong (ffi_checks.h, through jax's FFI).

Apart from test_cpu_kernels.py (the kernels' arithmetic) so that CI's Python 3.13 tier can run these without those:
its wheel's kernels are the Python 3.11 wheel's object code, its bindings and its jax are not (.ci/run).
"""

import jax
import jax.numpy as jnp
import pytest

from nvfp4_testing import extension_or_skip
from xla_fp4 import kernels


def test_errors_say_what_was_wrong():
  x = jnp.ones((4, 24))
  with pytest.raises(Exception, match="multiple of 16"):
    kernels.qdq(x, 1.0, axis=1).block_until_ready()
  with pytest.raises(Exception, match="out of range"):
    kernels.qdq(jnp.ones((4, 16)), 1.0, axis=2).block_until_ready()
  call = jax.ffi.ffi_call(kernels.QDQ_TARGET, jax.ShapeDtypeStruct((4, 16), jnp.float32))
  with pytest.raises(Exception, match="s_dec must be a float32 scalar"):
    call(jnp.ones((4, 16)), jnp.ones((1,)), jnp.uint32(0), axis=1, block_2d=False, stochastic=False, rht=False,
         rht_seed=0, apply_global_scale=True, four_over_six=False).block_until_ready()
  with pytest.raises(Exception, match="rht_seed"):
    kernels.qdq(jnp.ones((4, 16)), 1.0, rht=True, rht_seed=-1).block_until_ready()
  with pytest.raises(Exception, match="salt must be in"):
    kernels.qdq_with_scale(jnp.ones((4, 16)), 2**32)[0].block_until_ready()
  with pytest.raises(Exception, match="multiple of 16"):
    kernels.qdq_with_scale(jnp.ones((4, 24)), 0, axis=1)[0].block_until_ready()
  with pytest.raises(Exception, match="same K"):
    d = jnp.zeros((128, 8), jnp.uint8)
    s = jnp.zeros((512,), jnp.uint8)
    kernels.gemm_packed(d, s, jnp.zeros((128, 16), jnp.uint8), s, 1.0).block_until_ready()


def test_packed_pair_says_what_it_needs():
  with pytest.raises(Exception, match="multiple of 16"):
    kernels.quantize_packed_pair(jnp.ones((24, 32)), 1.0, 1.0)  # 24 rows: the column-wise copy's K
  with pytest.raises(ValueError, match="takes a matrix"):
    kernels.quantize_packed_pair(jnp.ones((16, 16, 16)), 1.0, 1.0)


def test_packed_rejects_an_axis_it_does_not_read():
  with pytest.raises(ValueError, match="axis 0 or 1"):
    kernels.quantize_packed(jnp.ones((16, 16)), 1.0, axis=2)


def test_registrations_match_the_python_target_names():
  assert set(extension_or_skip().registrations()) == set(kernels.TARGETS)
  assert kernels.available()[0]


def test_python_attributes_are_the_ones_the_handlers_bind():
  """ffi_targets.h lists each target's attributes once; the CPU and CUDA handlers bind them from it and the extension
  exports it: kernels.ATTRIBUTES (names, order, types) must be that list."""
  exported = extension_or_skip().attributes()
  names = {bool: "bool", int: "int"}
  assert {t: list(a.items()) for t, a in exported.items()} == \
      {t: [(n, names[ty]) for n, ty in a.items()] for t, a in kernels.ATTRIBUTES.items()}


def test_backend_config_matches_what_ffi_call_emits():
  from jax.extend.mlir import ir
  attrs = dict(axis=-1, block_2d=True, stochastic=False, rht=True, rht_seed=7, apply_global_scale=False,
               four_over_six=False)
  text = jax.jit(lambda x: kernels.qdq(x, 1.0, 0, **attrs)).lower(jnp.ones((2, 16))).as_text()
  with ir.Context():
    config = kernels.custom_call_backend_config(kernels.QDQ_TARGET, attrs)
  assert str(config) in text, (str(config), text)
  with ir.Context(), pytest.raises(ValueError, match="takes attributes"):
    kernels.custom_call_backend_config(kernels.RHT_TARGET, attrs)


def test_mx_qdq_says_what_it_needs():
  with pytest.raises(Exception, match="multiple of 32"):
    kernels.mx_qdq(jnp.ones((4, 48)), axis=1)


def test_mx_packed_says_what_it_needs():
  with pytest.raises(Exception, match="multiple of 32"):
    kernels.mx_quantize_packed(jnp.ones((4, 48)))
  data, scales = kernels.mx_quantize_packed(jnp.ones((4, 64)))
  with pytest.raises(Exception, match=r"a_scales must have shape \(4, 2\)"):
    kernels.mx_gemm_packed(data, scales[:, :1], data, scales).block_until_ready()


def test_custom_calls_are_built_as_jax_ffi_builds_them():
  """kernels.custom_call builds its op itself (jax's helper builds every attribute anew): the op must be the one jax's
  mlir.custom_call builds for a typed FFI call, attribute for attribute, with a side effect and without."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir.dialects import func
  from jax.extend.mlir import ir

  attrs = dict(axis=-1, block_2d=False, stochastic=True, rht=False, rht_seed=0, salt=7, four_over_six=False)
  with mlir.make_ir_context(), ir.Location.unknown():
    module = ir.Module.create()
    x_type = ir.RankedTensorType.get((4, 32), ir.BF16Type.get())
    result_types = [x_type, ir.RankedTensorType.get((), ir.F32Type.get())]
    with ir.InsertionPoint(module.body):
      fn = func.FuncOp("f", ([x_type], []))
    with ir.InsertionPoint(fn.add_entry_block()):
      x = fn.arguments[0]
      for side_effect in (False, True):
        config = kernels.backend_config_attributes(kernels.targets.QDQ_WITH_SCALE.name, attrs)
        ours = kernels.custom_call(kernels.QDQ_WITH_SCALE_TARGET, result_types, [x], config,
                                   has_side_effect=side_effect, cache={})
        theirs = mlir.custom_call(kernels.QDQ_WITH_SCALE_TARGET, result_types=result_types, operands=[x],
                                  api_version=4, backend_config=config, has_side_effect=side_effect,
                                  operand_layouts=[[1, 0]], result_layouts=[[1, 0], []])
        assert _attributes(ours) == _attributes(theirs)
        assert ours.operation.name == theirs.operation.name
      func.ReturnOp([])
    assert module.operation.verify()


def _attributes(op):
  attrs = op.operation.attributes
  return {attrs[i].name: str(attrs[i].attr) for i in range(len(attrs))}
