"""A block is a decoder layer, whatever the program scans (issue 40: MaxText's families): a scan iteration of several
layers numbers each, a lone dense layer beside a stack of MoE layers is a layer, and a scanned pattern's unscanned
remainder comes after it. Plain JAX programs whose parameter paths are MaxText's."""

import jax
import jax.numpy as jnp

from xla_fp4 import config
from xla_fp4.passes import pipeline

D = 32


def _w(key, *shape):
  return jax.random.normal(jax.random.key(key), shape) * 0.1


def _layer(p, h):
  return h + jnp.tanh(h @ p["attn"]) @ p["mlp"]


def _decisions(loss, params, x, **options):
  step = jax.jit(jax.grad(loss))
  module = step.lower(params, x).compiler_ir("stablehlo")
  rows, _, blocks = pipeline.decisions(module, config.load(environ={}, enabled=True, min_dim=1, keep_head=False,
                                                           **options))
  return [r for r in rows if r["role"] != "other"], blocks


def _blocks_of(rows, layer_part):
  """{role: the global blocks of the rows whose layer path holds layer_part (a scanned row: every iteration's)}."""
  out = {}
  for r in rows:
    if layer_part in (r["layer"] or ""):
      blocks = [r["block"]] if r["block"] != "scan" else \
          [r["block_offset"] + i * r["block_stride"] for i in range(r["num_stacked"])]
      out.setdefault(r["role"], set()).update(blocks)
  return out


def test_a_scan_iteration_of_several_layers_numbers_each():
  """Llama 4's scannable block: 2 iterations of layers_0..3 are blocks 0-7; keep-last 1 keeps layers_3's last
  iteration only."""
  iterations, per = 2, 4
  params = {"decoder": {"layers": {f"layers_{i}": {"attn": _w(2 * i, iterations, D, D), "mlp": _w(2 * i + 1,
                                                                                                    iterations, D, D)}
                                   for i in range(per)}}}

  def loss(params, x):
    def unit(h, p):
      for i in range(per):
        h = _layer(p[f"layers_{i}"], h)
      return h, None
    h, _ = jax.lax.scan(unit, x, params["decoder"]["layers"])
    return jnp.sum(h ** 2)

  rows, blocks = _decisions(loss, params, _w(9, 16, D), keep_first=0, keep_last=1)
  assert blocks == ("blocks 0-7: scanned stack decoder/layers, 2 iteration(s) of 4 layers each (decoder/layers/layers_*)",)
  for i in range(per):
    assert _blocks_of(rows, f"layers_{i}/")["fprop"] == {i, i + per}
  kept = {(r["layer"], r["role"]): r["keep_blocks"] for r in rows if r["decision"] == "nvfp4"}
  assert all(v == ([1] if "layers_3/" in layer else []) for (layer, _), v in kept.items()), kept
  assert {role for (layer, role), v in kept.items() if v} == {"fprop", "dgrad", "wgrad"}


def test_dense_layers_before_moe_layers_are_layers_and_a_remainder_follows_its_scan():
  """DeepSeek's dense_layers_0 beside moe_layers_0..1 (numbered alike, holding other layers: both are decoder layers,
  and mlp/wi_0, wi_1 number nothing), and Gemma 3's scanned pattern followed by an unscanned layers_remainder:
  blocks in the order the network runs them, the last layer (the remainder's last) kept."""
  layer = lambda k: {"attn": _w(k, D, D), "mlp": {"wi_0": _w(k + 1, D, D), "wi_1": _w(k + 2, D, D)}}  # noqa: E731
  params = {"dense_layers_0": layer(0), "moe_layers_0": layer(10), "moe_layers_1": layer(20),
            "layers": {"attn": _w(30, 3, D, D), "mlp": _w(31, 3, D, D)},
            "layers_remainder": {"layers_0": {"attn": _w(40, D, D), "mlp": _w(41, D, D)},
                                 "layers_1": {"attn": _w(42, D, D), "mlp": _w(43, D, D)}}}

  def gated(p, h):
    return h + jnp.tanh(h @ p["attn"]) @ p["mlp"]["wi_0"] * (h @ p["mlp"]["wi_1"])

  def loss(params, x):
    h = gated(params["dense_layers_0"], x)
    h = gated(params["moe_layers_1"], gated(params["moe_layers_0"], h))
    h, _ = jax.lax.scan(lambda h, p: (_layer(p, h), None), h, params["layers"])
    for i in range(2):
      h = _layer(params["layers_remainder"][f"layers_{i}"], h)
    return jnp.sum(h ** 2)

  rows, blocks = _decisions(loss, params, _w(9, 16, D), keep_first=0, keep_last=1)
  assert [b.split(":")[0] for b in blocks] == ["block 0", "blocks 1-2", "blocks 3-5", "blocks 6-7"], blocks
  assert _blocks_of(rows, "dense_layers_0/")["fprop"] == {0}
  assert _blocks_of(rows, "moe_layers_1/mlp/wi_1")["fprop"] == {2}
  assert _blocks_of(rows, "layers_remainder/layers_1/")["fprop"] == {7}
  assert {r["rule"] for r in rows if "layers_remainder/layers_1/" in r["layer"]} == {"high_precision_block"}
  assert all(r["decision"] == "nvfp4" for r in rows if "layers_remainder/layers_1/" not in r["layer"])


