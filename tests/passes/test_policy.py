"""The policy on its own (synthetic sites): rule order, every rule's reason, kept blocks, scanned stacks; and
report.py."""

import dataclasses
import json

import pytest

from xla_fp4 import config, report
from xla_fp4.passes import policy
from xla_fp4.passes.analysis import (Analysis, BlockIndex, BlockSource, DotRecord, DotSite, Gemm, Grouping, Groups,
                                     Phase, Role)

CFG = config.load(environ={}, enabled=True)
_GEMM = dict(lhs_shape=(64, 64), rhs_shape=(64, 64), out_shape=(64, 64), dtype="f32", operand_dtypes=("f32", "f32"),
             m=64, n=64, k=64, flops=2 * 64 ** 3, contracting=((1,), (0,)), batch=((), ()))


def _site(index=0, is_head=False, **overrides):
  """A plain NVFP4-eligible fprop of a 64x64 layer; overrides (of its fields and its Gemm's) make it match other
  rules."""
  gemm = Gemm(**{**_GEMM, **{k: v for k, v in overrides.items() if k in _GEMM}})
  base = dict(index=index, func="main", name_stack="jit(f)/jvp(m)/fc/dot_general", layer="m/fc", phase="forward",
              role="fprop", weight_operand=1, weight_arg="p['fc']", head_reason="x" if is_head else None, gemm=gemm)
  fields = {**base, **{k: v for k, v in overrides.items() if k not in _GEMM}}
  fields["head_reason"] = (fields["head_reason"] or "x") if is_head else None
  return DotSite(**{**fields, "role": Role(fields["role"]), "phase": Phase(fields["phase"])})


def _analysis(sites, num_blocks=0, block_index=None):
  """An Analysis of `sites`; block_index: {site index: where its scanned stack's block index is (BlockIndex)}."""
  block_index = block_index or {}
  records = [DotRecord(op=None, site=s, block_source=BlockSource(block_index[s.index], None)
                       if s.index in block_index else None) for s in sites]
  return Analysis(records=records, num_blocks=num_blocks)


def _decide(sites, num_blocks=0, block_index=None, **options):
  """Synthetic sites are mostly fprops alone, a program that does not train: forward_only=True has them decided
  (test_programs_that_do_not_train_are_left_alone tests the default)."""
  options.setdefault("forward_only", True)
  return policy.decide(_analysis(sites, num_blocks, block_index), config.load(environ={}, enabled=True, **options))


# Each rule with a site that matches it *and every later rule*: the first match must win.
EVERY_LATER = dict(is_head=True, head_reason="its output reaches the loss", block=9)  # 10 blocks: 8, 9 kept
CASES = [
    ("ragged", dict(ragged=True, role="other", operand_dtypes=("f64", "f64"))),
    ("not_linear", dict(role="other", operand_dtypes=("f64", "f64"))),
    ("dtype", dict(operand_dtypes=("f64", "f64"))),
    ("contraction_not_16", dict(k=24, m=8, higher_order=True, excluded_scope=True)),
    ("forward_only", dict(higher_order=True, excluded_scope=True)),
    ("higher_order", dict(higher_order=True, excluded_scope=True)),
    ("exclude_scope", dict(excluded_scope=True)),
    ("exclude_regex", dict(layer="m/router")),
    ("tiny", dict(m=8)),
    ("head", dict()),
    ("high_precision_block", dict(is_head=False)),
    ("nvfp4", dict(is_head=False, block=5)),
]


@pytest.mark.parametrize("rule,overrides", CASES, ids=[c[0] for c in CASES])
def test_first_matching_rule_wins_with_its_reason(rule, overrides):
  rules = {r.name: r for r in policy.default_rules(config.load(environ={}, enabled=True, exclude="router"))}
  names = [c[0] for c in CASES]
  # Everything a later rule looks at is set to match (the layer path matches XLA_FP4_EXCLUDE up to that rule); only
  # the earlier rules' triggers are absent.
  layer = "m/router" if names.index(rule) <= names.index("exclude_regex") else "m/fc"
  site = _site(**{**EVERY_LATER, "layer": layer, **overrides})
  # The program trains nowhere (one fprop): forward_only's trigger is the option left off.
  forward_only = names.index(rule) > names.index("forward_only")
  (d,), _ = _decide([site], num_blocks=10, exclude="router", forward_only=forward_only)
  assert d.rule == rule, d
  reason = rules[rule].reason + (": its output reaches the loss" if rule == "head" else "")
  assert d.reason == reason
  assert (d.decision == "nvfp4") == (rule == "nvfp4") and (d.lhs is None) == (rule != "nvfp4")


