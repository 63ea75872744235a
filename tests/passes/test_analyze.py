"""The analysis on a matrix of training steps (tests/passes/models.py): roles, layer paths, blocks, heads, scans.

Each model is a real gradient step (loss -> jax.grad, mostly with an optax update) lowered to StableHLO exactly as
jax.jit hands it to the compile hook. The expected counts follow from the model: a linear layer gives one fprop, one
wgrad and one dgrad (no dgrad where the layer's input is not differentiated: the first layer of an MLP fed the batch);
attention QK^T and scores.V are `other` (2 forward and 4 backward dots per block).
"""

import collections
import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir

import models
from xla_fp4.passes import analysis
from xla_fp4.passes.analysis.names import path_from_arg

N = 2  # transformer blocks
LINEAR = ("q", "k", "v", "o", "fc1", "fc2")


@functools.lru_cache(maxsize=None)
def _analysis(builder, **kwargs):
  fn, args = getattr(models, builder)(**kwargs)
  module = jax.jit(fn).lower(*args).compiler_ir("stablehlo")
  with module.context:
    return module, analysis.analyze(module)


def _roles(a):
  return dict(collections.Counter(s.role for s in a.sites))


def _by_layer(a):
  out = collections.defaultdict(list)
  for s in a.sites:
    if s.role != "other":
      out[s.layer].append(s.role)
  return {k: sorted(v) for k, v in out.items()}


def _func_of(value_or_op):
  """The name of the function that holds a value or an op."""
  op = value_or_op
  if isinstance(op, ir.Value):
    op = op.owner.owner if isinstance(op.owner, ir.Block) else op.owner
  op = op.operation if hasattr(op, "operation") else op
  while op.name != "func.func":
    op = op.parent
  return ir.StringAttr(op.attributes["sym_name"]).value


def _check_consistent(a):
  """Every linear dot's weight argument names its layer, and each layer's dots share one weight."""
  weights = collections.defaultdict(set)
  for s in a.sites:
    if s.role == "other":
      assert s.weight_arg is None and s.weight_operand is None and not s.is_head
      continue
    weights[s.layer].add(s.weight_arg)
    assert path_from_arg(s.weight_arg).split("/")[-1] in s.layer, s
    assert (s.weight_operand is None) == (s.role == "wgrad"), s
  assert all(len(w) == 1 for w in weights.values()), weights


def _in_scan_body(a, s):
  """jax 0.10 outlines scan bodies into functions called from a while body; jax 0.12 inlines them into it."""
  op = a.records[s.index].op.parent
  while op is not None:
    if op.name == "stablehlo.while":
      return True
    op = op.parent
  return s.func != "main"


def _check_block_sources(a, module, num_stacked):
  """In a scanned stack every linear dot of a scan body has its per-iteration layer index, visible at its entry."""
  with module.context:
    for s in a.sites:
      if s.role == "other" or not _in_scan_body(a, s):
        continue
      assert s.num_stacked == num_stacked and s.block is None, s
      source = a.records[s.index].block_source
      assert source is not None, s
      value, entry = source.value, source.entry_call
      assert str(value.type) in ("tensor<i32>", "tensor<i64>"), value.type  # the scan's iteration counter
      if entry is None:
        assert _func_of(value) == s.func
      else:  # the call that enters the scan body, in the function that holds the value
        assert entry.name == "func.call" and ir.FlatSymbolRefAttr(entry.attributes["callee"]).value == s.func
        assert _func_of(value) == _func_of(entry)
    assert {r.site.index for r in a.records if r.block_source} == {s.index for s in a.sites if s.role != "other" and _in_scan_body(a, s)}
  assert a.num_blocks == num_stacked


# ------------------------------------------------------------------------------------------------------------ MLPs


