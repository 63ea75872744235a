"""End to end through the compile hook: a rewritten training step against an independent emulation of the recipe
written with xla_fp4.numerics, against the f32 baseline, and the pass's safety properties."""

import dataclasses
import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4
from xla_fp4 import kernels, numerics as nv, state
from xla_fp4.passes import pipeline, rewrite

D_IN, D_HID, D_OUT, BATCH, SEQ = 64, 128, 32, 4, 16  # 3-D activations: the wgrads contract over (batch, seq)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(D_HID, name="fc1")(x))
    x = nn.relu(nn.Dense(D_HID, name="fc2")(x))
    return nn.Dense(D_OUT, name="head")(x)


def _data():
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D_IN))
  t = jax.random.normal(jax.random.key(2), (BATCH, SEQ, D_OUT))
  params = MLP().init(jax.random.key(0), x)
  return params, x, t


def _loss(params, x, t):
  return jnp.mean((MLP().apply(params, x) - t) ** 2)


@pytest.fixture
def fp4():
  """Enable the pass for one test with the given options, then disable it."""
  def enable(**options):
    xla_fp4.enable(**options)
  yield enable
  xla_fp4.disable()


@functools.lru_cache(maxsize=None)
def _cached_grads(fp4, options):
  return _grads_uncached(fp4, **dict(options))


def _grads(fp4=True, **options):
  """Gradients of one step, with the pass enabled with `options` or (fp4=False) the f32 baseline; memoized."""
  return _cached_grads(fp4, tuple(sorted(options.items())))


def _grads_uncached(fp4=True, **options):
  params, x, t = _data()
  if fp4:
    xla_fp4.enable(**options)
  try:
    return jax.jit(jax.grad(_loss))(params, x, t)  # a fresh jit: compiled with the current hook state
  finally:
    xla_fp4.disable()


# ---- the independent emulation: the recipe spelled out with xla_fp4.numerics and a custom_vjp ----

FPROP = (nv.OperandRecipe(), nv.OperandRecipe(block_2d=True))
DGRAD = (nv.OperandRecipe(), nv.OperandRecipe(block_2d=True))  # stochastic rounding off: keys are the pass's own
WGRAD = (nv.OperandRecipe(rht=True), nv.OperandRecipe(rht=True))
@jax.custom_vjp
def nvfp4_linear(x, w):
  return nv.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), a_recipe=FPROP[0], b_recipe=FPROP[1])


def _fwd(x, w):
  return nvfp4_linear(x, w), (x, w)


def _bwd(res, g):
  x, w = res
  tokens = tuple(range(g.ndim - 1))
  dx = nv.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), a_recipe=DGRAD[0], b_recipe=DGRAD[1])
  dw = nv.dot_general(g, x, ((tokens, tokens), ((), ())), a_recipe=WGRAD[0], b_recipe=WGRAD[1]).T
  return dx, dw


nvfp4_linear.defvjp(_fwd, _bwd)


def _manual_loss(params, x, t):
  p = params["params"]
  h = jax.nn.relu(nvfp4_linear(x, p["fc1"]["kernel"]) + p["fc1"]["bias"])
  h = jax.nn.relu(nvfp4_linear(h, p["fc2"]["kernel"]) + p["fc2"]["bias"])
  y = h @ p["head"]["kernel"] + p["head"]["bias"]  # the head stays in high precision
  return jnp.mean((y - t) ** 2)


def _cos(a, b):
  return float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))


def _rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_rewritten_step_equals_independent_emulation():
  got = _grads(stochastic_rounding=False)
  params, x, t = _data()
  want = jax.jit(jax.grad(_manual_loss))(params, x, t)
  base = _grads(fp4=False)
  for layer in ("fc1", "fc2", "head"):
    g, w, b = (tree["params"][layer]["kernel"] for tree in (got, want, base))
    assert _rel(g, w) < 1e-5, layer  # same recipe, only f32 summation order may differ
    assert _rel(g, b) > 1e-4 and _cos(g, b) > 0.8, layer  # NVFP4 noise, yet the f32 gradient's direction