def test_rule_order_is_the_documented_one():
  assert [r.name for r in policy.default_rules(CFG)] == [c[0] for c in CASES] == list(config.BUILTIN_RULES)


def test_programs_that_do_not_train_are_left_alone():
  """By default only a program with a backward pass through a linear layer (a dgrad or a wgrad) is rewritten: an eval
  step, init or an eager matmul keeps every dot, with the reason; XLA_FP4_FORWARD_ONLY=1 rewrites them too."""
  fprops = [_site(0), _site(1, layer="m/fc2")]
  decided, _ = _decide(fprops, forward_only=False)
  assert {(d.rule, d.decision) for d in decided} == {("forward_only", "keep")}
  assert "no backward pass" in decided[0].reason and "XLA_FP4_FORWARD_ONLY=1" in decided[0].reason
  assert {d.decision for d in _decide(fprops, forward_only=True)[0]} == {"nvfp4"}
  training = fprops + [_site(2, role="wgrad", weight_operand=None)]
  assert {d.decision for d in _decide(training, forward_only=False)[0]} == {"nvfp4"}


def test_the_roles_a_user_rule_names_are_the_analysis_roles():
  """config.ROLES (config cannot import the pass) must be analysis.Role without `other` (never rewritten)."""
  from xla_fp4.passes.analysis import Role
  assert set(config.ROLES) == {r.value for r in Role} - {"other"}


USER_RULES = [{"layer": "attn", "role": ["wgrad", "dgrad"], "decision": "keep", "name": "attn_grads"},
              {"block": [0, 1], "decision": "nvfp4", "reason": "first blocks in NVFP4 after all"},
              {"layer": "^m/head$", "decision": "nvfp4"}]


def test_user_rules_run_first_after_what_the_pass_cannot_take_and_leaves_alone():
  rules = [r.name for r in policy.default_rules(config.load(environ={}, enabled=True, rules=USER_RULES))]
  assert rules[:5] == ["ragged", "not_linear", "dtype", "contraction_not_16", "forward_only"] == \
      list(config.BEFORE_USER_RULES)
  assert rules[5:8] == ["attn_grads", "user_rule_1", "user_rule_2"] and rules[8:] == list(config.BUILTIN_RULES[5:])
  sites = [_site(0, layer="m/attn/q", role="wgrad", weight_operand=None),  # attn_grads
           _site(1, layer="m/attn/q"),                                     # an fprop: not attn_grads; policy
           _site(2, layer="m/fc", block=0),                                # a kept first block, forced to NVFP4
           _site(3, layer="m/head", is_head=True, head_reason="x"),        # the head, forced to NVFP4
           _site(4, layer="m/attn/k", role="dgrad", k=24),                 # the kernels' limits still come first
           _site(5, layer="m/fc", block=3)]                                # a kept last block: the policy's
  decided, unmatched = _decide(sites, num_blocks=4, keep_first=1, keep_last=1, rules=USER_RULES)
  assert [(d.rule, d.decision) for d in decided] == [
      ("attn_grads", "keep"), ("nvfp4", "nvfp4"), ("user_rule_1", "nvfp4"), ("user_rule_2", "nvfp4"),
      ("contraction_not_16", "keep"), ("high_precision_block", "keep")]
  assert decided[0].reason == "user rule attn_grads (layer='attn', role=['wgrad', 'dgrad'])"
  assert decided[2].reason == "first blocks in NVFP4 after all" and decided[2].lhs is not None
  assert "attn_grads" not in unmatched


