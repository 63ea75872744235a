"""Expert GEMMs in NVFP4 (numerics/grouped.py, analysis/ragged.py, the emitter's Form.GROUPED): a ragged dot's forward,
dgrad and wgrad and an expert einsum run the grouped recipe, one global decode scale per expert and per group of tokens,
bit for bit against the pure-JAX reference; lowered for GPU, the same layer is the same decisions and one ragged GEMM
per dot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4
from xla_fp4 import config, kernels, numerics as nv
from xla_fp4.numerics import formats, grouped
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.passes import pipeline
from xla_fp4.passes.rewrite import ReferenceKernels

from nvfp4_testing import assert_same_bits, run_on_cpu

M, K, N = 96, 32, 48
SIZES = (20, 0, 9, 40, 11)  # one empty group, sizes off the 16-row blocks, 16 rows after the last group
SEED = 5
OPTIONS = dict(stochastic_rounding=False, keep_head=False, min_dim=1, seed=SEED)


def _layer(w, x, ct, sizes):
  """An expert layer's forward and its two gradients (for the cotangent `ct`): what a training step computes."""
  y, vjp = jax.vjp(lambda w, x: jax.lax.ragged_dot(x, w, sizes), w, x)
  dw, dx = vjp(ct)
  return y, dx, dw


def _inputs(dtype=jnp.float32, n=N):
  k = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(k[0], (len(SIZES), K, n)) * jnp.array([1.0, 3.0, 0.01, 1.0, 100.0])[:, None, None]
  x = jax.random.normal(k[1], (M, K)) * jnp.linspace(0.1, 10, M)[:, None]  # groups with different ranges
  ct = jax.random.normal(k[2], (M, n))
  return w.astype(dtype), x.astype(dtype), ct.astype(dtype), jnp.asarray(SIZES, jnp.int32)


def _reference(w, x, ct, sizes, four_over_six=False):
  """The paper's recipe per role, from numerics.grouped: weights in 16x16 tiles per expert, both wgrad operands through
  the RHT along the rows (nearest rounding here, so that the keys do not matter); optionally with Four Over Six."""
  fos = dict(four_over_six=four_over_six)
  rows, weight, rht = nv.OperandRecipe(**fos), nv.OperandRecipe(block_2d=True, **fos), nv.OperandRecipe(rht=True, **fos)
  y = grouped.ragged_dot(x, w, sizes, lhs_recipe=rows, rhs_recipe=weight, preferred_element_type=x.dtype)
  dx = grouped.ragged_dot(ct, jnp.swapaxes(w, 1, 2), sizes, lhs_recipe=rows, rhs_recipe=weight,
                          preferred_element_type=x.dtype)
  dw = grouped.ragged_contracting_dot(x, ct, sizes, lhs_recipe=rht, rhs_recipe=rht, rht_seed=SEED,
                                      preferred_element_type=x.dtype)
  return y, dx, dw


@pytest.fixture
def fp4():
  xla_fp4.enable(**OPTIONS)
  yield
  xla_fp4.disable()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_expert_layer_runs_the_grouped_recipe_in_all_three_roles(fp4, dtype):
  """On CPU JAX expands each ragged dot into masked dot_generals; the pass quantizes every group with its own scale:
  the forward, the dgrad and the wgrad equal numerics.grouped bit for bit (and differ from the plain ragged dot)."""
  args = _inputs(dtype)
  got = jax.jit(_layer)(*args)
  want = jax.jit(_reference)(*args)
  for g, r in zip(got, want):
    assert_same_bits(g, r)
  plain = _layer(*args)
  assert not any(np.array_equal(g, p) for g, p in zip(got, plain))