def test_wgrad_gemm_writes_the_kernels_layout():
  # JAX's wgrad of a kernel is dot_general(dy, x) -> (out, in), then a transpose to the kernel's (in, out); XLA folds
  # that transpose into its own dot. The emulated GEMM multiplies by alpha in between, so the pass emits it swapped and
  # transposed back (rewrite/emulated.py): XLA must again compute each wgrad GEMM in the kernel's own shape, with no
  # transpose left for the optimizer's updates to read through.
  params, x, t = _data()
  xla_fp4.enable(stochastic_rounding=False)
  try:
    text = jax.jit(jax.grad(_loss)).lower(params, x, t).compile().as_text()
  finally:
    xla_fp4.disable()
  shapes = {"fc1": [D_IN, D_HID], "fc2": [D_HID, D_HID]}
  for layer, shape in shapes.items():
    dots = re.findall(rf"= f32\[([0-9,]+)\]\S* dot\([^\n]*op_name=\"xla_fp4/MLP/{layer}/wgrad\"", text)
    assert [[int(d) for d in dims.split(",")] for dims in dots] == [shape], (layer, dots)


def test_stochastic_rounding_changes_gradients_but_stays_close():
  sr, rn, base = _grads(), _grads(stochastic_rounding=False), _grads(fp4=False)
  g_sr, g_rn, g_b = (t["params"]["fc1"]["kernel"] for t in (sr, rn, base))
  assert not jnp.array_equal(g_sr, g_rn)
  assert _cos(g_sr, g_b) > 0.8


def test_unselected_dots_are_bit_identical():
  def two_layers(w1, w2, x):
    y1 = x @ w1
    with xla_fp4.exclude():
      y2 = x @ w2
    return y1, y2
  args = (jnp.ones((64, 64)) * 0.3, jax.random.normal(jax.random.key(3), (64, 64)),
          jax.random.normal(jax.random.key(4), (64, 64)))
  base = jax.jit(two_layers)(*args)
  xla_fp4.enable(forward_only=True, keep_head=False)  # a forward program: both layers reach its result
  try:
    got = jax.jit(two_layers)(*args)
  finally:
    xla_fp4.disable()
  assert not jnp.array_equal(got[0], base[0])  # selected: NVFP4
  assert jnp.array_equal(got[1], base[1])  # excluded: bit-identical


def test_exclude_marks_the_layer_not_its_name():
  """exclude() is a frontend attribute on the ops traced inside (jax's set_xla_metadata), which JAX also writes on
  the backward pass's transposed dots: the excluded layer's fprop, dgrad and wgrad stay in high precision. A module
  that merely carries the attribute's name in its own name is not excluded."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(64, name="xla_fp4_exclude")(x)  # a name, not an exclusion
      with xla_fp4.exclude():
        x = nn.Dense(64, name="kept")(jnp.tanh(x))
      return nn.Dense(64, name="last")(jnp.tanh(x))
  model = Model()
  x = jax.random.normal(jax.random.key(0), (32, 64))
  params = model.init(jax.random.key(1), x)
  rows = xla_fp4.explain(jax.grad(lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params, x)
  by_layer = {}
  for r in rows:
    by_layer.setdefault(r["layer"].split("/")[-1], set()).add((r["role"], r["rule"]))
  assert by_layer["kept"] == {("fprop", "exclude_scope"), ("dgrad", "exclude_scope"), ("wgrad", "exclude_scope")}
  assert by_layer["xla_fp4_exclude"] == {("fprop", "nvfp4"), ("wgrad", "nvfp4")}


def test_user_rules_decide_first_and_the_program_runs():
  """enable(rules=[...]): a user rule keeps one layer's wgrad and puts the head, which the policy keeps, in NVFP4; the
  rewritten step runs: its gradients differ from the unrewritten ones by NVFP4 noise (a 2-layer model: tens of %)."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(64, name="fc")(x)
      return nn.Dense(64, name="head")(jnp.tanh(x))
  model = Model()
  x = jax.random.normal(jax.random.key(0), (32, 64))
  params = model.init(jax.random.key(1), x)
  grad = jax.grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
  expected = grad(params, x)
  try:
    xla_fp4.enable(strict=True, rules=[{"layer": "fc", "role": "wgrad", "decision": "keep", "name": "fc_wgrad"},
                                       {"layer": "head$", "decision": "nvfp4", "name": "head_in_nvfp4"}])
    rows = xla_fp4.explain(grad, params, x)
    got = jax.jit(grad)(params, x)
  finally:
    xla_fp4.disable()
  decided = {(r["layer"].split("/")[-1], r["role"]): r["rule"] for r in rows}
  assert decided == {("fc", "fprop"): "nvfp4", ("fc", "wgrad"): "fc_wgrad", ("head", "fprop"): "head_in_nvfp4",
                     ("head", "dgrad"): "head_in_nvfp4", ("head", "wgrad"): "head_in_nvfp4"}
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert 0 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.7


