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
from xla_fp4 import config, numerics as nv
from xla_fp4.numerics import formats, grouped
from xla_fp4.numerics import nvfp4 as qz
from xla_fp4.passes import pipeline
from xla_fp4.passes.rewrite import ReferenceKernels

from nvfp4_testing import assert_same_bits

M, K, N = 96, 32, 48
SIZES = (20, 0, 9, 40, 11)  # one empty group, sizes off the 16-row blocks, 16 rows after the last group
SEED = 5
OPTIONS = dict(stochastic_rounding=False, keep_head=False, min_dim=1, seed=SEED)


def _layer(w, x, ct, sizes):
  """An expert layer's forward and its two gradients (for the cotangent `ct`): what a training step computes."""
  y, vjp = jax.vjp(lambda w, x: jax.lax.ragged_dot(x, w, sizes), w, x)
  dw, dx = vjp(ct)
  return y, dx, dw


def _inputs(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(k[0], (len(SIZES), K, N)) * jnp.array([1.0, 3.0, 0.01, 1.0, 100.0])[:, None, None]
  x = jax.random.normal(k[1], (M, K)) * jnp.linspace(0.1, 10, M)[:, None]  # groups with different ranges
  ct = jax.random.normal(k[2], (M, N))
  return w.astype(dtype), x.astype(dtype), ct.astype(dtype), jnp.asarray(SIZES, jnp.int32)


def _reference(w, x, ct, sizes):
  """The paper's recipe per role, from numerics.grouped: weights in 16x16 tiles per expert, both wgrad operands through
  the RHT along the rows (nearest rounding here, so that the keys do not matter)."""
  rht = nv.OperandRecipe(rht=True)
  y = grouped.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
  dx = grouped.ragged_dot(ct, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=x.dtype)
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


def test_a_ragged_dot_lowered_for_gpu_stays_emulated_under_the_native_backend():
  """A chlo.ragged_dot's groups are sized at run time: no per-expert FP4 GEMM takes them, and the report says so."""
  from xla_fp4.passes import analysis, policy
  module = jax.jit(_layer).trace(*_inputs()).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
  with module.context:
    a = analysis.analyze(module)
    decided, _ = policy.decide(a, config.load(environ={}, enabled=True, **OPTIONS))
    plans = policy.plan(a, decided, partitioned=False, native=True, cuda=True)
  assert len(plans) == 3 and all(p.form is policy.Form.GROUPED for p in plans)
  assert all(p.notes == ("a ragged dot: no grouped FP4 GEMM takes groups sized at run time: emulated",) for p in plans)