def test_user_rules_from_the_environment_are_json():
  cfg = config.load(environ={"XLA_FP4_RULES": '[{"layer": "attn", "decision": "keep"}]'}, enabled=True)
  assert cfg.rules == (config.UserRule(name="user_rule_0", decision="keep", reason="user rule user_rule_0 "
                                       "(layer='attn')", layer="attn"),)


@pytest.mark.parametrize("rules,message", [
    ("[{", "not a JSON list"),
    ({"decision": "keep"}, "a list of rules"),
    (["keep"], "each rule is a dict"),
    ([{"decision": "drop"}], "'decision' must be 'keep' or a format \(nvfp4, mxfp4, mxfp8\)"),
    ([{"decision": "keep", "layers": "x"}], "unknown key"),
    ([{"decision": "keep", "layer": "("}], "not a valid regular expression"),
    ([{"decision": "keep", "role": "forward"}], "'role' must be one or a list of"),
    ([{"decision": "keep", "block": -1}], "'block' must be a block number"),
    ([{"decision": "keep", "name": "head"}], "used twice or by a built-in rule"),
])
def test_bad_user_rules_say_what_is_wrong(rules, message):
  with pytest.raises(ValueError, match=message):
    config.load(environ={}, enabled=True, rules=rules)


def test_recipes_per_role():
  """docs/design.md §2: weights 16x16 nearest; activations 1x16 nearest; gradients stochastic; wgrad through the RHT."""
  sites = [_site(0), _site(1, role="dgrad", weight_operand=1), _site(2, role="wgrad", weight_operand=None)]
  decided, _ = _decide(sites)
  fprop, dgrad, wgrad = ((d.lhs, d.rhs) for d in decided)
  assert fprop[1].block_2d and not fprop[0].block_2d and fprop[0].rounding == fprop[1].rounding == "nearest"
  assert dgrad[0].rounding == "stochastic" and dgrad[1].block_2d and dgrad[1].rounding == "nearest"
  assert wgrad[0].rht and wgrad[1].rht and wgrad[0].rounding == "stochastic" and wgrad[1].rounding == "nearest"


@pytest.mark.parametrize("num_blocks,first,last", [(62, 2, 8), (12, 0, 2), (4, 0, 1), (3, 0, 0)])
def test_kept_blocks_follow_the_paper(num_blocks, first, last):
  """round(16%) of the blocks, 1:4 first:last: 62 blocks keep the first 2 and the last 8, as arXiv 2509.25149 §4."""
  kept = policy.kept_blocks(CFG, num_blocks)
  assert kept == set(range(first)) | set(range(num_blocks - last, num_blocks))


def test_a_scanned_stack_keeps_its_share_of_the_global_blocks():
  """An encoder (blocks 0-5, static) and a scanned decoder (blocks 6-11): the decoder's dot keeps its local blocks 4
  and 5 (global 10 and 11) per iteration."""
  scanned = _site(0, num_stacked=6, block_offset=6)
  (d,), _ = _decide([scanned], num_blocks=12, block_index={0: BlockIndex.IN_SCOPE})
  assert d.decision == "nvfp4" and d.keep_blocks == (4, 5)
  assert "iterations [4, 5] (blocks [10, 11]) run the high-precision dot" in d.reason


def test_a_scanned_unit_of_several_layers_keeps_its_layers_own_iterations():
  """Llama 4 scans 4 decoder layers per iteration: 2 iterations are blocks 0-7, and the third layer of the unit is
  blocks 2 and 6. Keeping the last block (7) keeps the last iteration of the unit's fourth layer only."""
  third, fourth = (_site(i, num_stacked=2, block_offset=i + 2, block_stride=4) for i in (0, 1))
  (a, b), _ = _decide([third, fourth], num_blocks=8, keep_first=0, keep_last=1,
                      block_index={0: BlockIndex.IN_SCOPE, 1: BlockIndex.IN_SCOPE})
  assert a.keep_blocks == () and b.keep_blocks == (1,), (a, b)
  assert "iterations [1] (blocks [7])" in b.reason


def test_unmatched_rules_are_reported():
  _, unmatched = _decide([_site()])
  assert "nvfp4" not in unmatched and {"not_linear", "head", "tiny"} <= set(unmatched)