def test_four_over_six_keeps_the_grouped_recipe():
  """XLA_FP4_FOUR_OVER_SIX on an expert layer: every group and expert keeps its own decode scale (amax / 1536) and
  each block takes its scale to 4 or to 6 (numerics/grouped.py with Four Over Six), bit for bit on CPU, where the
  forms are the ragged dots' expansions; lowered for GPU the ragged twins take the recipe's 4th entry, and their
  numbers are the reference's (run on CPU, where the ragged GEMM expands)."""
  args = _inputs()
  xla_fp4.enable(**OPTIONS, four_over_six=True)
  try:
    got = jax.jit(_layer)(*args)
  finally:
    xla_fp4.disable()
  want = jax.jit(functools.partial(_reference, four_over_six=True))(*args)
  for g, r in zip(got, want):
    assert_same_bits(g, r)
  assert not all(np.array_equal(g, r) for g, r in zip(got, jax.jit(_reference)(*args)))  # 4/6 changed something
  result = _transform(jax.jit(_layer).trace(*args).lower(lowering_platforms=("cuda",)), "cuda", four_over_six=True)
  assert all(r["recipe"]["lhs"].endswith("+4/6") for r in result.rows)
  w, x, ct, sizes = args
  rows = jax.jit(functools.partial(grouped.ragged_rows, lhs_contracting=1, rhs_contracting=1, rhs_group=0,
                                   lhs_recipe=(False, False, False, True), rhs_recipe=(True, False, False, True),
                                   rht_seed=SEED, dtype="float32"))
  assert_same_bits(rows(x, w, sizes, jnp.uint32(1), jnp.uint32(2)), want[0])
  contracting = jax.jit(functools.partial(grouped.ragged_contracting, lhs_recipe=(False, False, True, True),
                                          rhs_recipe=(False, False, True, True), rht_seed=SEED, dtype="float32"))
  assert_same_bits(contracting(x, ct, sizes, jnp.uint32(1), jnp.uint32(2)), want[2])


def _transform(lowered, platform, **options):
  module = lowered.compiler_ir("stablehlo")
  kernels = (lambda m: ReferenceKernels(m, "cuda")) if platform == "cuda" else None
  return pipeline.transform(module, config.load(environ={}, enabled=True, **{**OPTIONS, **options}),
                            platform=platform, kernels=kernels)


def test_lowered_for_gpu_each_ragged_dot_is_one_grouped_ragged_gemm():
  """Lowered for CUDA (on this machine) the layer is three chlo.ragged_dot ops: the same decisions as on CPU, and each
  becomes a grouped twin that holds one ragged GEMM on quantized operands: no dot_general over every group, so the
  GEMM work stays that of the program."""
  args = _inputs()
  traced = jax.jit(_layer).trace(*args)
  cpu, gpu = _transform(traced.lower(), "cpu"), _transform(traced.lower(lowering_platforms=("cuda",)), "cuda")
  decided = lambda rows: [(r["role"], r["decision"], r["rule"]) for r in rows]  # noqa: E731
  assert decided(gpu.rows) == decided(cpu.rows), (decided(cpu.rows), decided(gpu.rows))
  assert sorted(decided(gpu.rows)) == [(role, "nvfp4", "nvfp4") for role in ("dgrad", "fprop", "wgrad")]
  text = str(gpu.module)
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("\n  }\n")]
  assert main.count("chlo.ragged_dot") == 0 and main.count("call @xla_fp4_twin_ragged_") == 3
  assert text.count('"chlo.ragged_dot"(') == 3 and "stablehlo.dot_general" not in text


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_lowered_for_gpu_an_expert_layer_runs_in_an_mx_format(fmt, monkeypatch):
  """XLA_FP4_FORMAT=mxfp4/mxfp8 on the layer lowered for CUDA: each chlo.ragged_dot becomes numerics/grouped_mx.py's
  twin (one ragged GEMM on MX operands, no per-group decode scale) with the format's recipe: 2D tiles and the wgrad's
  RHT where the format takes them. (XLA CPU cannot compile a chlo.ragged_dot, so the twins' numbers are checked
  against grouped_mx's reference in tests/numerics/test_grouped_mx.py; here, which twins the pass calls, and how.)"""
  from xla_fp4.numerics import formats, grouped_mx
  calls = []
  for name in ("ragged_rows", "ragged_contracting"):
    def recorded(*a, _fn=getattr(grouped_mx, name), **params):
      calls.append((_fn.__name__, params))
      return _fn(*a, **params)
    recorded.__name__, recorded.__module__ = name, __name__  # a twin of its own: lowered here, not from a cache
    monkeypatch.setattr(grouped_mx, name, recorded)
  args = _inputs(n=64)  # the dgrad contracts N: a multiple of 32
  result = _transform(jax.jit(_layer).trace(*args).lower(lowering_platforms=("cuda",)), "cuda", format=fmt)
  assert sorted((r["role"], r["decision"]) for r in result.rows) == [(role, fmt) for role in ("dgrad", "fprop",
                                                                                               "wgrad")]
  text = str(result.module)
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("\n  }\n")]
  assert main.count("chlo.ragged_dot") == 0 and main.count("call @xla_fp4_twin_ragged_") == 3
  f = formats.FORMATS[fmt]
  rows = [p for name, p in calls if name == "ragged_rows"]
  (wgrad,) = [p for name, p in calls if name == "ragged_contracting"]
  assert len(rows) == 2 and all(p["fmt"] == fmt and p["rhs_recipe"] == (f.tiles_2d, False, False) for p in rows)
  assert wgrad["fmt"] == fmt and wgrad["lhs_recipe"] == wgrad["rhs_recipe"] == (False, False, f.rht)


