"""Reuse: values the rewrite makes once and every later dot that can see them shares.

- quantizations: nearest rounding gives the same q wherever the same elements are quantized in the same blocks
  (`blocking`), so such an operand is quantized once while the result is visible, and reshaped where another dot
  reads a reshape of it: the q, k and v projections of one input share it, and a dgrad reuses its fprop's
  16x16-tiled weight (the recipe's "same quantized values as in fprop"), also where one of them merges the weight's
  dims (attention's (D, heads, head_dim) projections).
- reshapes: one per source value and shape. The q, k and v wgrads then see the same merged activation, and XLA sees
  one value where two dots read a weight alike, which a layout then gathers once (an all-gather per reshape
  otherwise: MaxText's attention weights under FSDP).
- packed 16x16 tiles: a weight the FP4 GEMM reads in 2D blocks with nearest rounding is packed once, and a dgrad
  that reads it along the other axis takes the forward's codes as Bᵀ (xla_fp4_gemm_packed's b_transposed): one copy
  is quantized and, under FSDP, gathered (a second, per reader, otherwise: docs/design.md §8).
- digests: the stochastic-rounding key's digest of a value's elements (order-free, so reshapes share it), summed once
  from the per-block digests of the first block-amax call that measures it: a gradient's dgrad and wgrad then mix one
  digest (one all-reduce) into their keys.
- converts: one per value and element type (XLA CPU's float32 GEMM operands).
- selectors: whether a scanned stack's iteration is kept, once per block index value and kept blocks, so that the
  dots of one iteration select alike (and share quantizations).

Dots are rewritten in program order, so a value made for an earlier dot in the user's own block precedes it.
"""

import math

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.passes.regions import visible
from xla_fp4.passes.rewrite.dims import reshape_source
from xla_fp4.passes.rewrite.values import tensor_type


class Reuse:
  def __init__(self):
    # source value -> [(blocking, selector, q·scale, s_dec)] of the nearest-rounded quantizations of it or of reshapes
    self._quantized = {}
    self._selectors = {}  # (block index, kept blocks) -> whether the iteration is kept
    self._reshapes = {}  # (source value, shape) -> its reshape
    self._converts = {}  # (value, element type) -> its convert
    self._digests = {}  # source value -> the digest of its elements (uint32 scalar)
    self._tiles = {}  # a matrix as the FP4 GEMM reads it (dims.as_read) -> [(its K axis, (codes, scales), s_dec, key)]

  def quantized(self, x, blocking_, select, user):
    """(q·scale reshaped like x, s_dec) of an earlier quantization of x's elements in the same blocks that `user`
    can see and that selects alike, or None."""
    for (b, sel, q, s_dec) in self._quantized.get(reshape_source(x), ()):
      if b == blocking_ and same_selector(sel, select) and before_in_program_order(q, user):
        return self.reshaped(q, tensor_type(x).shape, user), s_dec
    return None

  def remember(self, x, blocking_, select, q, s_dec):
    self._quantized.setdefault(reshape_source(x), []).append((blocking_, select, q, s_dec))

  def packed_tiles(self, x, user, axis=None):
    """(K's axis, (codes, scales), s_dec, key) of an earlier packing of the matrix x in 16x16 tiles with nearest
    rounding that `user` can see (along `axis`, where one is given), or None."""
    for found_axis, packed, s_dec, key in self._tiles.get(x, ()):
      if (axis is None or found_axis == axis) and before_in_program_order(packed[0], user):
        return found_axis, packed, s_dec, key
    return None

  def remember_packed_tiles(self, x, axis, packed, s_dec, key):
    self._tiles.setdefault(x, []).append((axis, packed, s_dec, key))

  def digest(self, x, user):
    """The digest of x's elements (or of a reshape's) made for an earlier dot that `user` can see, or None."""
    value = self._digests.get(reshape_source(x))
    return value if value is not None and before_in_program_order(value, user) else None

  def remember_digest(self, x, digest):
    self._digests[reshape_source(x)] = digest

  def reshaped(self, x, shape, user):
    """x reshaped to `shape`, one reshape per source value and shape while it is visible."""
    source = reshape_source(x)
    if list(tensor_type(source).shape) == list(shape):
      return source
    t = ir.RankedTensorType.get(list(shape), tensor_type(x).element_type)
    return self._visible_cached(self._reshapes, (source, tuple(shape)), user, lambda: hlo.ReshapeOp(t, source).result)

  def converted(self, x, element_type, user):
    """x converted to `element_type`, one convert per value while it is visible: XLA then gathers one converted
    value where two dots read it (a dgrad reusing its fprop's expert weights, both in float32 on XLA CPU)."""
    t = ir.RankedTensorType.get(tensor_type(x).shape, element_type)
    return self._visible_cached(self._converts, (x, str(element_type)), user, lambda: hlo.ConvertOp(t, x).result)

  def selector(self, block, keep_blocks, user, make):
    """make() (whether the iteration is kept), once per block index value and kept blocks while it is visible."""
    return self._visible_cached(self._selectors, (block, tuple(keep_blocks)), user, make)

  @staticmethod
  def _visible_cached(cache, key, user, make):
    """cache[key] where it is visible at `user` (in program order), else a fresh make(), stored there."""
    value = cache.get(key)
    if value is None or not before_in_program_order(value, user):
      value = cache[key] = make()
    return value


def blocking(shape, axis, recipe):
  """Which elements, in row-major order, share a scale (and an RHT) when a tensor of `shape` is quantized along `axis`
  per `recipe` (numerics/nvfp4.py _encode, numerics/mx.py): viewed as the matrix (outer * K, inner), a 1xB block is B
  consecutive rows of one column (K % B == 0: no block straddles two outer indices) and the RHT mixes 16 of them; a 2D
  tile is B rows by B columns of that matrix, or of (outer, K) when inner is 1; B is the format's block. Two
  quantizations with equal blocking, of a tensor and of a reshape of it, give the same q in row-major order
  (tests/passes/test_reuse.py)."""
  outer, k, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
  view = (outer, k) if recipe.block_2d and inner == 1 else (outer * k, inner)
  return (recipe.block_2d, recipe.rht) + view + (() if recipe.format == "nvfp4" else (recipe.format,))


def same_selector(a, b):
  """Whether two quantizations select alike: neither is per iteration, or both on the same branch index value."""
  return a is None and b is None or (a is not None and b is not None and a == b)


def before_in_program_order(value, op):
  """visible(), for a value the rewrite made for an earlier dot: dots are rewritten in program order, so one in op's
  own block precedes it (is_before_in_block is the costly part of visible)."""
  owner = value.owner.operation if hasattr(value.owner, "operation") else value.owner
  return owner.block == op.block or visible(value, op)