def _nested_scan_loss(outer):
  """MaxText 0.2.5's Qwen3-Next: a scan over `outer` iterations of (a scan over 3 local layers, a scan over 1 global
  layer), each body rematerialized. The backward reads each iteration's weights from the forward loop's stacked
  residuals (its `ys`), not from the parameters."""
  params = {"layers": {"local_layers": {"attn": _w(1, outer, 3, D, D), "mlp": _w(2, outer, 3, D, D)},
                       "global_layer": {"attn": _w(3, outer, 1, D, D), "mlp": _w(4, outer, 1, D, D)}}}

  def inner(h, p):
    return _layer(p, h), None

  def unit(h, p):
    h, _ = jax.lax.scan(jax.checkpoint(inner), h, p["local_layers"])
    h, _ = jax.lax.scan(jax.checkpoint(inner), h, p["global_layer"])
    return h, None

  def loss(params, x):
    h, _ = jax.lax.scan(unit, x, params["layers"])
    return jnp.sum(h ** 2)
  return loss, params


def test_nested_scans_classify_through_the_forward_loops_stacked_residuals():
  """One iteration around the inner scans (4 layers): the layers are blocks 0-2 and 3, every linear dot is a fprop,
  dgrad or wgrad (the backward's weights traced through the forward loop's `ys`), and keep-last keeps the global
  layer in all three roles. With 2 iterations around them the flat layer index is no value of the program: every
  GEMM still classified, and the rows say that every iteration runs in NVFP4."""
  loss, params = _nested_scan_loss(1)
  rows, blocks = _decisions(loss, params, _w(9, 16, D), keep_first=0, keep_last=1)
  assert sorted(b.split(":")[0] for b in blocks) == ["block 3", "blocks 0-2"], blocks
  for part, size in (("local_layers/", 3), ("global_layer/", 1)):
    mine = [r for r in rows if part in r["layer"]]
    assert sorted({r["role"] for r in mine}) == ["dgrad", "fprop", "wgrad"], mine
    assert all(r["num_stacked"] == size for r in mine), mine
  kept = {(r["role"], tuple(r["keep_blocks"])) for r in rows if "global_layer/" in r["layer"]}
  assert kept == {("fprop", (0,)), ("dgrad", (0,)), ("wgrad", (0,))}, kept
  assert all(not r["keep_blocks"] for r in rows if "local_layers/" in r["layer"])

  loss, params = _nested_scan_loss(2)
  rows, _ = _decisions(loss, params, _w(9, 16, D), keep_first=0, keep_last=1)
  assert sorted({r["role"] for r in rows if r["layer"]}) == ["dgrad", "fprop", "wgrad"]
  assert all(r["decision"] == "nvfp4" for r in rows)


def test_a_loops_stacked_weight_slices_trace_to_the_parameter():
  """A scan that stacks each iteration's weight slice into its output (`ys`; Flax's scanned variables: MaxText
  0.2.5's Qwen3-Next backward reads its layers' weights so) hands a later loop the parameter again: that loop's
  GEMMs are the same layers' (6 of 12 dots were 'not a linear-layer GEMM' before)."""
  params = {"layers": {"attn": _w(1, 3, D, D), "mlp": _w(2, 3, D, D)}}

  def loss(params, x):
    def unit(h, p):
      return _layer(p, h), jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    h, stacked = jax.lax.scan(unit, x, params["layers"])
    h, _ = jax.lax.scan(lambda h, p: (_layer(p, h), None), h, stacked)
    return jnp.sum(h ** 2)

  step = jax.jit(jax.grad(loss))
  module = step.lower(params, _w(9, 16, D)).compiler_ir("stablehlo")
  rows, _, _ = pipeline.decisions(module, config.load(environ={}, enabled=True, min_dim=1, keep_head=False))
  assert sorted(r["role"] for r in rows) == sorted(["fprop"] * 4 + ["dgrad"] * 4 + ["wgrad"] * 4), rows
  assert all(r["block"] == "scan" and r["num_stacked"] == 3 for r in rows), rows