@pytest.mark.parametrize("builder,kwargs,prefix,head", [
    ("linen_mlp", {}, "LinenMLP/", "head"),
    ("linen_mlp", {"dtype": jnp.bfloat16}, "LinenMLP/", "head"),
    ("nnx_mlp", {}, "", "head"),  # fc1/fc2 under jax.named_scope("trunk"): see test_nnx_named_scope
    ("jax_mlp", {}, "", "layer_2"),
    ("jax_mlp", {"dtype": jnp.bfloat16}, "", "layer_2"),
], ids=["linen", "linen-bf16", "nnx", "jax", "jax-bf16"])
def test_mlp(builder, kwargs, prefix, head):
  """The head is the layer whose output reaches the loss with no other linear layer in between, whatever its name."""
  _, a = _analysis(builder, **kwargs)
  assert _roles(a) == {"fprop": 3, "dgrad": 2, "wgrad": 3}  # the batch input has no gradient: no dgrad for layer 0
  if builder == "nnx_mlp":
    a = dataclasses.replace(a, records=[
        dataclasses.replace(r, site=dataclasses.replace(r.site, layer=r.site.layer.removeprefix("trunk/")))
        for r in a.records])
  names = ["fc1", "fc2", "head"] if head == "head" else ["layer_0", "layer_1", "layer_2"]
  first = prefix + names[0]
  assert _by_layer(a) == {**{prefix + n: ["dgrad", "fprop", "wgrad"] for n in names}, first: ["fprop", "wgrad"]}
  assert all(s.is_head == (s.layer == prefix + head) for s in a.sites)
  assert {s.head_reason for s in a.sites if s.is_head} == {
      "its output reaches the loss with no other linear layer in between"}
  # Numbered (fc1, fc2, layer_<i>) yet no blocks: D->H, H->H and H->D are no repeated subtrees.
  assert all(s.block is None for s in a.sites) and a.num_blocks == 0
  dtype = "bf16" if kwargs.get("dtype") == jnp.bfloat16 else "f32"
  assert {s.gemm.dtype for s in a.sites} == {dtype}
  _check_consistent(a)


def test_nnx_named_scope():
  """NNX: the layer is the named scope from the location plus the weight's argument path."""
  _, a = _analysis("nnx_mlp")
  assert _by_layer(a) == {"trunk/fc1": ["fprop", "wgrad"], "trunk/fc2": ["dgrad", "fprop", "wgrad"],
                          "head": ["dgrad", "fprop", "wgrad"]}
  assert {s.weight_arg for s in a.sites} == {f"state['{n}']['kernel'].value" for n in ("fc1", "fc2", "head")}


# ---------------------------------------------------------------------------------------------------- transformers


def _check_transformer(a, layers, head, remat=False):
  """layers: {layer path: block or None}; head: the head's layer path."""
  expected = {**layers, head: None}
  for layer in expected:
    roles = collections.Counter(r for s in a.sites if s.layer == layer for r in [s.role])
    assert roles["dgrad"] == 1 and roles["wgrad"] == 1, (layer, roles)
    assert roles["fprop"] in ((1, 2) if remat else (1,)), (layer, roles)
  assert set(_by_layer(a)) == set(expected)
  for s in a.sites:
    if s.role == "other":  # attention: QK^T and scores.V are batched over (batch, heads)
      assert len(s.gemm.batch[0]) == 2, s
    else:
      assert s.block == expected[s.layer], s
      assert s.is_head == (s.layer == head), s
      assert not s.gemm.batch[0], s
  others = [s for s in a.sites if s.role == "other"]
  blocks = N if all(b is not None for b in layers.values()) else 1  # a scanned stack has one body
  assert sum(s.phase == "backward" for s in others) == 4 * blocks
  fwd_other = sum(s.phase == "forward" for s in others)
  assert fwd_other == 2 * blocks if not remat else 2 * blocks <= fwd_other <= 4 * blocks
  recomputed = [s for s in a.sites if "rematted_computation" in s.name_stack]
  assert bool(recomputed) == remat
  assert all(s.phase == "forward" and s.role in ("fprop", "other") for s in recomputed)
  _check_consistent(a)


@pytest.mark.parametrize("mode", ["plain", "remat"])
@pytest.mark.parametrize("builder,prefix,head", [
    ("linen_transformer", "LinenTransformer/block_{b}/", "LinenTransformer/head"),
    # NNX locations name no modules: the layer comes from the parameter's argument name (state['layers'][b]['q']...)
    ("nnx_transformer", "layers/{b}/", "head")])
def test_transformer(builder, prefix, head, mode):
  _, a = _analysis(builder, mode=mode, num_blocks=N)
  layers = {prefix.format(b=b) + n: b for b in range(N) for n in LINEAR}
  _check_transformer(a, layers, head, remat=mode == "remat")
  assert a.num_blocks == N and not any(r.block_source for r in a.records)


