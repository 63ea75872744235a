"""The grouped recipe (xla_fp4.numerics.grouped): jax.lax.ragged_dot with NVFP4 operands, scaled per expert and per
group of rows, groups of any size kept apart by masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_fp4 import numerics as nv

SIZES = (16, 8, 0, 27, 13)  # uneven groups, an empty one; 64 rows
K, N = 32, 48
WEIGHT = nv.OperandRecipe(block_2d=True)
WGRAD = dict(lhs_recipe=nv.OperandRecipe(rht=True), rhs_recipe=nv.OperandRecipe(rounding="stochastic", rht=True),
             key=7, rht_seed=3)


def _data(dtype=jnp.float32, sizes=SIZES):
  k = jax.random.split(jax.random.key(0), 3)
  m = sum(sizes)
  return (jax.random.normal(k[0], (m, K), dtype), jax.random.normal(k[1], (len(sizes), K, N), dtype),
          jax.random.normal(k[2], (m, N), dtype), jnp.asarray(sizes, jnp.int32))


_dense = jax.jit(nv.dot_general, static_argnames=("dimension_numbers", "a_recipe", "b_recipe", "rht_seed"))
_ragged = jax.jit(nv.ragged_dot, static_argnames=("lhs_recipe", "rhs_recipe", "rht_seed"))
_contracting = jax.jit(nv.ragged_contracting_dot, static_argnames=("lhs_recipe", "rhs_recipe", "rht_seed"))


def _rows(sizes, g):
  start = int(np.sum(sizes[:g]))
  return slice(start, start + sizes[g])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_group_is_the_dense_recipe_on_its_rows(dtype):
  """Forward (and dgrad, the same call with the weights transposed): group g's rows are numerics.dot_general of
  those rows with expert g's weight: one scale per group of rows, one per expert. Bit for bit in bfloat16; in float32
  to the last bit, which XLA's fusion of the two jitted programs may place differently (eagerly: bit for bit)."""
  x, w, dy, sizes = _data(dtype)
  y = _ragged(x, w, sizes)
  dx = _ragged(dy, jnp.swapaxes(w, 1, 2), sizes)
  for g, size in enumerate(SIZES):
    if not size:
      continue
    rows = _rows(SIZES, g)
    dims = (((1,), (0,)), ((), ()))
    for got, want in ((y[rows], _dense(x[rows], w[g], dims, b_recipe=WEIGHT)),
                      (dx[rows], _dense(dy[rows], w[g].T, dims, b_recipe=WEIGHT))):
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=0 if dtype == jnp.bfloat16 else 2e-7, atol=0 if dtype == jnp.bfloat16 else 2e-6)


def test_the_wgrad_of_aligned_groups_is_the_dense_recipe_on_each_group():
  """Where every group starts at a multiple of 16, masking and slicing quantize the same blocks: out[g] is
  dot_general over group g's rows (the contraction) with the paper's wgrad recipe, up to f32 summation order."""
  sizes = (16, 32, 0, 16)
  x, _, dy, group_sizes = _data(sizes=sizes)
  out = _contracting(x, dy, group_sizes, lhs_recipe=nv.OperandRecipe(rht=True), rhs_recipe=nv.OperandRecipe(rht=True),
                     rht_seed=3)
  for g, size in enumerate(sizes):
    if not size:
      assert not jnp.any(out[g]), "an empty group's weight gradient is zero"
      continue
    rows = _rows(sizes, g)
    ref = _dense(x[rows], dy[rows], (((0,), (0,)), ((), ())), a_recipe=nv.OperandRecipe(rht=True),
                 b_recipe=nv.OperandRecipe(rht=True), rht_seed=3)
    np.testing.assert_allclose(out[g], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["forward", "wgrad"])
def test_no_group_sees_another_groups_numbers(which):
  """Groups of 8, 27 and 13 rows share 16-row blocks and RHT blocks; changing one group's rows changes nothing of the
  others' results, bit for bit (stochastic rounding and the RHT included)."""
  x, w, dy, sizes = _data()
  changed = x.at[_rows(SIZES, 3)].multiply(1000.0)  # group 3: rows 24-50, sharing blocks with groups 1 and 4
  if which == "forward":
    a, b = (_ragged(v, w, sizes, lhs_recipe=nv.OperandRecipe(rounding="stochastic"), key=1) for v in (x, changed))
    for g in (0, 1, 4):
      assert jnp.array_equal(a[_rows(SIZES, g)], b[_rows(SIZES, g)]), g
  else:
    a, b = (_contracting(v, dy, sizes, **WGRAD) for v in (x, changed))
    for g in (0, 1, 2, 4):
      assert jnp.array_equal(a[g], b[g]), g
  assert not jnp.array_equal(a, b)


def test_close_to_the_exact_product_and_differentiable():
  x, w, dy, sizes = _data()
  for got, exact in ((_ragged(x, w, sizes), jax.lax.ragged_dot(x, w, sizes)),
                     (_contracting(x, dy, sizes, **WGRAD),
                      jnp.stack([x[_rows(SIZES, g)].T @ dy[_rows(SIZES, g)] for g in range(len(SIZES))]))):
    assert float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)) < 0.25  # the NVFP4 error, not a bug's
  grad = jax.grad(lambda w: jnp.sum(nv.ragged_dot(x, w, sizes)))(w)
  assert jnp.array_equal(grad, jax.grad(lambda w: jnp.sum(jax.lax.ragged_dot(x, w, sizes)))(w))  # straight-through


def test_contractions_not_a_multiple_of_16_are_refused():
  x, w, _, sizes = _data()
  with pytest.raises(ValueError, match="multiple of 16"):
    nv.ragged_dot(x[:, :24], w[:, :24], sizes)
  with pytest.raises(ValueError, match="one entry per group"):
    nv.ragged_dot(x, w, sizes[:3])
