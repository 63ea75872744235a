"""Policy: decide per dot whether it is quantized, in which format (NVFP4 unless the `format` option, a rule or
`kept_format` says MXFP4 or MXFP8: numerics/formats.py), with which recipe per operand, and why.

Ordered rules, first match wins (Qwix style); every decision carries the rule's reason, and rules that matched no dot
are reported. The user's rules (the `rules` option: data, not code) come after the five that say what the pass cannot
take (a ragged dot of a form the grouped recipe does not take, not a linear layer, the dtypes and contraction sizes
the kernels take) and which programs it leaves alone (those that do not train, unless XLA_FP4_FORWARD_ONLY=1), and
before the paper's policy. Defaults follow docs/design.md §2 / arXiv 2509.25149 §4: only linear-layer GEMMs; the
output head kept; about 16% of the blocks kept in high precision, weighted to the end (the paper kept the first 2 and
last 8 of 62 blocks); GEMMs whose contraction is not a multiple of 16, or that are tiny, kept.

In a scanned layer stack one dot serves every layer: the decision there is `nvfp4` with `keep_blocks`, and the rewrite
gives the GEMM per iteration either the operands themselves or their q·scale (a `stablehlo.select` per operand, on
the block index; the packed form selects between the original dot and the FP4 GEMM with a `stablehlo.case`).

`plan` turns each NVFP4 decision into the whole plan of its rewrite (`Plan`): the form of the pattern, where the
block index comes from, and per operand (`OperandPlan`) what it is (activation, weight, gradient), its recipe, whether
the dot decides how its K is sharded, whether it is quantized anew or may reuse an earlier quantization, and in which
order the operands are quantized. The rewrite applies plans; it decides nothing.
"""

import dataclasses
import enum
import re
from typing import Callable, Optional

from xla_fp4.config import Config, UserRule
from xla_fp4.numerics.formats import FORMATS
from xla_fp4.numerics.gemm import OperandRecipe
from xla_fp4.numerics.nvfp4 import Rounding
from xla_fp4.passes.analysis import Analysis, BlockIndex, BlockSource, DotRecord, DotSite, Grouping, Role
from xla_fp4.passes.fp4_gemm import native_grouped_ineligible, native_ineligible


class Verdict(enum.StrEnum):
  """Keep the dot, or quantize its operands per the recipe in a number format (numerics/formats.py FORMATS)."""
  KEEP = "keep"  # the original dot, in the program's precision
  NVFP4 = "nvfp4"
  MXFP4 = "mxfp4"
  MXFP8 = "mxfp8"


class Form(enum.StrEnum):
  """The pattern an NVFP4 dot is rewritten into (rewrite/emitter.py's docstring shows the IR)."""
  WHOLE_TENSOR = "whole_tensor"  # one kernel per operand measures it (amax, key) and returns q·scale; one device
  PARTITIONED = "partitioned"  # per-block maxima, a plain max reduction (XLA's all-reduce), then the qdq kernel
  PACKED = "packed"  # packed FP4 operands and the FP4 GEMM (the native backend; emulated in partitioned programs)
  GROUPED = "grouped"  # expert GEMMs: one global decode scale per expert or group of tokens (numerics/grouped.py)
  # expert GEMMs on the native backend: the FP4 GEMM once per expert, or a chlo.ragged_dot's grouped FP4 GEMM
  PACKED_GROUPED = "packed_grouped"


# The forms of the emulated dense GEMM (rewrite/emulated.py), the one every format runs.
DENSE = (Form.WHOLE_TENSOR, Form.PARTITIONED)


class Operand(enum.StrEnum):
  """What a GEMM operand is, which decides its recipe (docs/design.md §2)."""
  ACTIVATION = "activation"
  WEIGHT = "weight"
  GRADIENT = "gradient"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  name: str
  decision: Optional[Verdict]  # None: quantize in the `format` option's format
  reason: str
  when: Callable[[DotSite, "Context"], bool]