def test_linen_transformer_dense_general_tied_head():
  """DenseGeneral q/k/v (3-d kernels) and o (2 contracting dims); logits = x @ embedding.T (nn.Embed.attend)."""
  _, a = _analysis("linen_transformer", general=True, tied=True, num_blocks=N)
  layers = {f"LinenTransformer/block_{b}/{n}": b for b in range(N) for n in LINEAR}
  _check_transformer(a, layers, "LinenTransformer/embed.attend")
  o = [s for s in a.sites if s.layer.endswith("/o") and s.role == "fprop"]
  assert all(len(s.gemm.contracting[0]) == 2 for s in o)
  head = [s for s in a.sites if s.is_head]
  assert {s.weight_arg for s in head} == {"params['params']['embed']['embedding']"}


def test_linen_transformer_scan():
  module, a = _analysis("linen_transformer", mode="scan", num_blocks=N)
  layers = {f"LinenTransformer/blocks/{n}": None for n in LINEAR}
  _check_transformer(a, layers, "LinenTransformer/head", remat=True)  # nn.scan(nn.remat(block))
  _check_block_sources(a, module, N)


def test_nnx_transformer_scan():
  """The documented scan-over-layers pattern: nnx.vmap creates the stacked blocks, nnx.scan(nnx.remat) applies them."""
  module, a = _analysis("nnx_transformer", mode="scan", num_blocks=N)
  layers = {f"layers/{n}": None for n in LINEAR}
  _check_transformer(a, layers, "head", remat=True)
  _check_block_sources(a, module, N)


# ------------------------------------------------------------------------------------------------------- plain JAX


@pytest.mark.parametrize("checkpoint", [False, True])
def test_lax_scan(checkpoint):
  module, a = _analysis("jax_scan_mlp", checkpoint=checkpoint)
  # With jax.checkpoint the backward body recomputes w1's dot (w2's output is not needed by the backward).
  assert _roles(a) == {"fprop": 3 if checkpoint else 2, "dgrad": 2, "wgrad": 2}
  assert _by_layer(a) == {"layers/w1": sorted(["dgrad", "fprop", "wgrad"] + (["fprop"] if checkpoint else [])),
                          "layers/w2": ["dgrad", "fprop", "wgrad"]}
  _check_consistent(a)
  _check_block_sources(a, module, 4)


def test_nested_scan():
  """A scan over groups of a scan over layers: the flat layer index (group * per_group + layer) is no value of the
  program, so the analysis records the whole stack size and no per-iteration value: the rewrite then runs every
  iteration in NVFP4 (high-precision blocks cannot be selected inside nested scans)."""
  _, a = _analysis("jax_nested_scan", groups=3, per_group=2)
  assert _roles(a) == {"fprop": 1, "dgrad": 1, "wgrad": 1}
  assert all(s.num_stacked == 6 and s.block is None for s in a.sites)
  assert not any(r.block_source for r in a.records) and a.num_blocks == 6


def test_nested_jit():
  """A jitted layer called inside the step: every dot sits in its own outlined function."""
  _, a = _analysis("jax_nested_jit")
  assert _roles(a) == {"fprop": 2, "dgrad": 1, "wgrad": 2}
  assert all(s.func != "main" for s in a.sites)
  blocks = {(s.role, s.block) for s in a.sites}
  assert blocks == {("fprop", 0), ("fprop", 1), ("dgrad", 1), ("wgrad", 1), ("wgrad", 0)}
  assert {s.layer.split("/")[-1] for s in a.sites} == {"layer_0", "layer_1"}
  _check_consistent(a)


def test_custom_vjp():
  """A hand-written backward (g @ w.T, x.T @ g) has no forward partner: its dots stay `other`, even the one that reads
  the weight. The forward GEMM is an ordinary linear-layer fprop."""
  _, a = _analysis("jax_custom_vjp")
  fwd = [s for s in a.sites if s.phase == "forward"]
  bwd = [s for s in a.sites if s.phase == "backward"]
  assert [s.role for s in fwd] == ["fprop", "fprop"] and [s.layer for s in fwd] == ["layer_0", "layer_1"]
  assert len(bwd) == 3 and all(s.role == "other" and s.weight_arg is None for s in bwd)