def _not_warned_yet():
  """A process state in which the compile hook has not warned yet (it warns once per process)."""
  return state.use(dataclasses.replace(state.current(), said=set()))


def test_internal_failure_compiles_the_original_and_warns(monkeypatch):
  def boom(*a, **k):
    raise RuntimeError("injected")
  monkeypatch.setattr(pipeline, "transform", boom)
  base = _grads(fp4=False)
  with warnings.catch_warnings(record=True) as caught, _not_warned_yet():
    warnings.simplefilter("always")
    got = _grads_uncached(stochastic_rounding=False)
  assert any("injected" in str(w.message) and "XLA_FP4_STRICT" in str(w.message) for w in caught)
  for layer in ("fc1", "fc2", "head"):
    assert jnp.array_equal(got["params"][layer]["kernel"], base["params"][layer]["kernel"])


def test_xla_compile_failure_compiles_the_original_and_warns(monkeypatch):
  """The rewritten module calls a target no one registered: XLA refuses it, the original program still runs."""
  from xla_fp4 import kernels
  from xla_fp4.kernels import targets
  missing = "xla_fp4_not_registered"
  monkeypatch.setattr(targets, "QDQ_WITH_SCALE", dataclasses.replace(targets.QDQ_WITH_SCALE, name=missing))
  monkeypatch.setitem(kernels.ATTRIBUTES, missing, kernels.ATTRIBUTES["xla_fp4_qdq_with_scale"])
  base = _grads(fp4=False)
  with warnings.catch_warnings(record=True) as caught, _not_warned_yet():
    warnings.simplefilter("always")
    got = _grads_uncached(stochastic_rounding=False)
  assert any("could not compile" in str(w.message) and missing in str(w.message) for w in caught), \
      [str(w.message) for w in caught]
  for layer in ("fc1", "fc2", "head"):
    assert jnp.array_equal(got["params"][layer]["kernel"], base["params"][layer]["kernel"])
  with pytest.raises(Exception, match=missing):
    _grads_uncached(strict=True)