@dataclasses.dataclass(frozen=True)
class Context:
  config: Config
  num_blocks: int
  kept_blocks: frozenset
  trains: bool  # the program has a backward pass through a linear layer (Analysis.trains)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
  index: int
  decision: Verdict
  rule: str
  reason: str
  lhs: Optional[OperandRecipe] = None
  rhs: Optional[OperandRecipe] = None
  keep_blocks: tuple = ()  # scanned stacks: block indices that run the high-precision dot
  # ... or, with XLA_FP4_KEPT_FORMAT=mxfp8, their (lhs, rhs) recipes in MXFP8; None: high precision
  kept_recipes: Optional[tuple] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandPlan:
  """How one operand of an NVFP4 dot is quantized (Plan.operands[0] is the lhs's, [1] the rhs's)."""
  kind: Operand
  recipe: OperandRecipe
  salt_id: int  # 2 * dot index + position: mixed with the seed into the stochastic-rounding key's salt
  # A fprop's activation, a dgrad's output gradient (1x16 blocks): the dot, through the weight it contracts with,
  # decides how K is sharded (Form.PARTITIONED; sharding/partition.py `k_follows_dot`).
  k_follows_dot: bool
  # Quantized anew, never reused: a dgrad's weight that every device holds whole (partitioned forms), rather than
  # hold its fprop's q·scale across the step. A sharded weight reuses it: quantizing it anew would gather it again
  # (docs/design.md §8).
  fresh: bool
  # Quantized after the dot's gradient operand (whose decode scale orders it): a tensor the forward computed is then
  # quantized where the backward reads it, not held from the forward (docs/design.md §5).
  after_gradient: bool
  # In a shard_map body: the replica groups its decode scales are max-reduced over (analysis/peers.py), else ().
  peers: tuple = ()
  # A scanned stack's kept iterations quantize with this recipe (MXFP8, XLA_FP4_KEPT_FORMAT) instead of taking the
  # operand itself; None: high precision.
  kept_recipe: Optional[OperandRecipe] = None

  @property
  def reusable(self):
    """Whether an earlier quantization of the same elements in the same blocks serves (rewrite/reuse.py): nearest
    rounding gives the same q wherever it runs; not where the plan asks for a `fresh` one."""
    return not self.recipe.stochastic and not self.fresh

  @property
  def tiles_alike(self):
    """Whether one quantized copy serves a GEMM that contracts either of the matrix's dims: 16x16 tiles with nearest
    rounding and no RHT read alike along both (the recipe's dgrad sharing its fprop's weight, arXiv 2509.25149
    §4.3), in a value that may be reused."""
    return self.recipe.block_2d and not self.recipe.rht and self.reusable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """How one NVFP4 dot is rewritten: its decision, the form of the pattern, its operands' plans and, where kept
  blocks of a scanned stack select per iteration, where the block index comes from."""
  record: DotRecord
  decision: Decision
  form: Form
  operands: tuple  # (lhs OperandPlan, rhs OperandPlan)
  order: tuple  # positions in the order they are quantized: the gradient first
  block_source: Optional[BlockSource]  # None: no per-iteration select
  notes: tuple = ()  # what the report adds to the decision's reason (a fallback and why)

  @property
  def site(self) -> DotSite:
    return self.record.site


def kept_blocks(config: Config, num_blocks: int) -> frozenset:
  """The blocks kept in high precision: first/last counts from the config, 'auto' = 16% split 1:4 first:last."""
  total = round(0.16 * num_blocks)
  first = config.keep_first if config.keep_first != "auto" else total // 5
  last = config.keep_last if config.keep_last != "auto" else total - total // 5
  first, last = min(first, num_blocks), min(last, num_blocks)
  return frozenset(range(first)) | frozenset(range(num_blocks - last, num_blocks))


QUANTIZABLE_DTYPES = {"f32", "bf16", "f16"}


def _user_rule(u: UserRule) -> Rule:
  layer = re.compile(u.layer) if u.layer else None
  return Rule(name=u.name, decision=Verdict(u.decision), reason=u.reason,
              when=lambda s, c: ((layer is None or bool(layer.search(s.layer))) and (not u.roles or s.role in u.roles)
                                 and (not u.blocks or s.block in u.blocks)))