def test_the_gpu_forms_quantize_as_the_reference():
  """numerics.grouped's ragged_rows and ragged_contracting (what a chlo.ragged_dot becomes) against the reference, with
  stochastic rounding: the per-group keys and the element numbering follow the reference's, the wgrad's copy into
  blocks of their own is the reference's masking. Run on CPU, where the ragged GEMM expands, the results match bit for
  bit."""
  w, x, ct, sizes = _inputs()
  key = jnp.uint32(9)
  salt = lambda operand, v: formats.fold_in(key, operand) ^ qz.tensor_digest(v)  # noqa: E731
  sr = nv.OperandRecipe(rounding="stochastic")
  rows = jax.jit(functools.partial(grouped.ragged_rows, lhs_contracting=1, rhs_contracting=2, rhs_group=0,
                                   lhs_recipe=(False, True, False), rhs_recipe=(True, False, False), rht_seed=SEED,
                                   dtype="float32"))
  want = grouped.ragged_dot(ct, jnp.swapaxes(w, 1, 2), sizes, lhs_recipe=sr, key=key)
  assert_same_bits(rows(ct, w, sizes, salt(1, ct), salt(2, w)), want)
  contracting = jax.jit(functools.partial(grouped.ragged_contracting, lhs_recipe=(False, False, True),
                                          rhs_recipe=(False, True, True), rht_seed=SEED, dtype="float32"))
  want = grouped.ragged_contracting_dot(x, ct, sizes, lhs_recipe=nv.OperandRecipe(rht=True),
                                        rhs_recipe=nv.OperandRecipe(rounding="stochastic", rht=True), key=key,
                                        rht_seed=SEED)
  assert_same_bits(contracting(x, ct, sizes, salt(1, x), salt(2, ct)), want)


def _einsum_layer(w, x, ct):
  """An einsum MoE layer as MaxText's dense path writes it, its forward and both gradients."""
  h = jnp.sin(x)  # an activation, as in a model (were it an argument, it could be the weight as well)
  y, vjp = jax.vjp(lambda w, h: jnp.einsum("bseh,ehm->bsem", h, w), w, h)
  return (y,) + vjp(ct)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_expert_einsum_scales_each_expert_on_its_own(fp4, dtype):
  """An einsum MoE as MaxText's dense path writes it (`bseh,ehm->bsem`: the expert a batch dim, not the leading one;
  the wgrad contracts batch and sequence): each expert's weights and tokens get their own decode scale, in all three
  roles, equal to the emulated GEMM per expert; an expert with small weights keeps them (one scale over all experts
  would flush them to zero)."""
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (2, 16, 4, 32)).astype(dtype)
  w = (jax.random.normal(k[1], (4, 32, 64)) * jnp.array([1.0, 1.0, 1e-4, 1.0])[:, None, None]).astype(dtype)
  ct = jax.random.normal(k[2], (2, 16, 4, 64)).astype(dtype)

  got = jax.jit(_einsum_layer)(w, x, ct)
  x = jnp.sin(x)
  rht, w2d = nv.OperandRecipe(rht=True), nv.OperandRecipe(block_2d=True)
  per_expert = jax.jit(jax.vmap(lambda x, w, ct: (
      nv.dot_general(x, w, (((2,), (0,)), ((), ())), b_recipe=w2d),
      nv.dot_general(x, ct, (((0, 1), (0, 1)), ((), ())), a_recipe=rht, b_recipe=rht, rht_seed=SEED),
      nv.dot_general(ct, w, (((2,), (1,)), ((), ())), b_recipe=w2d)), in_axes=(2, 0, 2), out_axes=(2, 0, 2)))
  for g, r in zip(got, per_expert(x, w, ct)):
    assert_same_bits(g, r)
  assert float(jnp.max(jnp.abs(got[0][:, :, 2].astype(jnp.float32)))) > 0