# ------------------------------------------------------------------------------------------------------ report.py


def _rows():
  sites = [_site(0), _site(1, role="other", flops=100, lhs_shape=(8, 16), rhs_shape=(16, 8))]
  decided, unmatched = _decide(sites)
  return report.rows(sites, decided, {0: "a note"}), unmatched


def test_rows_carry_decision_recipe_and_notes():
  rows, _ = _rows()
  assert rows[0]["decision"] == "nvfp4" and rows[0]["recipe"] == {"lhs": "1d+rn", "rhs": "2d+rn"}
  assert rows[0]["reason"] == "linear layer; a note"
  assert rows[1]["decision"] == "keep" and rows[1]["recipe"] is None and rows[1]["rule"] == "not_linear"
  json.dumps(rows)  # the dump format


def test_table_rendering():
  rows, unmatched = _rows()
  text = report.table(rows, unmatched, title="jit_step", backend={"kernels": "cpu FFI kernels", "gemm": "emulate",
                                                                   "gemm_reason": "auto: no FP4 tensor cores"})
  lines = text.splitlines()
  assert lines[0] == "== jit_step"
  assert lines[1].split() == ["#", "layer", "role", "block", "lhs", "rhs", "decision", "recipe", "(lhs", "|", "rhs)",
                              "reason"]
  assert lines[3].split()[:7] == ["0", "m/fc", "fprop", "64x64", "64x64", "nvfp4", "1d+rn"]
  share = 100 * rows[0]["flops"] / (rows[0]["flops"] + 100)
  assert f"1/2 dots in NVFP4, {share:.1f}% of dot FLOPs" in text
  assert "rules that matched nothing: " in text and "kernels: cpu FFI kernels; GEMM: emulate (auto: no FP4" in text


def test_report_of_an_empty_dump_dir_says_what_to_do(tmp_path):
  with pytest.raises(FileNotFoundError, match="run with XLA_FP4_DUMP_DIR="):
    report.load(str(tmp_path))


def test_dumps_round_trip(tmp_path):
  rows, unmatched = _rows()
  payload = {"module": "jit_step", "backend": None, "decisions": rows, "unmatched_rules": unmatched}
  (tmp_path / "0000_jit_step.decisions.json").write_text(json.dumps(payload))
  assert [r["module"] for r in report.load_decisions(str(tmp_path))] == ["0000_jit_step"] * 2
  assert report.nvfp4_flop_share(str(tmp_path)) == pytest.approx(rows[0]["flops"] / (rows[0]["flops"] + 100))


def test_flop_share_counts_the_kept_layers_of_a_scanned_stack_as_high_precision():
  row = dict(decision="nvfp4", flops=800, keep_blocks=[6, 7], num_stacked=8)
  assert report.quantized_flops(row) == 600
  assert report.quantized_flops(dict(row, decision="keep")) == 0 and report.quantized_flops(dict(row, keep_blocks=[])) == 800