def default_rules(config: Config):
  """The rules in order: what the pass cannot take and the programs it leaves alone, the user's rules (config.rules),
  the paper's policy."""
  exclude = re.compile(config.exclude) if config.exclude else None
  return (
      Rule(name="ragged", decision=Verdict.KEEP,
           reason="a ragged dot of a form the grouped recipe does not take (it takes jax.lax.ragged_dot's forward, "
                  "dgrad and wgrad, as chlo.ragged_dot on GPU and masked dot_generals on CPU): high precision on "
                  "every platform",
           when=lambda s, c: s.ragged and s.groups is None),
      Rule(name="not_linear", decision=Verdict.KEEP, reason="not a linear-layer GEMM (no operand is a parameter)",
           when=lambda s, c: s.role is Role.OTHER),
      Rule(name="dtype", decision=Verdict.KEEP,
           reason="operands are not float32, bfloat16 or float16 (what the kernels take)",
           when=lambda s, c: not set(s.gemm.operand_dtypes) <= QUANTIZABLE_DTYPES),
      Rule(name="contraction_not_16", decision=Verdict.KEEP, reason="contraction size is not a multiple of 16",
           when=lambda s, c: (s.groups.k if s.groups else s.gemm.k) % 16 != 0),
      Rule(name="forward_only", decision=Verdict.KEEP,
           reason="the program has no backward pass through a linear layer (an eval, sampling or init step, an eager "
                  "op): left as it is (XLA_FP4_FORWARD_ONLY=1 rewrites it)",
           when=lambda s, c: not c.trains and not c.config.forward_only),
      *(_user_rule(u) for u in config.rules),
      Rule(name="higher_order", decision=Verdict.KEEP,
           reason="inside a derivative of a derivative (a gradient in the loss): the recipe is for first-order "
                  "gradients, so kept in high precision",
           when=lambda s, c: s.higher_order),
      Rule(name="exclude_scope", decision=Verdict.KEEP, reason="inside xla_fp4.exclude()",
           when=lambda s, c: s.excluded_scope),
      Rule(name="exclude_regex", decision=Verdict.KEEP, reason=f"layer path matches XLA_FP4_EXCLUDE={config.exclude!r}",
           when=lambda s, c: exclude is not None and bool(exclude.search(s.layer))),
      Rule(name="tiny", decision=Verdict.KEEP, reason=f"M, N or K below XLA_FP4_MIN_DIM={config.min_dim}",
           when=lambda s, c: min(s.gemm.m, s.gemm.n, s.gemm.k) < c.config.min_dim),
      Rule(name="head", decision=Verdict.KEEP, reason="output head (logits) kept in high precision",
           when=lambda s, c: s.is_head and c.config.keep_head),
      Rule(name="high_precision_block", decision=Verdict.KEEP,
           reason="block kept in high precision (XLA_FP4_KEEP_FIRST/LAST)",
           when=lambda s, c: s.block is not None and s.block in c.kept_blocks),
      Rule(name="nvfp4", decision=None, reason="linear layer", when=lambda s, c: True),
  )


def operand_kinds(site: DotSite):
  """(lhs, rhs) Operand kinds: the gradient is the non-weight operand of a dgrad, and the operand of a wgrad that the
  analysis found to be the gradient (DotSite.gradient_operand)."""
  if site.role is Role.WGRAD:
    return (Operand.ACTIVATION, Operand.GRADIENT) if site.gradient_operand == 1 else \
        (Operand.GRADIENT, Operand.ACTIVATION)
  other = Operand.ACTIVATION if site.role is Role.FPROP else Operand.GRADIENT
  return (Operand.WEIGHT, other) if site.weight_operand == 0 else (other, Operand.WEIGHT)


def recipe_for(site: DotSite, config: Config, fmt: str = "nvfp4"):
  """Per-operand (lhs, rhs) recipes of docs/design.md §2's table (arXiv 2509.25149 §4) in the format `fmt`: weights in
  2D tiles, gradients stochastically rounded, both wgrad operands through the RHT, each where the format takes that
  part of the recipe (formats.Format) and the config leaves it on."""
  f = FORMATS[fmt]
  sr = Rounding.STOCHASTIC if config.stochastic_rounding and f.stochastic else Rounding.NEAREST
  wgrad = site.role is Role.WGRAD
  fos = config.four_over_six and fmt == "nvfp4"  # Four Over Six refines NVFP4's block scales

  def recipe(kind):
    if kind is Operand.WEIGHT:
      return OperandRecipe(block_2d=config.weights_2d and f.tiles_2d, format=fmt, four_over_six=fos)
    rounding = sr if kind is Operand.GRADIENT else Rounding.NEAREST
    return OperandRecipe(rounding=rounding, rht=config.rht and wgrad and f.rht, format=fmt, four_over_six=fos)
  return tuple(recipe(k) for k in operand_kinds(site))


