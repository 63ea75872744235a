"""Number formats through the pass (issue 42): XLA_FP4_FORMAT, rules that name a format, XLA_FP4_KEPT_FORMAT.

The rewritten step is checked against the recipe spelled out with xla_fp4.numerics (a custom_vjp over
numerics.dot_general with the format's recipes): the same numbers up to f32 summation order.
"""

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4
from xla_fp4 import config, report
from xla_fp4.numerics import formats
from xla_fp4.numerics import gemm as nv
from xla_fp4.passes import pipeline
from tests.sharding.test_layouts import run_python

D, F, T = 64, 128, 96


def _params():
  k = jax.random.split(jax.random.key(0), 4)
  return ([jax.random.normal(k[0], (D, F)) * D ** -0.5, jax.random.normal(k[1], (F, D)) * F ** -0.5],
          jax.random.normal(k[2], (T, D)))


def _loss(p, x):
  w1, w2 = p
  return jnp.mean((x + jax.nn.gelu(x @ w1) @ w2) ** 2)


def _manual(fmt, four_over_six=False):
  """The loss with every GEMM quantized per the recipe in `fmt`, from numerics (nearest rounding)."""
  f, fos = formats.FORMATS[fmt], dict(four_over_six=four_over_six)
  act, weight = nv.OperandRecipe(format=fmt, **fos), nv.OperandRecipe(block_2d=f.tiles_2d, format=fmt, **fos)
  wgrad = nv.OperandRecipe(rht=f.rht, format=fmt, **fos)

  @jax.custom_vjp
  def linear(x, w):
    return nv.dot_general(x, w, (((1,), (0,)), ((), ())), a_recipe=act, b_recipe=weight)

  def bwd(res, g):
    x, w = res
    dx = nv.dot_general(g, w, (((1,), (1,)), ((), ())), a_recipe=act, b_recipe=weight)
    dw = nv.dot_general(x, g, (((0,), (0,)), ((), ())), a_recipe=wgrad, b_recipe=wgrad)
    return dx, dw
  linear.defvjp(lambda x, w: (linear(x, w), (x, w)), bwd)

  def loss(p, x):
    w1, w2 = p
    return jnp.mean((x + linear(jax.nn.gelu(linear(x, w1)), w2)) ** 2)
  return loss


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _step_with(**options):
  """(decision rows, gradients) of one step with the pass enabled with `options` (nearest rounding, every layer)."""
  params, x = _params()
  xla_fp4.enable(stochastic_rounding=False, keep_head=False, keep_first=0, keep_last=0, strict=True, **options)
  try:
    step = jax.jit(jax.grad(_loss))
    return xla_fp4.explain(step, params, x), step(params, x)
  finally:
    xla_fp4.disable()


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_the_format_option_quantizes_every_gemm_in_it(fmt):
  params, x = _params()
  rows, got = _step_with(format=fmt)
  assert [r["decision"] for r in rows] == [fmt] * 5, rows  # two fprops, two wgrads, one dgrad
  want = jax.jit(jax.grad(_manual(fmt)))(params, x)
  base = jax.jit(jax.grad(_loss))(params, x)
  for g, w, b in zip(got, want, base):
    assert _rel(g, w) < 1e-5  # the recipe, up to f32 summation order
    assert _rel(g, b) > 1e-4  # and quantized


def test_four_over_six_through_the_pass():
  """XLA_FP4_FOUR_OVER_SIX=1: every dense NVFP4 GEMM takes each block's scale to 4 or to 6 (the emulated GEMM, on the
  twins), as the recipe spelled out with numerics does; the report marks the recipe."""
  params, x = _params()
  rows, got = _step_with(four_over_six=True)
  assert all(r["decision"] == "nvfp4" and r["recipe"]["lhs"].endswith("4/6") for r in rows), rows
  want = jax.jit(jax.grad(_manual("nvfp4", four_over_six=True)))(params, x)
  plain = jax.jit(jax.grad(_manual("nvfp4")))(params, x)
  for g, w, p in zip(got, want, plain):
    assert _rel(g, w) < 1e-5 and _rel(g, p) > 1e-4


def test_rules_choose_a_format_per_layer_and_the_report_names_it():
  params, x = _params()
  rules = [{"layer": "^1$", "format": "mxfp8"}]  # the second weight (a plain list's leaf names it 1)
  cfg = config.load(environ={}, enabled=True, rules=rules, keep_head=False, keep_first=0, keep_last=0)
  module = jax.jit(jax.grad(_loss)).lower(params, x).compiler_ir("stablehlo")
  result = pipeline.transform(module, cfg)
  by_layer = {(r["layer"], r["role"]): r["decision"] for r in result.rows}
  assert {d for (layer, _), d in by_layer.items() if layer == "1"} == {"mxfp8"}, by_layer
  assert {d for (layer, _), d in by_layer.items() if layer == "0"} == {"nvfp4"}, by_layer
  assert "5/5 dots quantized (3 mxfp8, 2 nvfp4)" in report.table(result.rows)
  assert "mx_qdq" in str(result.module) and "qdq_with_scale" in str(result.module)  # kernels or their twins


