"""What every form of the rewrite shares while it rewrites one module: the kernel set, the twins, the seed, the values
shared between dots (reuse.py), and how GEMMs are built on this platform. The forms (quantize.py, emulated.py,
packed.py, experts.py) take it as their first argument; none keeps state of its own."""

import dataclasses
from typing import Any

from xla_fp4.kernels import targets
from xla_fp4.numerics import formats
from xla_fp4.passes.rewrite.reuse import Reuse
from xla_fp4.passes.rewrite.values import const, u32


@dataclasses.dataclass
class Context:
  kernels: Any  # a kernel_sets.KernelSet
  twins: Any  # kernel_sets.Twins of the module being rewritten
  seed: int
  # XLA CPU fails at run time on some bf16 x bf16 -> f32 dots whose operands have several free dims ("Unsupported
  # element type for DotThunk::Execute", e.g. the wgrad of a two-contracting-dim einsum); as (batch, rows, cols)
  # matrices (dims.as_matrices) they run.
  matrix_gemm: bool = False
  emulate: bool = False  # the packed GEMM's `emulate`: shards multiply dequantized operands (sharding/packed.py)
  reuse: Reuse = dataclasses.field(default_factory=Reuse)
  packings: list = dataclasses.field(default_factory=list)  # the packed form's quantizers, which pairs.py may pair
  cases: list = dataclasses.field(default_factory=list)  # (kept-iteration case, its predicate), for cases.py

  @property
  def mesh(self):
    """The Shardy mesh over all partitions where the kernel set has one (telemetry's per-device rows), else None."""
    return getattr(self.kernels, "mesh", None)

  def salt_value(self, operand):
    """The operand's stochastic-rounding salt: the seed folded with its site's salt id."""
    return formats.fold_in_int(self.seed, operand.salt_id)

  def salt(self, operand):
    return const(self.salt_value(operand), u32())


def peers(operand):
  """The twins' `peers` parameter of an operand in a shard_map body (OperandPlan.peers); none elsewhere, so that the
  twins outside bodies are the same functions as before bodies had peers."""
  return dict(peers=operand.peers) if operand.peers else {}


def dtype_name(tensor_type_):
  """The numpy name of an MLIR tensor type's element type (a twin's `dtype` parameter)."""
  return targets.shape_dtype(tensor_type_).dtype.name