# The policy's kept layers (what XLA_FP4_KEPT_FORMAT decides for): the output head and the kept blocks.
KEPT_LAYER_RULES = ("head", "high_precision_block")


def format_cannot_take(site: DotSite, fmt: str) -> Optional[str]:
  """Why `site` cannot run in the format `fmt`, or None: its blocks must fit the contraction."""
  f = FORMATS[fmt]
  k = site.groups.k if site.groups else site.gemm.k
  if k % f.block:
    return f"contraction size {k} is not a multiple of {f.block} ({fmt}'s block): high precision"
  return None


def decide(analysis: Analysis, config: Config, rules=None):
  """Returns ([Decision] in site order, [names of rules that matched nothing])."""
  rules = default_rules(config) if rules is None else rules
  ctx = Context(config=config, num_blocks=analysis.num_blocks, kept_blocks=kept_blocks(config, analysis.num_blocks),
                trains=analysis.trains)
  used, decisions = set(), []
  for record in analysis.records:
    site = record.site
    rule = next(r for r in rules if r.when(site, ctx))
    used.add(rule.name)
    verdict = rule.decision or Verdict(config.format)
    reason = rule.reason + (f": {site.head_reason}" if rule.name == "head" and site.head_reason else "")
    if rule.name in KEPT_LAYER_RULES and config.kept_format == "mxfp8":
      verdict, reason = Verdict.MXFP8, reason + "; in MXFP8 (XLA_FP4_KEPT_FORMAT)"
    why = format_cannot_take(site, verdict) if verdict is not Verdict.KEEP else None
    if why:
      verdict, reason = Verdict.KEEP, f"{reason}; {why}"
    if verdict is Verdict.KEEP:
      decisions.append(Decision(index=site.index, decision=Verdict.KEEP, rule=rule.name, reason=reason))
      continue
    lhs, rhs = recipe_for(site, config, verdict)
    keep_blocks, kept_recipes = (), None
    # Kept blocks select per iteration under the built-in rule only: a user's nvfp4 rule comes before the kept blocks'
    # rule, so every iteration runs in NVFP4, as the same blocks would unscanned.
    builtin = rule.name == "nvfp4"
    if builtin and record.block_source is not None:
      # the iterations whose layer is a kept block (iteration i runs block block_offset + i * block_stride)
      layers = {i: (site.block_offset or 0) + i * site.block_stride for i in range(site.num_stacked or 0)}
      keep_blocks = tuple(i for i, b in layers.items() if b in ctx.kept_blocks)
      kept_mx = config.kept_format == "mxfp8" and keep_blocks and format_cannot_take(site, "mxfp8") is None
      kept_recipes = recipe_for(site, config, "mxfp8") if kept_mx else None
      if keep_blocks:
        reason += (f"; scanned stack: iterations {list(keep_blocks)} (blocks {[layers[i] for i in keep_blocks]}) run "
                   + ("in MXFP8 (XLA_FP4_KEPT_FORMAT)" if kept_mx else "the high-precision dot"))
    elif builtin and site.num_stacked and ctx.kept_blocks:
      reason += "; nested scanned stack without a per-iteration block index: every iteration runs in NVFP4"
    decisions.append(Decision(index=site.index, decision=verdict, rule=rule.name, reason=reason, lhs=lhs, rhs=rhs,
                              keep_blocks=keep_blocks, kept_recipes=kept_recipes))
  unmatched = [r.name for r in rules if r.name not in used]
  return decisions, unmatched