def _dense_moe_layer(wi, wo, x, ct):
  """A dense MoE expert MLP as MaxText's `sparse_matmul=false` path writes it (every token meets every expert: the up
  projection's expert dim is a free dim of its weight), its forward and its gradients."""
  h = jnp.sin(x)

  def mlp(wi, wo, h):
    return jnp.einsum("BSEH,EHM->BSEM", jax.nn.silu(jnp.einsum("BSM,EMH->BSEH", h, wi)), wo)
  y, vjp = jax.vjp(mlp, wi, wo, h)
  return (y,) + vjp(ct)


def test_a_dense_moe_scales_each_expert_of_its_up_projection_on_its_own(fp4):
  """The up projection `BSM,EMH->BSEH` (found by the analysis from its flow into the down projection's batch dim):
  each expert's weight slice gets its own decode scale and meets the whole activation (one scale: every token meets
  every expert); its wgrad scales each expert's slice of the gradient, its dgrad each expert's gradient and weight
  and sums the experts' products. Equal, in all roles of both layers, to the emulated GEMM per expert bit for bit
  (float32: in bfloat16 XLA CPU's excess precision between the GEMMs differs with the fusions); an expert with small
  weights keeps them."""
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (2, 16, 32))
  wi = jax.random.normal(k[1], (4, 32, 64)) * jnp.array([1.0, 1.0, 1e-4, 1.0])[:, None, None]
  wo = jax.random.normal(k[2], (4, 64, 32))
  ct = jax.random.normal(k[3], (2, 16, 4, 32))
  got = jax.jit(_dense_moe_layer)(wi, wo, x, ct)
  rht, w2d = nv.OperandRecipe(rht=True), nv.OperandRecipe(block_2d=True)

  def reference(wi, wo, h, ct):
    per_expert = lambda f, *a, **kw: jax.vmap(f, **kw)(*a)  # noqa: E731
    u = per_expert(lambda w: nv.dot_general(h, w, (((2,), (0,)), ((), ())), b_recipe=w2d), wi, out_axes=2)
    a, silu_vjp = jax.vjp(jax.nn.silu, u)
    y = per_expert(lambda a, w: nv.dot_general(a, w, (((2,), (0,)), ((), ())), b_recipe=w2d), a, wo,
                   in_axes=(2, 0), out_axes=2)
    wgrad = lambda x, g: nv.dot_general(x, g, (((0, 1), (0, 1)), ((), ())), a_recipe=rht, b_recipe=rht,  # noqa: E731
                                        rht_seed=SEED)
    dwo = per_expert(wgrad, a, ct, in_axes=(2, 2))
    da = per_expert(lambda g, w: nv.dot_general(g, w, (((2,), (1,)), ((), ())), b_recipe=w2d), ct, wo,
                    in_axes=(2, 0), out_axes=2)
    (du,) = silu_vjp(da)
    dwi = per_expert(lambda g: wgrad(h, g), du, in_axes=2)
    dh = jnp.sum(per_expert(lambda g, w: nv.dot_general(g, w, (((2,), (1,)), ((), ())), b_recipe=w2d), du, wi,
                            in_axes=(2, 0)), axis=0)
    return y, dwi, dwo, dh
  for g, r in zip(got, jax.jit(reference)(wi, wo, jnp.sin(x), ct)):
    assert_same_bits(g, r)
  assert float(jnp.max(jnp.abs(got[0][:, :, 2]))) > 0  # one scale over all experts would flush its weights


