"""Dims: the layouts the rewrite gives GEMM operands (each a reshape or a transpose of the dot's operand).

The kernels quantize along one axis, so several contracting dims (a wgrad over batch and sequence, an einsum over
heads) are merged into one: in place by a reshape when they are adjacent and in order (no data moves), else by a
transpose to (batch, free, K). The packed quantizer reads an operand as a matrix along either axis (`as_read`: a
reshape where the contracting dims lead or trail, else `canonical`, then `matrix`); XLA CPU needs some bf16 dots as
plain (batch, rows, cols) matrices (`as_matrices`).
"""

import math

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.passes.regions import is_argument
from xla_fp4.passes.rewrite.values import tensor_type


def as_matrices(a, b, dims, reshape):
  """(a, b, dims, output shape) with each operand reshaped (reshape(value, shape)) to (batch..., free, K) or
  (batch..., K, free): possible when its batch dims lead and its one contracting dim is first or last among the rest
  (no data moves); else None."""
  dn = hlo.DotDimensionNumbers(dims)
  out, new_dims = [], []
  for x, batch, contract in ((a, dn.lhs_batching_dimensions, dn.lhs_contracting_dimensions),
                             (b, dn.rhs_batching_dimensions, dn.rhs_contracting_dimensions)):
    shape, nb = list(tensor_type(x).shape), len(batch)
    if list(batch) != list(range(nb)) or len(contract) != 1 or contract[0] not in (nb, len(shape) - 1):
      return None
    k_last = contract[0] == len(shape) - 1
    free = math.prod(shape[nb:-1] if k_last else shape[nb + 1:])
    matrix = shape[:nb] + ([free, shape[-1]] if k_last else [shape[nb], free])
    out.append(reshape(x, matrix))
    new_dims.append((nb + 1 if k_last else nb, free))
  batch = list(range(len(dn.lhs_batching_dimensions)))
  shape = list(tensor_type(a).shape)[:len(batch)] + [new_dims[0][1], new_dims[1][1]]
  dims = hlo.DotDimensionNumbers.get(lhs_batching_dimensions=batch, rhs_batching_dimensions=batch,
                                     lhs_contracting_dimensions=[new_dims[0][0]],
                                     rhs_contracting_dimensions=[new_dims[1][0]])
  return out[0], out[1], dims, shape


def as_read(x, contract, reshape):
  """(x as a matrix the packed quantizer reads, K's axis in it): (K, rows) where the contracting dims lead in order
  (x @ w's weight, a wgrad's operands), (rows, K) where they trail in order, each by reshape(value, shape) (no data
  moves); else the K-major copy (rows, K) (`canonical`)."""
  shape, contract, n = list(tensor_type(x).shape), list(contract), len(contract)
  if n < len(shape) and contract == list(range(n)):
    return reshape(x, [math.prod(shape[:n]), math.prod(shape[n:])]), 0
  if n < len(shape) and contract == list(range(len(shape) - n, len(shape))):
    return reshape(x, [math.prod(shape[:-n]), math.prod(shape[-n:])]), 1
  return matrix(canonical(x, (), contract)), 1


def reshape_source(x):
  """The value that x is a chain of reshapes of (x itself if none): the same elements in row-major order."""
  while not is_argument(x):
    owner = x.owner
    if owner.name != "stablehlo.reshape":
      break
    x = owner.operands[0]
  return x


def adjacent(dims):
  return list(dims) == list(range(dims[0], dims[0] + len(dims)))


def merged_shape(x, dims):
  """x's shape with the adjacent dims `dims` (in order) merged into one at dims[0]: row-major, so no data moves."""
  shape = list(tensor_type(x).shape)
  return shape[:dims[0]] + [math.prod(shape[d] for d in dims)] + shape[dims[-1] + 1:]


def after_merge(d, dims):
  """The number of dim `d` (not in `dims`) once `dims` are merged."""
  return d if d < dims[0] else d - (len(dims) - 1)


def canonical(x, batch, contract):
  """Transpose to (batch, free, contract) and merge the contracting dims into one trailing dim K."""
  t = tensor_type(x)
  rank = len(t.shape)
  free = [d for d in range(rank) if d not in batch and d not in contract]
  perm = list(batch) + free + list(contract)
  if perm != list(range(rank)):
    x = hlo.TransposeOp(x, ir.DenseI64ArrayAttr.get(perm)).result
  if len(contract) != 1:
    kept = [t.shape[d] for d in list(batch) + free]
    x = hlo.ReshapeOp(ir.RankedTensorType.get(kept + [math.prod(t.shape[d] for d in contract)], t.element_type),
                      x).result
  return x


def matrix(x):
  """(free..., K) -> (prod(free), K)."""
  t = tensor_type(x)
  if len(t.shape) == 2:
    return x
  return hlo.ReshapeOp(ir.RankedTensorType.get([math.prod(t.shape[:-1]), t.shape[-1]], t.element_type), x).result