def _operand_plans(site: DotSite, decision: Decision, form: Form):
  """((lhs, rhs) OperandPlans, quantization order)."""
  kinds = operand_kinds(site)
  backward = site.role is not Role.FPROP
  plans = tuple(OperandPlan(
      kind=kind, recipe=(decision.lhs, decision.rhs)[i], salt_id=2 * site.index + i,
      k_follows_dot=site.role is not Role.WGRAD and kind is not Operand.WEIGHT,
      fresh=(site.role is Role.DGRAD and kind is Operand.WEIGHT and site.weight_replicated
             and form is not Form.WHOLE_TENSOR),
      after_gradient=backward and kind is not Operand.GRADIENT, peers=site.peers,
      kept_recipe=decision.kept_recipes[i] if decision.kept_recipes and form in DENSE else None)
      for i, kind in enumerate(kinds))
  order = (1, 0) if backward and kinds[1] is Operand.GRADIENT else (0, 1)
  return plans, order


def _dense_only(d: Decision, grouped: bool) -> Optional[str]:
  """Why a decision runs the emulated dense GEMM whatever the backend, or None."""
  if d.decision is not Verdict.NVFP4 and grouped:
    return f"{d.decision} expert GEMMs run the emulated GEMM (the grouped FP4 GEMM is NVFP4's)"
  if d.lhs.four_over_six and grouped:
    return "Four Over Six expert GEMMs run the emulated GEMM (their per-expert scales are the grouped recipe's twins)"
  return None


def plan(analysis: Analysis, decisions, *, partitioned: bool, native: bool, cuda: bool, packed: bool = False):
  """One Plan per NVFP4 decision, in program order. Expert GEMMs (DotSite.groups) take the grouped form. `native`:
  the backend's GEMM is the FP4 one; a dot it cannot run keeps the emulated GEMM, with a note saying why. `packed`: the
  kernel set runs the packed targets; then the emulate backend of a partitioned program moves packed operands too
  (Form.PACKED, the GEMM emulated on each device: sharding/packed.py), except where kept blocks of a scanned stack
  select per iteration (a select cannot choose between packed and wide operands) and where the dot's weight is whole
  on every device (nothing to gather)."""
  plans = []
  for d in decisions:
    if d.decision is Verdict.KEEP:
      continue
    record, notes = analysis.records[d.index], []
    source = record.block_source if d.keep_blocks else None
    if source is not None and source.kind is BlockIndex.UNAVAILABLE:
      notes.append("block index unavailable per iteration: every iteration runs in NVFP4")
    grouped = record.site.groups is not None
    form = Form.GROUPED if grouped else Form.PARTITIONED if partitioned else Form.WHOLE_TENSOR
    dense_only = _dense_only(d, grouped)
    if dense_only:
      # The MX formats' expert GEMMs run the emulated dense GEMM: block-local scales need no per-expert form (a
      # chlo.ragged_dot keeps its own op: numerics/grouped_mx.py); the grouped FP4 GEMM is NVFP4's. Four Over Six
      # keeps the grouped recipe's per-expert scales (numerics/grouped.py), emulated.
      ragged = grouped and record.site.groups.kind is not Grouping.SLICES
      per_expert = grouped and (ragged or d.decision is Verdict.NVFP4)
      form = Form.GROUPED if per_expert else Form.PARTITIONED if partitioned else Form.WHOLE_TENSOR
      if native:
        notes.append(dense_only)
    elif native:
      ineligible = native_grouped_ineligible if grouped else native_ineligible
      why = ineligible(record.site, cuda)
      if grouped and partitioned:
        why = "partitioned program: the grouped FP4 GEMMs are not partitioned yet"
      if why:
        notes.append(f"{why}: emulated")
      else:
        form = Form.PACKED_GROUPED if grouped else Form.PACKED
    elif (partitioned and packed and not grouped and native_ineligible(record.site, cuda) is None
          and (source is None or source.kind is BlockIndex.UNAVAILABLE) and not record.site.weight_replicated):
      # Packed operands pay where the partitioner gathers them; a weight every device holds whole is not gathered,
      # and there the packed form only adds its dequantized copies (docs/design.md §8).
      form = Form.PACKED
    if d.kept_recipes is not None and form not in DENSE:
      notes.append("kept iterations run in high precision (MXFP8 kept iterations take the emulated dense GEMM)")
    operands, order = _operand_plans(record.site, d, form)
    plans.append(Plan(record=record, decision=d, form=form, operands=operands, order=order, block_source=source,
                      notes=tuple(notes)))
  return plans