def test_a_module_that_does_not_verify_compiles_the_original_and_warns(monkeypatch):
  """The pass verifies its module only in strict mode (rewrite.apply); otherwise jax's verification of what it
  compiles finds the broken module, and the hook compiles the original. Broken here: every emulated GEMM's output
  converted to float16, a type its readers do not take."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import hlo
  from xla_fp4.passes.rewrite import emulated
  emit = emulated.emit

  def mistyped(*args):
    y = emit(*args)
    return hlo.ConvertOp(ir.RankedTensorType.get(ir.RankedTensorType(y.type).shape, ir.F16Type.get()), y).result
  monkeypatch.setattr(emulated, "emit", mistyped)
  base = _grads(fp4=False)
  with warnings.catch_warnings(record=True) as caught, _not_warned_yet():
    warnings.simplefilter("always")
    got = _grads_uncached(stochastic_rounding=False)
  assert any("could not compile" in str(w.message) and "MLIRError" in str(w.message) for w in caught), \
      [str(w.message) for w in caught]
  for layer in ("fc1", "fc2", "head"):
    assert jnp.array_equal(got["params"][layer]["kernel"], base["params"][layer]["kernel"])
  with pytest.raises(Exception, match="Verification failed"):  # strict: raised by the pass's own verification
    _grads_uncached(strict=True)


def test_strict_mode_raises(monkeypatch):
  def boom(*a, **k):
    raise RuntimeError("injected")
  monkeypatch.setattr(pipeline, "transform", boom)
  with pytest.raises(RuntimeError, match="injected"):
    _grads_uncached(strict=True)


def test_output_is_deterministic():
  params, x, t = _data()
  module = jax.jit(jax.grad(_loss)).lower(params, x, t).compiler_ir("stablehlo")
  cfg = xla_fp4.config.load(enabled=True)
  texts = {pipeline.transform(module, cfg).module.operation.get_asm(enable_debug_info=True) for _ in range(2)}
  assert len(texts) == 1
  assert "xla_fp4" in texts.pop()


def test_explain_returns_decisions_without_running(capsys):
  params, x, t = _data()
  rows = xla_fp4.explain(jax.grad(_loss), params, x, t)
  out = capsys.readouterr().out
  roles = sorted((r["layer"].split("/")[-1], r["role"], r["decision"]) for r in rows)
  assert ("head", "fprop", "keep") in roles and ("fc2", "wgrad", "nvfp4") in roles
  assert "output head" in out and "% of dot FLOPs" in out
  # Which options decided is said, never assumed: here the pass is not enabled.
  enabled = xla_fp4.hook.installed_config() is not None
  assert ("the enabled pass's options" in out) == enabled
  assert ("the pass is not enabled: options from the XLA_FP4_* environment" in out) == (not enabled)


def _two_layer_steps():
  """{frontend: (jitted train step, its args)}: a 2-layer MLP's gradient step under each frontend's own jit."""
  import equinox as eqx
  import haiku as hk
  from flax import nnx
  x = jnp.ones((16, 32))
  steps = {}
  mlp = eqx.nn.MLP(32, 32, 64, depth=2, key=jax.random.key(0))
  steps["eqx.filter_jit"] = (eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))), (mlp, x))

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.fc1, self.fc2 = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
      return self.fc2(jnp.tanh(self.fc1(x)))
  steps["nnx.jit"] = (nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))), (Mlp(nnx.Rngs(0)), x))
  f = hk.transform(lambda x: hk.nets.MLP([64, 32])(x))
  params = f.init(jax.random.key(0), x)
  steps["hk.transform + jax.jit"] = (jax.jit(jax.grad(lambda p, x: jnp.sum(f.apply(p, None, x) ** 2))), (params, x))
  steps["jax.jit"] = (jax.jit(jax.grad(_loss)), _data())
  return steps


@pytest.mark.parametrize("frontend", ["eqx.filter_jit", "nnx.jit", "hk.transform + jax.jit", "jax.jit"])
def test_explain_takes_every_frontends_jit(frontend):
  step, args = _two_layer_steps()[frontend]
  rows = xla_fp4.explain(step, *args)
  assert {r["role"] for r in rows} >= {"fprop", "dgrad", "wgrad"}, rows


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_in_an_operand_reach_the_output(bad):
  x = np.array(jax.random.normal(jax.random.key(0), (16, 16, 64)))
  x[14, 5, 3] = bad  # a layout in which XLA CPU's plain max reduction drops NaN
  w = jax.random.normal(jax.random.key(1), (64, 64))
  xla_fp4.enable(strict=True, forward_only=True, keep_head=False)
  try:
    y = jax.jit(lambda x, w: x @ w)(x, w)
  finally:
    xla_fp4.disable()
  assert np.isnan(np.asarray(y)).all()  # a non-finite global scale poisons the tensor, as it would on the GPU


def test_exclude_decorator_keeps_the_function_in_high_precision():
  @xla_fp4.exclude
  def router(x, w):
    return x @ w

  def f(x, w1, w2):
    return router(x, w1) + x @ w2
  args = [jax.random.normal(jax.random.key(i), (32, 64) if i == 0 else (64, 64)) for i in range(3)]
  xla_fp4.enable(forward_only=True, keep_head=False)
  try:
    rows = xla_fp4.explain(f, *args)
  finally:
    xla_fp4.disable()
  assert sorted((r["decision"], r["rule"]) for r in rows) == [("keep", "exclude_scope"), ("nvfp4", "nvfp4")]
  with pytest.raises(TypeError, match="decorates a function"):
    xla_fp4.exclude(3)


def test_platforms_without_compiled_kernels_get_the_pure_jax_reference(monkeypatch):
  """Where no FFI kernel is registered (e.g. a GPU without the CUDA build) the rewrite calls private functions lowered
  from xla_fp4.numerics: the same numbers as the C++ kernels."""
  ffi = _grads_uncached(stochastic_rounding=False)
  with state.use(dataclasses.replace(state.current(), registered=set())):  # as if no platform had its targets
    ref = _grads_uncached(stochastic_rounding=False)
  for layer in ("fc1", "fc2", "head"):
    assert jnp.array_equal(ffi["params"][layer]["kernel"], ref["params"][layer]["kernel"]), layer


def _gradient_with_and_without_pass(loss, *args):
  """(gradient without the pass, with it in strict mode, the pass's decision rows). The programs are one layer,
  which is the loss's head: keep_head=0 puts it in NVFP4."""
  base = jax.jit(jax.grad(loss))(*args)
  xla_fp4.enable(strict=True, keep_head=False)
  try:
    return base, jax.jit(jax.grad(loss))(*args), xla_fp4.explain(jax.grad(loss), *args)
  finally:
    xla_fp4.disable()


def test_float64_layers_stay_in_high_precision_with_a_reason():
  """The kernels take f32/bf16/f16: an f64 linear layer (jax_enable_x64) is kept, so nothing can fail at run time."""
  with jax.enable_x64(True):
    w = jax.random.normal(jax.random.key(0), (64, 64), jnp.float64)
    x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float64)
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
    base, got, rows = _gradient_with_and_without_pass(loss, w, x)
  linear = [r for r in rows if r["role"] != "other"]
  assert linear and all(r["decision"] == "keep" and r["rule"] == "dtype" for r in linear), rows
  assert got.dtype == jnp.float64 and jnp.array_equal(got, base)


