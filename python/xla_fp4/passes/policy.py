"""Policy: decide per dot whether it runs in NVFP4, with which recipe per operand, and why.

Ordered rules, first match wins (Qwix style); every decision carries the rule's reason, and rules that matched no dot
are reported. The user's rules (the `rules` option: data, not code) come after the three that say what the kernels
cannot take and before the paper's policy. Defaults follow docs/design.md §2 / arXiv 2509.25149 §4: only
linear-layer GEMMs; the output head kept; about 16% of the blocks kept in high precision, weighted to the end (the
paper kept the first 2 and last 8 of 62 blocks); GEMMs whose contraction is not a multiple of 16, or that are tiny,
kept.

In a scanned layer stack one dot serves every layer: the decision there is `nvfp4` with `keep_blocks`, and the rewrite
runs per iteration either the NVFP4 GEMM or the high-precision one, on the block index (a stablehlo.case).
"""

import dataclasses
import enum
import re
from typing import Callable, Optional

from xla_fp4.config import Config, UserRule
from xla_fp4.numerics.gemm import OperandRecipe
from xla_fp4.passes.analyze import Analysis, BlockIndex, DotSite


class Verdict(enum.StrEnum):
  KEEP = "keep"  # the original dot, in the program's precision
  NVFP4 = "nvfp4"  # quantized operands per the recipe


class Form(enum.StrEnum):
  """The pattern an NVFP4 dot is rewritten into (rewrite.py's docstring shows the IR)."""
  WHOLE_TENSOR = "whole_tensor"  # one kernel per operand measures it (amax, key) and returns q·scale; one device
  PARTITIONED = "partitioned"  # per-block maxima, a plain max reduction (XLA's all-reduce), then the qdq kernel
  PACKED = "packed"  # packed FP4 operands and the FP4 GEMM (the native backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  name: str
  decision: Verdict
  reason: str
  when: Callable[[DotSite, "Context"], bool]


@dataclasses.dataclass(frozen=True)
class Context:
  config: Config
  num_blocks: int
  kept_blocks: frozenset


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
  index: int
  decision: Verdict
  rule: str
  reason: str
  lhs: Optional[OperandRecipe] = None
  rhs: Optional[OperandRecipe] = None
  keep_blocks: tuple = ()  # scanned stacks: block indices that run the high-precision dot


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """How one NVFP4 dot is rewritten: its decision (recipe per operand), the form of the pattern and, where kept blocks
  of a scanned stack select per iteration, where the block index comes from."""
  site: DotSite
  decision: Decision
  form: Form
  block_index: Optional[BlockIndex]  # None: no per-iteration select
  notes: tuple = ()  # what the report adds to the decision's reason (a fallback and why)


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
  """The rules in order: what the kernels cannot take, the user's rules (config.rules), the paper's policy."""
  exclude = re.compile(config.exclude) if config.exclude else None
  return (
      Rule(name="not_linear", decision=Verdict.KEEP, reason="not a linear-layer GEMM (no operand is a parameter)",
           when=lambda s, c: s.role == "other"),
      Rule(name="dtype", decision=Verdict.KEEP,
           reason="operands are not float32, bfloat16 or float16 (what the kernels take)",
           when=lambda s, c: not set(s.operand_dtypes) <= QUANTIZABLE_DTYPES),
      Rule(name="contraction_not_16", decision=Verdict.KEEP, reason="contraction size is not a multiple of 16",
           when=lambda s, c: s.k % 16 != 0),
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
           when=lambda s, c: min(s.m, s.n, s.k) < c.config.min_dim),
      Rule(name="head", decision=Verdict.KEEP, reason="output head (logits) kept in high precision",
           when=lambda s, c: s.is_head and c.config.keep_head),
      Rule(name="high_precision_block", decision=Verdict.KEEP,
           reason="block kept in high precision (XLA_FP4_KEEP_FIRST/LAST)",
           when=lambda s, c: s.block is not None and s.block in c.kept_blocks),
      Rule(name="nvfp4", decision=Verdict.NVFP4, reason="linear layer", when=lambda s, c: True),
  )