def test_plan_gives_each_nvfp4_dot_its_form_and_block_index():
  """policy.plan: whole tensors on one device, the partitioned form in a partitioned program, the packed form where
  the native GEMM can run it (else emulated, with the reason); a scanned stack's block index as the analysis found
  it."""
  sites = [_site(0), _site(1, batch=((0,), (0,))), _site(2, num_stacked=4, block_offset=0, k=48),
           _site(3, num_stacked=4, block_offset=0), _site(4, role="other")]
  analysis = _analysis(sites, 4, {2: BlockIndex.PASSED_IN, 3: BlockIndex.UNAVAILABLE})
  decided, _ = policy.decide(analysis, config.load(environ={}, enabled=True, keep_first=0, keep_last=1,
                                                   forward_only=True))
  assert [d.decision for d in decided] == [policy.Verdict.NVFP4] * 4 + [policy.Verdict.KEEP]

  def forms(**kw):
    return [(p.site.index, p.form, p.block_source and p.block_source.kind, p.notes)
            for p in policy.plan(analysis, decided, **kw)]
  unavailable = "block index unavailable per iteration: every iteration runs in NVFP4"
  assert forms(partitioned=False, native=False, cuda=False) == [
      (0, policy.Form.WHOLE_TENSOR, None, ()), (1, policy.Form.WHOLE_TENSOR, None, ()),
      (2, policy.Form.WHOLE_TENSOR, BlockIndex.PASSED_IN, ()), (3, policy.Form.WHOLE_TENSOR, BlockIndex.UNAVAILABLE,
                                                                  (unavailable,))]
  assert [f[1] for f in forms(partitioned=True, native=False, cuda=False)] == [policy.Form.PARTITIONED] * 4
  native = forms(partitioned=False, native=True, cuda=True)
  assert [f[1] for f in native] == [policy.Form.PACKED, policy.Form.WHOLE_TENSOR, policy.Form.WHOLE_TENSOR,
                                    policy.Form.PACKED]
  assert native[1][3] == ("the packed GEMM takes no batch dims: emulated",)
  assert native[2][3] == ("cuBLASLt's FP4 GEMM needs K a multiple of 32, K=48: emulated",)
  # Partitioned, the packed form partitions (sharding/packed.py): the same forms as on one device, with the
  # partitioned qdq where the one device quantizes whole tensors.
  partitioned_native = [f[1] for f in forms(partitioned=True, native=True, cuda=False)]
  assert partitioned_native == [policy.Form.PARTITIONED if f[1] is policy.Form.WHOLE_TENSOR else f[1]
                                for f in forms(partitioned=False, native=True, cuda=False)]
  assert policy.Form.PACKED in partitioned_native
  # The emulate backend moves packed operands with packed_gathers, except where kept blocks select per iteration.
  emulate_packed = forms(partitioned=True, native=False, cuda=False, packed=True)
  assert emulate_packed[0][1] is policy.Form.PACKED
  assert emulate_packed[2][1:3] == (policy.Form.PARTITIONED, BlockIndex.PASSED_IN)
  # ... and where every device holds the dot's weight whole (data parallelism): nothing to gather.
  whole = _analysis([_site(0, weight_replicated=True)])
  decided_whole, _ = policy.decide(whole, config.load(environ={}, enabled=True, keep_first=0, keep_last=0,
                                                      forward_only=True))
  assert [p.form for p in policy.plan(whole, decided_whole, partitioned=True, native=False, cuda=False,
                                      packed=True)] == [policy.Form.PARTITIONED]


def test_operand_plans_say_what_each_operand_is_and_in_which_order_it_is_quantized():
  """fprop: activation and weight, in operand order, K of the activation follows the dot. dgrad: the gradient
  first, then the weight after it (ordered by its scale), quantized anew where every device holds it whole in a
  partitioned program. wgrad: the gradient (lhs) first, the activation after it; no operand's K follows the dot."""
  sites = [_site(0), _site(1, role="dgrad", weight_operand=0, weight_replicated=True),
           _site(2, role="wgrad", weight_operand=None), _site(3, role="dgrad", weight_operand=1)]
  decided, _ = _decide(sites)

  def operands(partitioned):
    return [(p.order, [(o.kind, o.k_follows_dot, o.fresh, o.after_gradient, o.salt_id) for o in p.operands])
            for p in policy.plan(_analysis(sites), decided, partitioned=partitioned, native=False, cuda=False)]
  A, W, G = policy.Operand.ACTIVATION, policy.Operand.WEIGHT, policy.Operand.GRADIENT
  assert operands(partitioned=True) == [
      ((0, 1), [(A, True, False, False, 0), (W, False, False, False, 1)]),
      ((1, 0), [(W, False, True, True, 2), (G, True, False, False, 3)]),
      ((0, 1), [(G, False, False, False, 4), (A, False, False, True, 5)]),
      ((0, 1), [(G, True, False, False, 6), (W, False, False, True, 7)])]
  # One device: a replicated weight is reused like any other (whole tensors hold no sharded copy to re-gather).
  assert not any(o[2] for _, ops in operands(partitioned=False) for o in ops)
  plans = policy.plan(_analysis(sites), decided, partitioned=False, native=False, cuda=False)
  assert [o.recipe for o in plans[2].operands] == [decided[2].lhs, decided[2].rhs]