def test_bf16_einsum_with_two_contracting_dims_runs_on_cpu():
  """An attention-output projection (MaxText's self_attention/out): XLA CPU rejects its wgrad as a bf16 x bf16 -> f32
  dot of 3D operands at run time; the pass multiplies the operands as matrices there."""
  a = jax.random.normal(jax.random.key(0), (2, 128, 4, 64)).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(1), (4, 64, 256)) * 0.05).astype(jnp.bfloat16)
  loss = lambda w, a: jnp.sum(jnp.einsum("bthd,hdo->bto", a, w).astype(jnp.float32) ** 2)  # noqa: E731
  base, got, rows = _gradient_with_and_without_pass(loss, w, a)
  assert {r["role"] for r in rows if r["decision"] == "nvfp4"} >= {"fprop", "wgrad"}, rows
  assert got.dtype == jnp.bfloat16 and bool(jnp.isfinite(got).all()) and not jnp.array_equal(got, base)
  rel = float(jnp.linalg.norm((got - base).astype(jnp.float32)) / jnp.linalg.norm(base.astype(jnp.float32)))
  assert rel < 0.3, rel


@pytest.mark.parametrize("builder,kwargs", [("jax_einsum", {}), ("jax_scan_mlp", {"batch": 32})])
def test_bf16_training_of_every_dot_shape_class(builder, kwargs):
  """bf16 parameters and activations, trained for a few SGD steps on CPU with the pass in strict mode: dots with batch
  dims (per-expert weights) and several contracting dims (per-head projections), and dots inside a scanned stack.
  Every class is rewritten, and the loss falls."""
  import models
  grad_fn, (params, x) = getattr(models, builder)(**kwargs)
  params, x = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
  xla_fp4.enable(strict=True, keep_head=False)
  try:
    rows = xla_fp4.explain(grad_fn, params, x)
    step = jax.jit(lambda p, x: jax.tree.map(lambda a, g: a - 0.5 * g, p, grad_fn(p, x)))
    loss = jax.jit(grad_fn.loss)
    losses = []
    for _ in range(4):
      losses.append(float(loss(params, x)))
      params = step(params, x)
  finally:
    xla_fp4.disable()
  assert {r["role"] for r in rows if r["decision"] == "nvfp4"} == {"fprop", "dgrad", "wgrad"}, rows
  if builder == "jax_einsum":  # batch dims (experts) and two contracting dims (wo)
    assert {r["layer"] for r in rows if r["decision"] == "nvfp4"} == {"wq", "wo", "experts"}, rows
  else:
    assert all(r["block"] == "scan" for r in rows if r["decision"] == "nvfp4"), rows
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_xla_fp4_changes_nothing_but_training_steps():
  """With the pass on, an eager matmul, a jitted one, model init, an eval step and a label computation outside
  training give the bits they give without it (no backward pass: the forward_only rule); the train step changes."""
  params, x, t = _data()
  a, b = jax.random.normal(jax.random.key(5), (64, 64)), jax.random.normal(jax.random.key(6), (64, 64))

  def everything_but_training():
    return {"eager": a @ b, "jit": jax.jit(jnp.matmul)(a, b),
            "init": MLP().init(jax.random.key(0), x), "eval": jax.jit(MLP().apply)(params, x),
            "labels": jnp.argmax(jax.jit(lambda w, x: x @ w)(b, a), axis=-1)}
  base = everything_but_training()
  xla_fp4.enable()
  try:
    got = everything_but_training()
  finally:
    xla_fp4.disable()
  for name in base:
    assert all(jnp.array_equal(u, v) for u, v in zip(jax.tree.leaves(got[name]), jax.tree.leaves(base[name]))), name
  assert not jnp.array_equal(_grads()["params"]["fc1"]["kernel"], _grads(fp4=False)["params"]["fc1"]["kernel"])