def test_slices_of_an_operand_draw_their_own_stochastic_rounding():
  """slice_qdq (a dot_general's expert slices) with stochastic rounding: slice g is the reference's group g, keyed
  fold_in(the operand's key, g), so experts with equal values still draw different bits."""
  x = jnp.tile(jax.random.normal(jax.random.key(4), (1, 32, 64)), (3, 1, 1))  # three equal slices
  salt = jnp.uint32(11)
  q, s = jax.jit(functools.partial(grouped.slice_qdq, groups=(0,), axis=2, block_2d=False, stochastic=True, rht=False,
                                   rht_seed=SEED))(x, salt)
  key = salt ^ qz.tensor_digest(x)
  recipe = nv.OperandRecipe(rounding="stochastic")
  for g in range(3):
    want, want_s = grouped._quantized(x[g], 1, recipe, formats.fold_in(key, jnp.int32(g)), SEED)
    assert_same_bits(q[g], want)
    assert_same_bits(s[g], want_s)
  assert not np.array_equal(q[0], q[1])


@pytest.mark.parametrize("program", ["ragged", "einsum"])
def test_the_native_backend_runs_the_fp4_gemm_once_per_expert(program):
  """XLA_FP4_BACKEND=native (here the C++ reference FP4 GEMM): each expert's slices packed with their own scales and
  multiplied by the FP4 GEMM, one call per expert and dot, equal to the emulated grouped recipe bit for bit (nearest
  rounding)."""
  if program == "ragged":
    layer, args, experts = _layer, _inputs(), len(SIZES)
  else:
    k = jax.random.split(jax.random.key(3), 3)
    args = (jax.random.normal(k[0], (4, 32, 64)), jax.random.normal(k[1], (2, 16, 4, 32)),
            jax.random.normal(k[2], (2, 16, 4, 64)))
    layer, experts = _einsum_layer, 4
  out = {}
  for backend in ("emulate", "native"):
    xla_fp4.enable(backend=backend, **OPTIONS)
    try:
      compiled = jax.jit(layer).lower(*args).compile()
      out[backend] = (compiled(*args), compiled.as_text().count('custom_call_target="xla_fp4_gemm_packed"'))
    finally:
      xla_fp4.disable()
  assert out["emulate"][1] == 0 and out["native"][1] == 3 * experts
  for e, n in zip(out["emulate"][0], out["native"][0]):
    assert_same_bits(n, e)


def test_a_ragged_dot_whose_k_cublaslt_cannot_take_stays_emulated_under_the_native_backend():
  """Lowered for CUDA with N = 48: the forward (K = 32) and the wgrad (K: the groups' rows, padded to 32) run the
  grouped FP4 GEMM; the dgrad contracts N = 48, which cuBLASLt's FP4 GEMM does not take, and the report says so."""
  from xla_fp4.passes import analysis, policy
  module = jax.jit(_layer).trace(*_inputs()).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  with module.context:
    a = analysis.analyze(module)
    decided, _ = policy.decide(a, config.load(environ={}, enabled=True, **OPTIONS))
    plans = policy.plan(a, decided, partitioned=False, native=True, cuda=True)
  got = {str(p.site.role): (p.form, p.notes) for p in plans}
  assert got == {"fprop": (policy.Form.PACKED_GROUPED, ()), "wgrad": (policy.Form.PACKED_GROUPED, ()),
                 "dgrad": (policy.Form.GROUPED, ("cuBLASLt's FP4 GEMM needs K a multiple of 32, K=48: emulated",))}