def test_einsum():
  """'bsd,dhk->bshk', 'bshk,hkd->bsd' (two contracting dims) and per-expert 'etd,edf->etf' (a batch dim)."""
  _, a = _analysis("jax_einsum")
  assert _by_layer(a) == {"wq": ["fprop", "wgrad"], "wo": ["dgrad", "fprop", "wgrad"],
                          "experts": ["dgrad", "fprop", "wgrad"]}
  assert all(s.role != "other" for s in a.sites)
  wo = next(s for s in a.sites if s.layer == "wo" and s.role == "fprop")
  assert wo.gemm.contracting == ((2, 3), (0, 1)) and wo.gemm.k == 32
  experts = [s for s in a.sites if s.layer == "experts"]
  assert all(s.gemm.batch[0] == (0,) for s in experts)
  _check_consistent(a)


_SHARD_MAP_SCRIPT = """
import json, jax, models
from xla_fp4.passes import analysis
assert len(jax.devices()) == 4
fn, args = models.jax_shard_map()
module = jax.jit(fn).lower(*args).compiler_ir("stablehlo")
assert "sdy.manual_computation" in str(module)
with module.context:
  a = analysis.analyze(module)
print(json.dumps([[s.role, s.layer, s.block, s.weight_arg] for s in a.sites]))
"""


