"""Pairs: where the packed form quantized one value along both of its dims, one read of it makes both copies.

A linear layer's GEMM pair reads each 2D operand twice: the fprop (or dgrad) along its K, the wgrad along its rows
(the tokens), usually with the RHT and, for a gradient, stochastic rounding. After the dots are rewritten (packed.py),
two xla_fp4_quantize_packed calls of the same matrix (one value, or reshapes of one value to one shape) in the same
block, one along each axis, become one xla_fp4_quantize_packed_pair call (Transformer Engine quantizes row- and
column-wise in one kernel alike):

  %d1, %s1 = xla_fp4_quantize_packed(%x, %s_row, %k_row) {axis = 1, stochastic = a, rht = b, ...}      (the dgrad's)
  ... the dgrad's GEMM ...
  %b = xla_fp4_block_amax(%x) {axis = 0, rht}; %s_col = ...; %k_col = ...              (the wgrad's scale and key)
  %d0, %s0 = xla_fp4_quantize_packed(%x, %s_col, %k_col) {axis = 0, stochastic = c, rht = d, ...}
->
  %b = ...; %s_col = ...; %k_col = ...                                  (moved before the first call: they read x only)
  %d1, %s1, %d0, %s0 = xla_fp4_quantize_packed_pair(%x, %s_row, %k_row, %s_col, %k_col)
                           {row_stochastic = a, row_rht = b, col_stochastic = c, col_rht = d, rht_seed, four_over_six}

The pair's results are the two calls' bit for bit (tests/kernels/test_cpu_kernels.py), so no number changes; where
the two calls sit in the forward and the backward (an activation read by its fprop and its wgrad), the column-wise
copy is made in the forward and held, packed, in place of what the backward would have quantized. Only plain 1x16
NVFP4 quantizers pair: a 16x16-tiled weight is packed once anyway (reuse.py), telemetry's measuring forms and the MX
formats have no pair target. Where the second call's scale or key depends on anything but pure ops after the first
call (or on the first call itself), the calls stay apart. In a scanned stack with kept blocks the dots sit in
kept-iteration cases, which cases.py merges first where they select alike and are independent (a dgrad's and its
wgrad's), so that their quantizers share a region.
"""

import dataclasses

from jax._src.lib.mlir import ir

from xla_fp4.kernels import targets
from xla_fp4.passes.rewrite import hoist
from xla_fp4.passes.rewrite.dims import reshape_source
from xla_fp4.passes.rewrite.values import tensor_type


@dataclasses.dataclass
class Packing:
  """One xla_fp4_quantize_packed call the packed form made: its op, x, K's axis, s_dec, key and attributes."""
  op: object
  x: object
  axis: int
  s_dec: object
  key: object
  attrs: dict


def fuse(kernels, packings):
  """Replace each row-wise / column-wise pair of `packings` (in program order) of one value, in one block, with one
  pair call; returns how many pairs were made."""
  by_value = {}  # a matrix by its elements: reshapes of one value to one shape (made in two regions, say) are alike
  for p in packings:
    if not p.attrs["block_2d"]:
      by_value.setdefault((reshape_source(p.x), tuple(tensor_type(p.x).shape)), []).append(p)
  made = 0
  for group in by_value.values():
    rows = [p for p in group if p.axis == 1]
    cols = [p for p in group if p.axis == 0]
    for row in rows:
      col = next((c for c in cols if _compatible(row, c)), None)
      if col is not None and _pair(kernels, row, col):
        cols.remove(col)
        made += 1
  return made


def _compatible(row, col):
  return (row.op.block == col.op.block and row.attrs["rht_seed"] == col.attrs["rht_seed"]
          and row.attrs["four_over_six"] == col.attrs["four_over_six"])


def _pair(kernels, row, col):
  first, second = (row, col) if row.op.is_before_in_block(col.op) else (col, row)
  if not hoist.before(first.op, [second.s_dec, second.key], {first.op, second.op}):
    return False
  with ir.InsertionPoint(first.op), first.op.location:
    attrs = dict(row_stochastic=row.attrs["stochastic"], row_rht=row.attrs["rht"],
                 col_stochastic=col.attrs["stochastic"], col_rht=col.attrs["rht"], rht_seed=row.attrs["rht_seed"],
                 four_over_six=row.attrs["four_over_six"])
    # first.x: the same elements as second.x, and made before first
    results = kernels.call(targets.QUANTIZE_PACKED_PAIR, [first.x, row.s_dec, row.key, col.s_dec, col.key], attrs)
  for old, new in zip(list(row.op.results) + list(col.op.results), results):
    old.replace_all_uses_with(new)
  row.op.erase()
  col.op.erase()
  return True
