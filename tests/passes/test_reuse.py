"""A nearest-rounded operand is quantized once for all the dots that read it, or a reshape of it, in the same blocks
(rewrite.reuse.blocking): a dgrad reuses its fprop's 16x16-tiled weight even where one of them merges the weight's dims."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics.gemm import OperandRecipe
from xla_fp4.passes import pipeline, rewrite
from xla_fp4.passes.rewrite import reuse

D, H, K = 64, 4, 16

# (shape, axis) views of one 64 x 4 x 16 tensor: its reshapes, quantized along each of their axes.
VIEWS = [((D, H, K), a) for a in range(3)] + [((D, H * K), a) for a in range(2)] + \
    [((D * H, K), a) for a in range(2)] + [((H, K, D), a) for a in range(3)] + [((H * K, D), a) for a in range(2)]


@pytest.mark.parametrize("fmt,block_2d,rht", [("nvfp4", False, False), ("nvfp4", True, False), ("nvfp4", False, True),
                                              ("mxfp8", False, False), ("mxfp4", True, False)])
def test_equal_blocking_means_the_same_quantized_values(fmt, block_2d, rht):
  """The reuse rule against the kernels' twins: views with equal blocking quantize to the same values in row-major
  order, and views with different blocking do not (random data: some block's scale, or RHT, differs)."""
  x = np.asarray(jax.random.normal(jax.random.key(0), (D * H * K,)) * jnp.exp(jax.random.normal(jax.random.key(1),
                                                                                                  (D * H * K,))))
  q = {}
  block = 16 if fmt == "nvfp4" else 32
  for shape, axis in VIEWS:
    if shape[axis] % block == 0 and not (block_2d and _partner(shape, axis) % block):
      params = dict(axis=axis, block_2d=block_2d, stochastic=False, rht=rht, rht_seed=7)
      if fmt == "nvfp4":
        y, _ = kernel_twins.qdq_with_scale(jnp.asarray(x.reshape(shape)), jnp.uint32(0), **params)
      else:
        y = kernel_twins.mx_qdq(jnp.asarray(x.reshape(shape)), jnp.uint32(0), fp8=fmt == "mxfp8", **params)
      q[shape, axis] = np.asarray(y).reshape(-1)
  pairs = 0
  recipe = OperandRecipe(block_2d=block_2d, rht=rht, format=fmt)
  for (a, qa), (b, qb) in itertools.combinations(q.items(), 2):
    same = reuse.blocking(a[0], a[1], recipe) == reuse.blocking(b[0], b[1], recipe)
    assert np.array_equal(qa, qb) == same, (a, b)
    pairs += same
  assert pairs >= (3 if fmt == "nvfp4" else 2)


def _partner(shape, axis):
  """The size of the dims a 2D tile pairs with the axis (the flattened trailing dims, or the leading ones)."""
  trailing = int(np.prod(shape[axis + 1:]))
  return trailing if trailing > 1 else int(np.prod(shape[:axis]))


def _attention_like(wq, wo, x):
  q = jnp.einsum("bsd,dhk->bshk", x, wq)  # wq (D, heads, head_dim); its dgrad contracts (heads, head_dim)
  return jnp.sum(jnp.tanh(jnp.einsum("bshk,hkd->bsd", jnp.tanh(q), wo)))  # wo's fprop contracts (heads, head_dim)


def test_a_dgrad_reuses_the_fprops_weight_through_a_merge_of_its_dims():
  args = (jax.random.normal(jax.random.key(0), (D, H, K)) * 0.1, jax.random.normal(jax.random.key(1), (H, K, D)) * 0.1,
          jax.random.normal(jax.random.key(2), (2, 32, D)))
  grad = jax.grad(_attention_like, argnums=(0, 1, 2))
  module = jax.jit(grad).lower(*args).compiler_ir("stablehlo")
  xla_fp4.enable()
  try:
    result = pipeline.transform(module, xla_fp4.config.load(enabled=True, keep_head=False,
                                                            stochastic_rounding=False))
    got = jax.jit(grad)(*args)
  finally:
    xla_fp4.disable()
  assert [r["role"] for r in result.rows if r["decision"] == "nvfp4"].count("dgrad") == 2
  text = str(result.module)
  assert text.count("block_2d = true") == 2, "each weight quantized once, for its fprop and its dgrad"
  base = jax.jit(grad)(*args)
  for g, b in zip(got, base):  # NVFP4 noise, the baseline's direction
    assert 0 < float(jnp.linalg.norm(g - b) / jnp.linalg.norm(b)) < 0.5