def test_shard_map():
  """A data-parallel step under shard_map on 4 host devices (a subprocess: the device count is fixed at backend start,
  and the other tests want the default). The body is an sdy.manual_computation region the tracer passes through."""
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"),
             PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(analysis.__file__)) + "/../.."] +
                                        sys.path))
  out = subprocess.run([sys.executable, "-c", _SHARD_MAP_SCRIPT], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  sites = json.loads(out.stdout.strip().splitlines()[-1])
  assert sorted(map(tuple, sites)) == sorted([
      ("fprop", "layer_0", 0, "p['layer_0']['w']"), ("wgrad", "layer_0", 0, "p['layer_0']['w']"),
      ("fprop", "layer_1", 1, "p['layer_1']['w']"), ("dgrad", "layer_1", 1, "p['layer_1']['w']"),
      ("wgrad", "layer_1", 1, "p['layer_1']['w']")])


# --------------------------------------------------------------------------------- probes: decisions from dataflow


def test_misleading_names_do_not_decide():
  """The head is found by dataflow (`classifier`, not `patch_embed` or `multihead_*`); one numbered module (`mlp_h_0`)
  is no block, while the two attention modules, which hold the same layers, are blocks 0 and 1."""
  _, a = _analysis("probe_classifier")
  linear = {s.layer.removeprefix("ProbeClassifier/"): s for s in a.sites if s.role != "other"}
  assert {k for k, s in linear.items() if s.is_head} == {"classifier"}
  assert {k: s.block for k, s in linear.items() if s.block is not None} == {
      f"multihead_{i}/{p}": i for i in range(2) for p in ("query", "key", "value", "out")}
  assert a.num_blocks == 2 and linear["mlp_h_0"].block is None and linear["patch_embed"].block is None


def test_blocks_run_across_stacks_in_network_order():
  """An encoder and a decoder of 6 blocks each: 12 blocks, numbered encoder first; the policy's last blocks are the
  decoder's last, not the middle of the network (encoder/layers_5)."""
  from xla_fp4 import config
  from xla_fp4.passes import policy
  _, a = _analysis("probe_encoder_decoder")
  assert a.num_blocks == 12
  blocks = {s.layer.removeprefix("ProbeEncoderDecoder/"): s.block for s in a.sites if s.role != "other"}
  assert blocks["encoder/layers_0/fc1"] == 0 and blocks["encoder/layers_5/fc2"] == 5
  assert blocks["decoder/layers_0/fc1"] == 6 and blocks["decoder/layers_5/fc2"] == 11 and blocks["out"] is None
  decided, _ = policy.decide(a, config.load(environ={}, enabled=True))
  kept = {a.sites[d.index].layer.split("/", 1)[1].rsplit("/", 1)[0] for d in decided
          if d.rule == "high_precision_block"}
  assert kept == {"decoder/layers_4", "decoder/layers_5"}  # round(16% of 12) = 2, both at the end


def _decided_for(fn, *args):
  """The pipeline's decision rows (call sites specialized, as the compile hook sees it) of a jitted program."""
  from xla_fp4 import config
  from xla_fp4.passes import pipeline
  rows, _, _ = pipeline.decisions(fn.lower(*args).compiler_ir("stablehlo"), config.load(environ={}, enabled=True))
  return rows


def _decided(builder):
  fn, args = getattr(models, builder)()
  return _decided_for(fn, *args)


def test_a_helper_shared_by_every_layer_is_analysed_per_call_site():
  """8 layers through one jitted `dense`: 8 layers, each with its weight, block and decision (the pipeline gives each
  call site its own copy of the function); the last is the head."""
  rows = _decided("probe_shared_helper")
  roles = collections.Counter((r["layer"], r["role"]) for r in rows)
  layers = [f"dense/{i}" for i in range(8)]
  assert roles == {**{(l, "fprop"): 1 for l in layers}, **{(l, "wgrad"): 1 for l in layers},
                   **{(l, "dgrad"): 1 for l in layers[1:]}}, roles
  assert {r["layer"]: r["block"] for r in rows} == {l: i for i, l in enumerate(layers)}
  assert {r["layer"] for r in rows if r["rule"] == "head"} == {"dense/7"}
  assert {r["layer"] for r in rows if r["decision"] == "nvfp4"} == set(layers[:7])


def test_the_backward_of_an_activation_product_stays_high_precision():
  """`mm` serves a linear layer and h @ h.T: the product's backward dots read no weight and no layer's activation
  and gradient pair, so they stay `other` (kept); the linear uses of w get fprop, dgrad and wgrad."""
  rows = _decided("probe_activation_product")
  other = [r for r in rows if r["role"] == "other"]
  assert len(other) == 3 and all(r["decision"] == "keep" for r in other), rows  # h @ h.T and its two transposes
  assert collections.Counter(r["role"] for r in rows if r["role"] != "other") == {"fprop": 2, "wgrad": 2, "dgrad": 1}


def test_higher_order_differentiation_is_kept_in_high_precision():
  """A gradient penalty: the inner gradient's backward dots (jvp(transpose(...))) and the outer gradient of those
  (transpose(jvp(transpose(...)))) are kept: 2 + 4 dots. The forward passes and their first-order gradients keep
  their recipe."""
  rows = _decided("probe_gradient_penalty")
  kept = [r for r in rows if r["rule"] == "higher_order"]
  assert len(kept) == 6 and all(r["decision"] == "keep" for r in kept), rows
  # The plain term f(w1, w2, x)'s w2 feeds the loss directly: the head (3 dots).
  assert collections.Counter(r["role"] for r in rows if r["rule"] == "head") == {"fprop": 1, "dgrad": 1, "wgrad": 1}
  assert collections.Counter(r["role"] for r in rows if r["decision"] == "nvfp4") == {"fprop": 3, "wgrad": 3,
                                                                                      "dgrad": 1}


def test_equinox_layers():
  """eqx.nn.MultiheadAttention + eqx.nn.MLP: q/k/v read the raw input (both operands are @main arguments; the weight
  is the one a backward dot takes the gradient of), the MLP's five Linear layers of one shape are blocks 0-4, and the
  last is the head."""
  _, a = _analysis("equinox_attention_mlp")
  layers = _by_layer(a)
  for proj in ("query_proj", "key_proj", "value_proj"):
    name = next(k for k in layers if k.endswith(proj))
    assert layers[name] == ["fprop", "wgrad"], layers  # the input has no gradient
  mlp = {k.rsplit("/", 1)[-1]: v for k, v in layers.items() if "layers/" in k}
  assert mlp == {str(i): ["dgrad", "fprop", "wgrad"] for i in range(5)}, layers
  blocks = {s.layer.rsplit("/", 1)[-1]: s.block for s in a.sites if "layers/" in s.layer}
  assert blocks == {str(i): i for i in range(5)} and a.num_blocks == 5
  assert {s.layer.rsplit("/", 1)[-1] for s in a.sites if s.is_head} == {"4"}
  _check_consistent(a)


def test_parallel_lists_of_layers_are_one_stack_of_blocks():
  """{"w1": [4 layers], "w2": [4 layers]} used as x + gelu(x @ w1[i]) @ w2[i]: block i holds w1[i] and w2[i] (4 blocks,
  not 8), so the kept last block is the whole last layer."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("sharding_benchmark", os.path.join(
      os.path.dirname(__file__), "..", "..", "benchmarks", "sharding.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  params, x = bench.make(4, 64, 128, 16, 16, jnp.float32, False)[:2]
  rows = _decided_for(jax.jit(jax.grad(functools.partial(bench.loss, scanned=False))), params, x)
  fprops = [r for r in rows if r["role"] == "fprop"]
  assert [r["block"] for r in fprops] == [0, 0, 1, 1, 2, 2, 3, 3]
  assert [r["rule"] for r in fprops] == ["nvfp4"] * 6 + ["high_precision_block", "head"]  # w2[3] feeds the loss


# ------------------------------------------------------------------------------ programs that are not training steps


def _decided_with(builder, **options):
  from xla_fp4 import config
  from xla_fp4.passes import pipeline
  fn, args = getattr(models, builder)()
  module = jax.jit(fn).lower(*args).compiler_ir("stablehlo")
  rows, _, _ = pipeline.decisions(module, config.load(environ={}, enabled=True, **options))
  return {(r["layer"].split("/")[-1], r["role"]): (r["decision"], r["rule"]) for r in rows}


@pytest.mark.parametrize("builder", ["linen_mlp_eval", "matmul"])
def test_programs_that_do_not_train_are_left_alone(builder):
  """An eval step and an eager matmul: no backward pass, so every dot keeps its precision, and the rule says why."""
  decided = _decided_with(builder)
  assert decided and set(decided.values()) == {("keep", "forward_only")}, decided


def test_an_eval_step_in_nvfp4_keeps_the_head_found_from_its_forward_dataflow():
  """XLA_FP4_FORWARD_ONLY=1: the head is the layer whose output reaches the program's result (the logits) with no
  other linear layer in between, whatever its name."""
  decided = _decided_with("linen_mlp_eval", forward_only=True, min_dim=1)  # a batch of 4 rows
  assert decided == {("fc1", "fprop"): ("nvfp4", "nvfp4"), ("fc2", "fprop"): ("nvfp4", "nvfp4"),
                     ("head", "fprop"): ("keep", "head")}


def test_ragged_dots_are_expert_layers_with_groups():
  """jax.lax.ragged_dot on CPU is masked dot_generals: the analysis finds each expert layer's forward, dgrad and wgrad
  (the wgrad's gradient is its rhs, as JAX's ragged transpose puts it), and their groups (one slice per expert); the
  router is a plain linear layer."""
  module, a = _analysis("ragged_moe")
  ragged = [s for s in a.sites if s.ragged]
  assert sorted((s.layer, s.role) for s in ragged) == [("w_in", "fprop"), ("w_in", "wgrad"), ("w_out", "dgrad"),
                                                       ("w_out", "fprop"), ("w_out", "wgrad")]
  assert all(s.groups is not None and s.groups.kind == "slices" for s in ragged)
  assert all(s.gradient_operand == 1 for s in ragged if s.role == "wgrad")
  assert not any(s.ragged or s.groups for s in a.sites if s.layer == "router")


# ---------------------------------------------------------------------- parameters without names, Haiku's scopes


def _lowered_analysis(builder, **kwargs):
  fn, args = getattr(models, builder)(**kwargs)
  lowered = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args)
  module = getattr(lowered, "lowered", lowered).compiler_ir("stablehlo")  # eqx.filter_jit wraps JAX's Lowered
  with module.context:
    return analysis.analyze(module)


@pytest.mark.parametrize("builder", ["nnx_transformer_nnx_jit", "flat_jax_transformer"])
def test_blocks_of_a_flat_parameter_list_come_from_the_dataflow(builder):
  """nnx.jit and jax.tree.leaves give parameters as positions in a flat list (leaf numbers, not modules): the blocks
  are the repeated units of layers the forward runs (six per block here), the head and what follows none."""
  a = _lowered_analysis(builder)
  fprops = [s for s in a.sites if s.role == "fprop"]
  assert a.num_blocks == 3, [(s.layer, s.block) for s in fprops]
  blocks = [s.block for s in fprops if not s.is_head]
  assert blocks == [b for b in range(3) for _ in range(6)], [(s.layer, s.block) for s in fprops]
  assert [s.block for s in fprops if s.is_head] == [None]
  for s in a.sites:  # backward dots take their fprop's block
    if s.role in ("dgrad", "wgrad") and not s.is_head:
      assert s.block in (0, 1, 2), s


def test_nnx_scan_under_nnx_jit_selects_its_kept_block_per_iteration():
  """nnx.scan over nnx.vmap-created blocks, under nnx.jit: one stacked weight per layer, sliced per iteration; the
  stack's blocks come from the scan whatever the names, and the last block is kept per iteration."""
  from xla_fp4 import config
  from xla_fp4.passes import pipeline
  fn, args = models.nnx_transformer_nnx_jit(mode="scan")
  module = fn.lower(*args).compiler_ir("stablehlo")
  rows, _, _ = pipeline.decisions(module, config.load(environ={}, enabled=True, min_dim=1, keep_last=1))
  linear = [r for r in rows if r["role"] != "other" and r["rule"] != "head"]
  assert len(linear) >= 18 and all(r["block"] == "scan" and r["num_stacked"] == 3 for r in linear), linear
  assert {tuple(r["keep_blocks"]) for r in linear if r["decision"] == "nvfp4"} == {(2,)}


def test_haiku_name_scopes_are_in_the_layer_path():
  """hk.experimental.name_scope("block_1") names the parameters `block_1/fc1` while the name stack says `fc1`: the
  layer is the parameter's fuller path, so XLA_FP4_EXCLUDE='block_1/' matches it."""
  a = _lowered_analysis("haiku_name_scopes")
  layers = {(s.layer, s.block) for s in a.sites if s.role == "fprop"}
  assert layers == {(f"block_{b}/{n}", b) for b in range(3) for n in ("fc1", "fc2")} | {("head", None)}, layers


@pytest.mark.parametrize("builder,layers", [
    ("haiku_mlp_blocks", {f"block_{b}/{n}" for b in range(3) for n in ("attn", "mlp/linear_0", "mlp/linear_1")}),
    ("linen_checkpointed_blocks", {f"blocks/{b}/{n}" for b in range(3) for n in ("fc1", "fc2")}),
    ("equinox_blocks", {f"block_{b}/linear_{k}" for b in range(3) for k in range(2)}),
    ("nnx_transformer_nnx_jit", {f"block_{b}/linear_{k}" for b in range(3) for k in range(6)}),
])
def test_no_layer_name_is_shared_by_two_blocks(builder, layers):
  """Issue 43: Haiku's MLP layers and a linen block under jax.checkpoint lost their block in the name stack (every
  block's were `mlp/linear_0`, `Block/fc1`); where parameters are flat leaves (nnx.jit, Equinox) the names were leaf
  numbers. Each layer's name now identifies it, in every role."""
  a = _lowered_analysis(builder)
  linear = [s for s in a.sites if s.role != "other" and not s.is_head]
  assert {s.layer for s in linear} == layers, sorted({s.layer for s in linear})
  by_name = collections.defaultdict(set)
  for s in linear:
    by_name[s.layer].add(s.block)
  assert all(len(blocks) == 1 for blocks in by_name.values()), by_name
  assert {s.role for s in linear} == {"fprop", "dgrad", "wgrad"}


@pytest.mark.parametrize("stack,arg,layer", [
    ("", "state['blocks'][2]['attn']['value']['kernel'].value", "blocks/2/attn/value"),  # NNX: a module `value`
    ("", "state['layers'][3]['q']['kernel'].value", "layers/3/q"),                       # NNX's Variable.value
    ("LM/block_0/moe", "params['params']['block_0']['moe']['w_in']", "LM/block_0/moe/w_in"),  # linen: overlap once
    ("fc1", "params['block_1/fc1']['w']", "block_1/fc1"),                                 # Haiku's name_scope
    ("mlp/linear_0", "p['block_1/mlp/~/linear_0']['w']", "block_1/mlp/linear_0"),         # Haiku's submodules
    ("Block/fc1", "p['blocks'][2]['params']['fc1']['kernel']", "blocks/2/fc1"),           # a block under remat
    ("MLP/fc1", "p['params']['fc1']['kernel']", "MLP/fc1"),                               # linen: the stack names it
    ("dense", "ws[3]", "dense/3"),                                                        # a shared helper
])
def test_layer_paths_name_the_module_once(stack, arg, layer):
  from xla_fp4.passes.analysis.names import layer_of
  assert layer_of(stack, arg) == layer


def test_penzai_blocks_come_from_the_dataflow():
  """penzai's unbound parameters are a flat tuple and its name stacks number leaves: each decoder block's seven
  linear layers (q, k, v, o; gate, up, down) are one block, found from the forward's repeats; the head none."""
  a = _lowered_analysis("penzai_llamalike")
  linear = [s for s in a.sites if s.role == "fprop" and len(s.gemm.rhs_shape) > 1]  # not the RMSNorm scales
  assert a.num_blocks == 5
  assert [s.block for s in linear if not s.is_head] == [b for b in range(5) for _ in range(7)], \
      [(s.layer, s.block) for s in linear]
  assert [s.block for s in linear if s.is_head] == [None]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_expert_gemms_of_one_helper_pair_by_dataflow(platform):
  """MaxText's sparse MoE runs every expert GEMM through one helper; on CPU the ragged dots' expansions then carry the
  first call's source frames, so the backward dots pair with their forward by dataflow: each expert layer gets its
  fprop, dgrad and wgrad, whatever the platform."""
  fn, args = models.ragged_glu_moe()
  module = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).compiler_ir("stablehlo")
  with module.context:
    a = analysis.analyze(module)
  roles = collections.Counter((s.layer, s.role) for s in a.sites if s.ragged)
  assert roles == {(layer, role): 1 for layer in ("wi_0", "wi_1", "wo") for role in ("fprop", "dgrad", "wgrad")}, \
      roles
  assert all(s.gradient_operand == 1 for s in a.sites if s.ragged and s.role == "wgrad")