def test_expert_gemms_take_the_grouped_forms():
  """A dot with Groups (analysis/ragged.py) is planned in the grouped form, partitioned or not; under the native
  backend, on one device, as the FP4 GEMM once per expert where it has one group dim and no other batch dim, as the
  grouped FP4 GEMM where it is a chlo.ragged_dot of tokens [M, K] and one matrix per group, else emulated with the
  reason. A wgrad's gradient operand is the one the analysis found."""
  groups = Groups(kind=Grouping.SLICES, lhs=(0,), rhs=(0,), k=48)
  ragged = dict(groups=dataclasses.replace(groups, kind=Grouping.RAGGED_ROWS, lhs=(0,), k=64), lhs_shape=(96, 64),
                contracting=((1,), (1,)))
  sites = [_site(0, groups=groups, batch=((0,), (0,))),
           _site(1, role="wgrad", weight_operand=None, gradient_operand=1, groups=groups),
           _site(2, rhs_shape=(4, 64, 32), **ragged),
           _site(3, **ragged)]
  decided, _ = _decide(sites)

  def plans(**kw):
    return [(p.form, p.notes) for p in policy.plan(_analysis(sites), decided, **kw)]
  G, P = policy.Form.GROUPED, policy.Form.PACKED_GROUPED
  assert plans(partitioned=False, native=False, cuda=False) == [(G, ())] * 4
  assert plans(partitioned=True, native=False, cuda=False) == [(G, ())] * 4
  assert plans(partitioned=False, native=True, cuda=False) == [
      (P, ()), (P, ()), (P, ()),
      (G, ("the grouped FP4 GEMM takes tokens [M, K] and one matrix per group: emulated",))]
  assert plans(partitioned=False, native=True, cuda=True)[:3] == [
      (G, ("cuBLASLt's FP4 GEMM needs K a multiple of 32, K=48: emulated",))] * 2 + [(P, ())]
  assert plans(partitioned=True, native=True, cuda=False)[0] == (
      G, ("partitioned program: the grouped FP4 GEMMs are not partitioned yet: emulated",))
  dense = [_site(0, groups=Groups(kind=Grouping.SLICES, lhs=(), rhs=(), k=64, free=((1, 0),)), rhs_shape=(4, 64, 32))]
  decided_dense, _ = _decide(dense)
  assert [(p.form, p.notes) for p in policy.plan(_analysis(dense), decided_dense, partitioned=False, native=True,
                                                 cuda=False)] == [
      (G, ("an expert dim free in one operand (every token meets every expert): no per-expert FP4 GEMM form: "
           "emulated",))]
  wgrad = policy.plan(_analysis(sites), decided, partitioned=False, native=False, cuda=False)[1]
  A, Gr = policy.Operand.ACTIVATION, policy.Operand.GRADIENT
  assert [o.kind for o in wgrad.operands] == [A, Gr] and wgrad.order == (1, 0)
  assert decided[1].rhs.rounding == "stochastic" and decided[1].lhs.rounding == "nearest"


def test_a_ragged_dot_of_another_form_is_kept():
  (d,), _ = _decide([_site(0, ragged=True, groups=None)])
  assert (d.decision, d.rule) == ("keep", "ragged")


def test_a_users_nvfp4_rule_puts_every_iteration_of_a_scanned_stack_in_nvfp4():
  """As for unscanned blocks, a user's nvfp4 rule comes before the kept blocks' rule."""
  def stack():
    return [_site(0, num_stacked=4, block_offset=0, layer="m/mlp")]
  (policy_default,), _ = _decide(stack(), num_blocks=4, block_index={0: BlockIndex.IN_SCOPE}, keep_last=1)
  assert policy_default.rule == "nvfp4" and policy_default.keep_blocks == (3,)
  (users,), _ = _decide(stack(), num_blocks=4, block_index={0: BlockIndex.IN_SCOPE}, keep_last=1,
                        rules=[{"layer": "mlp", "decision": "nvfp4"}])
  assert users.rule == "user_rule_0" and users.keep_blocks == () and users.decision == "nvfp4"