def recipe_for(site: DotSite, config: Config):
  """Per-operand recipe of docs/design.md §2's table. JAX's transpose rule emits dot_general(g, other): the gradient is
  the non-weight operand of a dgrad and the lhs of a wgrad."""
  sr = "stochastic" if config.stochastic_rounding else "nearest"
  weight = OperandRecipe(block_2d=config.weights_2d)
  if site.role == "fprop":
    act = OperandRecipe()
    return (weight, act) if site.weight_operand == 0 else (act, weight)
  if site.role == "dgrad":
    grad = OperandRecipe(rounding=sr)
    return (weight, grad) if site.weight_operand == 0 else (grad, weight)
  return (OperandRecipe(rounding=sr, rht=config.rht), OperandRecipe(rht=config.rht))


def decide(analysis: Analysis, config: Config, rules=None):
  """Returns ([Decision] in site order, [names of rules that matched nothing])."""
  rules = default_rules(config) if rules is None else rules
  ctx = Context(config=config, num_blocks=analysis.num_blocks,
                kept_blocks=kept_blocks(config, analysis.num_blocks))
  used, decisions = set(), []
  for site in analysis.sites:
    rule = next(r for r in rules if r.when(site, ctx))
    used.add(rule.name)
    if rule.decision is Verdict.KEEP:
      reason = rule.reason + (f": {site.head_reason}" if rule.name == "head" and site.head_reason else "")
      decisions.append(Decision(index=site.index, decision=Verdict.KEEP, rule=rule.name, reason=reason))
      continue
    lhs, rhs = recipe_for(site, config)
    keep_blocks = ()
    reason = rule.reason
    # Kept blocks select per iteration under the built-in rule only: a user's nvfp4 rule comes before the kept blocks'
    # rule, so every iteration runs in NVFP4, as the same blocks would unscanned.
    builtin = rule.name == "nvfp4"
    if builtin and site.index in analysis.block_values:
      first = site.block_offset or 0  # the stack's blocks, numbered from its first layer
      keep_blocks = tuple(sorted(b - first for b in ctx.kept_blocks if first <= b < first + (site.num_stacked or 0)))
      if keep_blocks:
        reason += f"; scanned stack: blocks {list(keep_blocks)} run the high-precision dot"
    elif builtin and site.num_stacked and ctx.kept_blocks:
      reason += "; nested scanned stack without a per-iteration block index: every iteration runs in NVFP4"
    decisions.append(Decision(index=site.index, decision=Verdict.NVFP4, rule=rule.name, reason=reason, lhs=lhs, rhs=rhs,
                              keep_blocks=keep_blocks))
  unmatched = [r.name for r in rules if r.name not in used]
  return decisions, unmatched


def native_ineligible(site: DotSite, cuda: bool) -> Optional[str]:
  """Why the packed FP4 GEMM cannot run `site`, or None. It multiplies plain matrices (free and contracting dims merge
  into M, N and K; M and N need no alignment, the scales are padded to 128x4 tiles); cuBLASLt also needs K-major rows
  of 16 bytes (K a multiple of 32)."""
  if site.batch[0]:
    return "the packed GEMM takes no batch dims"
  if cuda and site.k % 32:
    return f"cuBLASLt's FP4 GEMM needs K a multiple of 32, K={site.k}"
  return None


def plan(analysis: Analysis, decisions, *, partitioned: bool, native: bool, cuda: bool):
  """One Plan per NVFP4 decision, in program order. `native`: the backend's GEMM is the FP4 one; a dot it cannot run,
  and every dot of a partitioned program (the packed kernels have no partitioner), keeps the emulated GEMM, with a
  note saying why."""
  plans = []
  for d in decisions:
    if d.decision is not Verdict.NVFP4:
      continue
    site, notes = analysis.sites[d.index], []
    block_index = analysis.block_index[d.index] if d.keep_blocks else None
    if block_index is BlockIndex.UNAVAILABLE:
      notes.append("block index unavailable per iteration: every iteration runs in NVFP4")
    form = Form.PARTITIONED if partitioned else Form.WHOLE_TENSOR
    if native:
      why = ("partitioned program: the packed kernels have no partitioner" if partitioned else
             native_ineligible(site, cuda))
      if why:
        notes.append(f"{why}: emulated")
      else:
        form = Form.PACKED
    plans.append(Plan(site=site, decision=d, form=form, block_index=block_index, notes=tuple(notes)))
  return plans
