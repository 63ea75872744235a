"""Small builders of MLIR values for the rewrite (at the current insertion point and location)."""

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo


def tensor_type(v):
  return ir.RankedTensorType(v.type)


def scalar_type(dtype_ir):
  return ir.RankedTensorType.get([], dtype_ir)


def f32():
  return ir.F32Type.get()


def u32():
  return ir.IntegerType.get_unsigned(32)


def const(value, ir_type):
  """A scalar constant of an f32, u32 or signed/unsigned integer MLIR type."""
  if isinstance(ir_type, ir.F32Type):
    np_dtype = np.float32
  else:
    int_type = ir.IntegerType(ir_type)
    np_dtype = np.dtype(f"{'u' if int_type.is_unsigned else 'i'}{int_type.width // 8}")
  return hlo.ConstantOp(ir.DenseElementsAttr.get(np.array(value, np_dtype),
                                                 type=ir.RankedTensorType.get([], ir_type))).result


def broadcast(scalar, like_type):
  return hlo.BroadcastInDimOp(like_type, scalar, ir.DenseI64ArrayAttr.get([])).result
