"""What the analysis returns: one `DotRecord` per stablehlo.dot_general (its op, its site facts, where its block index
comes from), in program order. Everything downstream (policy, rewrite, report) reads these records only."""

import dataclasses
import enum
from typing import Any, Optional


class Role(enum.StrEnum):
  FPROP = "fprop"  # a linear layer's forward GEMM
  DGRAD = "dgrad"  # its gradient with respect to the input
  WGRAD = "wgrad"  # its gradient with respect to the weight
  OTHER = "other"  # not a linear layer's GEMM (no operand is a parameter)


class Phase(enum.StrEnum):
  FORWARD = "forward"  # the forward pass, remat recomputation included
  BACKWARD = "backward"  # a transposed (differentiated) dot


class BlockIndex(enum.StrEnum):
  """Where a scanned stack's dot finds the iteration's block index, for the per-iteration select of kept blocks."""
  # In scope at the dot (the dot is in the loop body itself); where a shard_map body lies between, the rewrite passes it
  # in as an operand of each (its region is isolated from above).
  IN_SCOPE = "in_scope"
  PASSED_IN = "passed_in"  # in scope at the body function's call: the rewrite passes it in as an extra argument
  UNAVAILABLE = "unavailable"  # not found: every iteration runs in NVFP4


class Grouping(enum.StrEnum):
  """How an expert GEMM's operands fall into groups, each quantized with its own global decode scale (ragged.py)."""
  SLICES = "slices"  # a dot_general: every slice along the group dims is a matrix of its own
  RAGGED_ROWS = "ragged_rows"  # chlo.ragged_dot: lhs rows in groups, one rhs matrix per group (forward, dgrad)
  RAGGED_CONTRACTING = "ragged_contracting"  # chlo.ragged_dot: both operands' rows in groups, contracted (wgrad)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Groups:
  kind: Grouping
  lhs: tuple  # the lhs's group dims (RAGGED_*: its ragged rows)
  rhs: tuple  # the rhs's, paired with the lhs's in order (RAGGED_ROWS: the dim that selects the group's matrix)
  k: int  # the contraction of one group's GEMM, along which its operands are quantized
  # SLICES: (operand, dim) of group dims that are free dims of one operand (an expert dim of a weight that every token
  # meets: a dense MoE's up projection, `BSM,EMH->BSEH`, and its wgrad); their slices each meet the other operand whole
  free: tuple = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemm:
  """The dot's geometry: M, N, K merge every free / contracting dim (batch dims count into M)."""
  lhs_shape: tuple
  rhs_shape: tuple
  out_shape: tuple
  dtype: str  # of the result
  operand_dtypes: tuple  # (lhs, rhs) element types
  contracting: tuple  # ((lhs dims), (rhs dims))
  batch: tuple  # ((lhs dims), (rhs dims))
  m: int
  n: int
  k: int
  flops: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotSite:
  """What the analysis found out about one dot (plain values only: the report and the policy's rules read these)."""
  index: int  # program order over the module
  func: str
  name_stack: str
  layer: str
  phase: Phase
  role: Role
  weight_operand: Optional[int] = None  # 0 (lhs) or 1 (rhs) for fprop/dgrad
  gradient_operand: Optional[int] = None  # 0 or 1 for wgrad: the output gradient (dataflow, else JAX's lhs)
  weight_arg: Optional[str] = None  # the @main argument the layer's weight comes from
  # that argument's sharding annotation (Shardy's or GSPMD's) replicates it over the mesh: every device holds it whole
  weight_replicated: bool = False
  block: Optional[int] = None  # static block index
  num_stacked: Optional[int] = None  # iterations of the scanned stack when the block is per iteration
  block_offset: Optional[int] = None  # global block index of the dot's layer in the stack's first iteration
  block_stride: int = 1  # decoder layers one iteration runs: iteration i is block block_offset + i * block_stride
  head_reason: Optional[str] = None  # the layer is the output head: how that was found (dataflow, or the name)
  excluded_scope: bool = False  # inside xla_fp4.exclude()
  higher_order: bool = False  # differentiates a derivative: a transpose inside a jvp, or two transposes
  ragged: bool = False  # a ragged dot: a chlo.ragged_dot, or its CPU expansion (an operand masked per group; ragged.py)
  groups: Optional[Groups] = None  # expert GEMMs: one global decode scale per slice or group (ragged.py)
  # inside a shard_map body (sdy.manual_computation): JAX names its ops from the body's own scope; the transforms
  # around it (the phase) are on the sdy.manual_computation, whose name stack the analysis prefixes
  in_shard_map: bool = False
  # inside a shard_map body: the replica groups (global device ids) over which its per-device decode scales are
  # max-reduced (peers.py); () outside bodies
  peers: tuple = ()
  gemm: Gemm

  @property
  def is_head(self):
    return self.head_reason is not None


@dataclasses.dataclass(frozen=True)
class BlockSource:
  """The block index of a scanned stack's iteration: `value`, in the scope of `entry_call` (the func.call that enters
  the dot's function; None when the dot is in its scope itself), shard_map bodies between them aside (regions.in_scope).
  """
  kind: BlockIndex
  value: Any  # ir.Value
  entry_call: Any = None  # ir.Operation


@dataclasses.dataclass(frozen=True)
class DotRecord:
  op: Any  # the stablehlo.dot_general (ir.Operation)
  site: DotSite
  block_source: Optional[BlockSource] = None  # scanned stacks whose block index the program holds
  # expert GEMMs (Grouping.SLICES) of a ragged dot's CPU expansion: (operand, its i1 group mask, shaped like it)
  group_mask: Optional[tuple] = None


@dataclasses.dataclass
class Analysis:
  records: list  # [DotRecord], program order (records[i].site.index == i)
  num_blocks: int
  blocks_found: tuple = ()  # how the blocks were found, one line per stack (the report's "blocks:")

  @property
  def sites(self):
    return [r.site for r in self.records]

  @property
  def trains(self):
    """Whether the program has a backward pass through a linear layer. A shard_map body's names carry no transforms,
    so a program with one is taken to train (its backward cannot be told from its forward by name)."""
    return any(s.phase is Phase.BACKWARD or s.role in (Role.DGRAD, Role.WGRAD) or s.in_shard_map for s in self.sites)
