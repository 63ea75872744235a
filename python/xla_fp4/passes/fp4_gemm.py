"""What the FP4 GEMM can run (cuBLASLt's block-scaled GEMM on compute capability 10.x, the C++ reference GEMM on CPU):
the checks by which the policy gives a dot Form.PACKED or Form.PACKED_GROUPED, or keeps the emulated GEMM with a note
saying why (policy.plan)."""

from typing import Optional

from xla_fp4.passes.analysis import DotSite, Grouping


def native_ineligible(site: DotSite, cuda: bool) -> Optional[str]:
  """Why the packed FP4 GEMM cannot run `site`, or None. It multiplies plain matrices (free and contracting dims merge
  into M, N and K; the scales are padded to 128x4 tiles, so M needs no alignment); cuBLASLt needs every matrix's rows
  16-byte aligned: K-major operand rows (K a multiple of 32) and output rows (`_output_rows`)."""
  if site.gemm.batch[0]:
    return "the packed GEMM takes no batch dims"
  if cuda and site.gemm.k % 32:
    return f"cuBLASLt's FP4 GEMM needs K a multiple of 32, K={site.gemm.k}"
  return _output_rows(site.gemm.n, site.gemm.dtype) if cuda else None


def _output_rows(n, dtype):
  """Why cuBLASLt cannot write an (M, N) output of `dtype` (its rows of N elements must be 16-byte aligned: N a
  multiple of 8 in bf16/f16, of 4 in f32), or None. Without this the GEMM would find no algorithm at run time and fail
  the step on Blackwell; the policy keeps such a dot in the emulated GEMM instead."""
  multiple = 16 // (4 if dtype == "f32" else 2)
  return None if n % multiple == 0 else (f"cuBLASLt's FP4 GEMM writes 16-byte output rows: N a multiple of {multiple} "
                                         f"for {dtype}, N={n}")


def native_grouped_ineligible(site: DotSite, cuda: bool) -> Optional[str]:
  """Why the FP4 GEMM cannot run an expert GEMM per expert, or None: a dot_general with one group dim per operand and
  no other batch dim (the FP4 GEMM once per expert), or a chlo.ragged_dot of jax.lax.ragged_dot's forms, tokens
  [M, K] in groups of rows (xla_fp4_ragged_gemm_packed: its groups' rows are known at run time only)."""
  groups, gemm = site.groups, site.gemm
  if groups.kind is Grouping.RAGGED_CONTRACTING:
    return None if len(gemm.lhs_shape) == 2 and len(gemm.rhs_shape) == 2 else "the grouped FP4 GEMM takes matrices"
  if groups.kind is Grouping.RAGGED_ROWS:
    if len(gemm.lhs_shape) != 2 or gemm.contracting[0] != (1,) or len(gemm.rhs_shape) != 3 or gemm.batch[0]:
      return "the grouped FP4 GEMM takes tokens [M, K] and one matrix per group"
  elif groups.free:
    return "an expert dim free in one operand (every token meets every expert): no per-expert FP4 GEMM form"
  elif len(groups.lhs) != 1 or any(d not in groups.lhs for d in gemm.batch[0]):
    return "the packed GEMM takes no batch dims besides the experts"
  if cuda and groups.k % 32:
    return f"cuBLASLt's FP4 GEMM needs K a multiple of 32, K={groups.k}"
  # A ragged GEMM writes the dot's type, the per-expert GEMMs f32 products (summed or stacked after)
  ragged = groups.kind in (Grouping.RAGGED_ROWS, Grouping.RAGGED_CONTRACTING)
  return _output_rows(gemm.n, gemm.dtype if ragged else "f32") if cuda else None