def test_kept_layers_in_mxfp8():
  """XLA_FP4_KEPT_FORMAT=mxfp8: the head (and kept blocks) quantize in MXFP8 instead of staying in high precision."""
  params, x = _params()
  module = jax.jit(jax.grad(_loss)).lower(params, x).compiler_ir("stablehlo")
  high = pipeline.transform(module, config.load(environ={}, enabled=True, keep_first=0, keep_last=0))
  kept = pipeline.transform(module, config.load(environ={}, enabled=True, keep_first=0, keep_last=0,
                                                kept_format="mxfp8"))
  head = [r for r in high.rows if r["rule"] == "head"]
  assert head and all(r["decision"] == "keep" for r in head)
  kept_head = [r for r in kept.rows if r["rule"] == "head"]
  assert [r["decision"] for r in kept_head] == ["mxfp8"] * len(head) and "XLA_FP4_KEPT_FORMAT" in kept_head[0]["reason"]


def test_what_a_format_cannot_take_stays_in_high_precision_with_a_reason():
  """K = 48: a multiple of NVFP4's 16, not of the MX formats' 32."""
  w, x = jax.random.normal(jax.random.key(0), (48, 64)), jax.random.normal(jax.random.key(1), (32, 48))
  module = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))).lower(w, x).compiler_ir("stablehlo")
  for fmt, want in (("nvfp4", "nvfp4"), ("mxfp8", "keep")):
    rows = pipeline.transform(module, config.load(environ={}, enabled=True, format=fmt, keep_head=False)).rows
    fprop = next(r for r in rows if r["role"] == "fprop")
    assert fprop["decision"] == want, rows
  assert "not a multiple of 32 (mxfp8's block)" in fprop["reason"]


def test_bad_format_input_says_what_to_do():
  with pytest.raises(ValueError, match="nvfp4.*mxfp4.*mxfp8"):
    config.load(environ={"XLA_FP4_FORMAT": "fp4"}, enabled=True)
  with pytest.raises(ValueError, match="'format' 'mxfp8' quantizes"):
    config.load(environ={}, enabled=True, rules=[{"layer": "x", "format": "mxfp8", "decision": "keep"}])
  assert config.FORMATS == tuple(formats.FORMATS)


SHARDED = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    from tests.passes.test_number_formats import _loss, _params
    params, x = _params()
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    out = {}
    for fmt, fos in (("mxfp4", False), ("mxfp8", False), ("nvfp4", True)):
      for backend in ("emulate", "native"):
        xla_fp4.enable(format=fmt, four_over_six=fos, backend=backend, stochastic_rounding=False, keep_head=False,
                       keep_first=0, keep_last=0, strict=True)
        step = jax.jit(jax.grad(_loss))
        sharded = step([put(params[0], P(None, "model")), put(params[1], P("model", None))], put(x, P("data")))
        one = step(jax.device_put(params, jax.devices()[0]), jax.device_put(x, jax.devices()[0]))
        out[fmt + ("_4over6" if fos else "") + "_" + backend] = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))
                                       for a, b in zip(sharded, one))
    xla_fp4.disable()
    print(json.dumps(out))
""")


def test_sharded_mx_steps_compute_what_one_device_computes():
  """Tensor parallelism x data parallelism on 4 host devices, both backends (the MX formats and Four Over Six run the
  emulated GEMM under either): the twins' block-local scales are XLA's to partition."""
  out = json.loads(run_python(["-c", SHARDED]).strip().splitlines()[-1])
  assert all(v <= 1e-5 for v in out.values()), out


def test_a_scanned_stacks_kept_iterations_run_in_mxfp8():
  """In a scanned stack the kept iterations select, per operand, an MXFP8 quantization instead of the operand itself
  (the emulated GEMM): the decision says so, the step runs, and its gradients differ from kept iterations in high
  precision only in the kept layer's reach."""
  from tests.passes import models
  fn, args = models.jax_scan_mlp(num_layers=4, batch=64)
  options = dict(keep_first=0, keep_last=1, stochastic_rounding=False, strict=True)
  grads = {}
  for kept in ("high", "mxfp8"):
    xla_fp4.enable(kept_format=kept, **options)
    try:
      step = jax.jit(fn)
      rows = xla_fp4.explain(step, *args)
      grads[kept] = step(*args)
    finally:
      xla_fp4.disable()
    scanned = [r for r in rows if r["block"] == "scan" and r["decision"] == "nvfp4"]
    assert scanned and all(r["keep_blocks"] == [3] for r in scanned), rows
    assert all(("in MXFP8" in r["reason"]) == (kept == "mxfp8") for r in scanned), rows
  last = [np.asarray(g) for g in jax.tree.leaves(grads["mxfp8"])]
  high = [np.asarray(g) for g in jax.tree.leaves(grads["high"])]
  # w1, w2 stacked [layers, ...]: the kept (last) layer's gradients change with its format
  assert all(not np.array_equal(a[3], b[3]) for a, b in zip(last, high))
  assert all(np.isfinite(a).all() for a in last)