@pytest.mark.parametrize("form", ["forward", "dgrad", "wgrad"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_the_grouped_fp4_gemm_on_packed_operands_computes_the_gpu_forms(form, stochastic):
  """The native form of a chlo.ragged_dot: numerics.grouped's ragged_rows_packed / ragged_contracting_packed (the
  operands packed per group, K-major; the wgrad's groups padded to 32 rows) and xla_fp4_ragged_gemm_packed (here the
  C++ reference GEMM) equal the emulated forms ragged_rows / ragged_contracting bit for bit, stochastic rounding
  included."""
  w, x, ct, sizes = _inputs(n=64)
  salts = (jnp.uint32(3), jnp.uint32(7))
  if form == "wgrad":
    params = dict(lhs_recipe=(False, False, True), rhs_recipe=(False, stochastic, True), rht_seed=SEED)
    lhs, rhs, emulated, packed = x, ct, grouped.ragged_contracting, grouped.ragged_contracting_packed
  else:
    params = dict(lhs_contracting=1, rhs_contracting=1 if form == "forward" else 2, rhs_group=0,
                  lhs_recipe=(False, stochastic, False), rhs_recipe=(True, False, False), rht_seed=SEED)
    lhs, rhs, emulated, packed = (x if form == "forward" else ct), w, grouped.ragged_rows, grouped.ragged_rows_packed
  want = jax.jit(functools.partial(emulated, dtype="float32", **params))(lhs, rhs, sizes, *salts)
  operands = jax.jit(functools.partial(packed, **params))(lhs, rhs, sizes, *salts)
  if form == "wgrad":
    *codes, padded_sizes, alpha = operands
    assert not np.asarray(padded_sizes % 32).any() and int(padded_sizes.sum()) <= codes[0].shape[1] * 2
    got = kernels.ragged_gemm_packed(*codes, padded_sizes, alpha, ragged_k=True)
  else:
    got = kernels.ragged_gemm_packed(*operands[:4], sizes, operands[4])
  assert_same_bits(got, want)


@pytest.mark.parametrize("dtype,telemetry", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)],
                         ids=["float32", "bfloat16", "telemetry"])
def test_lowered_for_blackwell_each_ragged_dot_is_one_grouped_fp4_gemm(monkeypatch, tmp_path, dtype, telemetry):
  """XLA_FP4_BACKEND=native where the FP4 GEMM runs (the CUDA lowering, rewritten here with cuBLASLt's FP4 GEMM taken
  as supported): each chlo.ragged_dot, forward, dgrad and wgrad, becomes the twin that packs its operands per group
  and one xla_fp4_ragged_gemm_packed, which takes the group sizes at run time. No chlo.ragged_dot is left, so the
  module compiles for this CPU, where the C++ reference GEMM runs it: equal to numerics.grouped's reference bit for
  bit, with telemetry too (which records both operands of every role)."""
  from xla_fp4 import telemetry as telemetry_files
  from xla_fp4.kernels import registry
  from xla_fp4.passes.rewrite import FfiKernels
  monkeypatch.setattr(registry, "fp4_gemm_supported", lambda: (True, ""))
  kernels.register()
  args = _inputs(dtype, n=64)
  lowered = jax.jit(_layer).trace(*args).lower(lowering_platforms=("cuda",))
  options = dict(OPTIONS, backend="native", **(dict(telemetry=str(tmp_path)) if telemetry else {}))
  result = pipeline.transform(lowered.compiler_ir("stablehlo"), config.load(environ={}, enabled=True, **options),
                              platform="cuda", kernels=lambda m: FfiKernels())
  text = str(result.module)
  assert text.count("stablehlo.custom_call @xla_fp4_ragged_gemm_packed") == 3 and "chlo.ragged_dot" not in text
  assert "mhlo.backend_config = {ragged_k = true}" in text
  for got, want in zip(run_on_cpu(result.module, args), jax.jit(_reference)(*args)):
    assert_same_bits(got, want)
  if telemetry:
    telemetry_files.flush()
    records = telemetry_files.load(str(tmp_path))
    assert sorted((r["role"], r["operand"]) for r in records) == [
        ("dgrad", "gradient"), ("dgrad", "weight"), ("fprop", "activation"), ("fprop", "weight"),
        ("wgrad", "activation"), ("wgrad", "gradient")]