def test_a_dense_moe_finds_the_expert_dim_of_its_up_projections_from_dataflow():
  """MaxText's dense MoE (`sparse_matmul=false`): the up projections' expert dim is a free dim of their weights
  (`BSM,EMH->BSEH`), found because it flows, through the activation (an outlined call) and the gate's product, into
  the down projection's batch dim; their dgrads contract it paired with the gradient's, their wgrads have it free in
  the gradient. A per-head projection (`bsd,dhk->bshk`, whose heads the next layer contracts) gets no groups."""
  fn, args = models.dense_moe()
  module = jax.jit(fn).lower(*args).compiler_ir("stablehlo")
  with module.context:
    a = analysis.analyze(module)
  groups = {(s.layer, str(s.role)): s.groups for s in a.sites if s.layer in ("wi_0", "wi_1")}
  slices = analysis.Grouping.SLICES
  for layer in ("wi_0", "wi_1"):
    assert groups[layer, "fprop"] == analysis.Groups(kind=slices, lhs=(), rhs=(), k=models.D, free=((1, 0),))
    assert groups[layer, "dgrad"] == analysis.Groups(kind=slices, lhs=(2,), rhs=(0,), k=models.H)
    assert groups[layer, "wgrad"] == analysis.Groups(kind=slices, lhs=(), rhs=(), k=2 * 16, free=((0, 2),))  # tokens
  fn, args = models.jax_einsum()
  module = jax.jit(fn).lower(*args).compiler_ir("stablehlo")
  with module.context:
    a = analysis.analyze(module)
  wq = [s.groups for s in a.sites if s.layer == "wq"]
  assert len(wq) == 2 and wq == [None, None]  # its fprop and wgrad (x takes no gradient)


def test_ragged_dots_are_decided_alike_on_every_platform():
  """Lowered for CUDA (on this CPU machine), a ragged dot stays a chlo.ragged_dot: every one is in the report, with the
  decision and rule of its CPU expansion, so that CPU emulation predicts the GPU run."""
  from xla_fp4 import config
  from xla_fp4.passes import pipeline
  fn, args = models.ragged_moe()
  rows = {}
  for platform in ("cpu", "cuda"):
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).compiler_ir("stablehlo")
    rows[platform], _, _ = pipeline.decisions(module, config.load(environ={}, enabled=True))
  decided = {p: sorted((r["layer"], r["role"], r["decision"], r["rule"]) for r in rows[p]) for p in rows}
  assert decided["cpu"] == decided["cuda"], decided
  # both expert layers' forward and wgrad, w_out's dgrad (the tokens take no gradient); w_out feeds the loss (head)
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  experts = [r for r in decided["cuda"] if r[0] in ("w_in", "w_out")]
  assert len(experts) == lowered.count('"chlo.ragged_dot"(') == 5, experts
  assert {r[2:] for r in experts if r[0] == "w_in"} == {("nvfp4", "nvfp4")}
