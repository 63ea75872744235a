"""The MX formats on expert GEMMs (numerics/grouped_mx.py): what the pass emits for a chlo.ragged_dot against the
reference that quantizes each group and each expert on its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_fp4.numerics import grouped_mx, mx

M, K, N = 96, 96, 64
SIZES = (20, 0, 37, 33)  # off the 32-row blocks, an empty group, 6 rows after the last group
SR, RHT = (False, True, False), (False, False, True)


def _inputs(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(3), 3)
  w = jax.random.normal(k[0], (len(SIZES), K, N)) * jnp.array([1.0, 3.0, 1e-3, 100.0])[:, None, None]
  x = jax.random.normal(k[1], (M, K)) * jnp.linspace(0.01, 10, M)[:, None]
  ct = jax.random.normal(k[2], (M, N))
  return w.astype(dtype), x.astype(dtype), ct.astype(dtype), jnp.asarray(SIZES, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_the_pass_forms_equal_the_reference(fmt, dtype):
  """ragged_rows (forward; dgrad with stochastic rounding where the format has it, through the transposed experts)
  and ragged_contracting (wgrad: 32-row blocks of their own per group, the RHT where the format has it) against the
  reference. On CPU the ragged GEMM expands: MXFP4's products sum exactly, so those results agree bit for bit;
  MXFP8's more significant bits leave the float32 summation order to XLA's dot (within K ulps)."""
  w, x, ct, sizes = _inputs(dtype)
  stochastic = fmt == "mxfp4"

  def same(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if fmt == "mxfp4":
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=K * 2.0**-23, atol=K * 2.0**-23 * np.abs(want).max())
  grad = (False, stochastic, False)
  wgrad_x, wgrad_dy = (False, False, stochastic), (False, stochastic, stochastic)  # mxfp4: the RHT and SR in wgrad
  rows = functools.partial(grouped_mx.ragged_rows, rht_seed=7, dtype=jnp.dtype(dtype).name, fmt=fmt)
  y = jax.jit(functools.partial(rows, lhs_contracting=1, rhs_contracting=1, rhs_group=0, lhs_recipe=(False,) * 3,
                                rhs_recipe=(True, False, False)))(x, w, sizes, jnp.uint32(1), jnp.uint32(2))
  want = grouped_mx.ragged_dot(x, w, sizes, fmt, lhs_salt=1, rhs_salt=2, rht_seed=7)
  same(y, want)
  # the dgrad reads the experts transposed ([G, N, K] contracting N): tiles are still each expert's own
  wt = jnp.swapaxes(w, 1, 2)
  dx = jax.jit(functools.partial(rows, lhs_contracting=1, rhs_contracting=1, rhs_group=0, lhs_recipe=grad,
                                 rhs_recipe=(True, False, False)))(ct, wt, sizes, jnp.uint32(3), jnp.uint32(4))
  want = grouped_mx.ragged_dot(ct, wt, sizes, fmt, lhs_recipe=grad, lhs_salt=3, rhs_salt=4, rht_seed=7)
  same(dx, want)
  dw = jax.jit(functools.partial(grouped_mx.ragged_contracting, lhs_recipe=wgrad_x, rhs_recipe=wgrad_dy, rht_seed=7,
                                 dtype=jnp.dtype(dtype).name, fmt=fmt))(x, ct, sizes, jnp.uint32(5), jnp.uint32(6))
  want = grouped_mx.ragged_contracting_dot(x, ct, sizes, fmt, lhs_recipe=wgrad_x, rhs_recipe=wgrad_dy, lhs_salt=5,
                                           rhs_salt=6, rht_seed=7)
  assert dw.shape == (len(SIZES), K, N)
  same(dw, want)
  assert not np.asarray(dw[1]).any()  # the empty group
  # and the quantization is there: not the plain ragged dot
  assert not np.allclose(np.asarray(y, np.float32), np.asarray(jax.lax.ragged_dot(x, w, sizes), np.float32))


def test_the_reference_quantizes_each_group_and_expert_on_its_own():
  """The reference's pieces against mx.qdq directly: a group's rows are the masked operand's MX values (rows of other
  groups do not change a block's scale), and an expert's tiles lie within the expert."""
  w, x, _, sizes = _inputs()
  y = grouped_mx.ragged_dot(x, w, sizes, "mxfp4")
  qx = mx.qdq(x, "mxfp4", axis=1)
  qw = jnp.stack([mx.qdq(w[g], "mxfp4", axis=0, block_2d=True) for g in range(len(SIZES))])
  np.testing.assert_allclose(np.asarray(y), np.asarray(jax.lax.ragged_dot(qx, qw, sizes, precision="highest")),
                             rtol=1e-6, atol=1e-6 * float(jnp.abs(y).max()))
  # a block straddling groups 2 and 3 (rows 32..63 hold both): the wgrad quantizes each group's share on its own
  dw = grouped_mx.ragged_contracting_dot(x, x, sizes, "mxfp4")
  rows3 = np.zeros((M, K), np.float32)
  rows3[57:90] = np.asarray(x[57:90])
  q3 = np.asarray(mx.qdq(jnp.asarray(rows3), "mxfp4", axis=0))
  np.testing.assert_allclose(np.asarray(dw[3]), q3.T @ q3, rtol=1e-5, atol=1e-5 * float(np.abs(q3.T @ q3).max()))


def test_statistics_of_the_ragged_forms():
  """numerics/telemetry.py's rows of grouped_mx's operands: the token rows of the groups (the 6 rows after the last
  group count as zeros), each expert's matrix on its own, the wgrad's per-group blocks; a planted block of tiny values
  (normal, below what E8M0's 2^-126 reaches) counts as lost in every form that holds it whole."""
  from xla_fp4.numerics import telemetry as st
  w, x, ct, sizes = _inputs()
  x = x.at[0, :32].set(1.5e-38)
  rows = functools.partial(st.mx_ragged_rows_stats, lhs_contracting=1, rhs_contracting=1, rhs_group=0,
                           lhs_recipe=(False,) * 3, rhs_recipe=(True, False, False), rht_seed=7, dtype="float32",
                           fmt="mxfp4")
  x_row, w_row = np.asarray(jax.jit(rows)(x, w, sizes, jnp.uint32(1), jnp.uint32(2)))
  field = {f: i for i, f in enumerate(st.FIELDS)}
  in_groups = sum(SIZES)
  assert x_row[field["elements"]] == M * K and x_row[field["nonzero"]] == in_groups * K
  assert x_row[field["live_blocks"]] == in_groups * K // 32 and x_row[field["scale_underflow"]] == 1
  assert x_row[field["s_dec"]] == 1 and x_row[field["scale_saturated"]] == 0
  want_w = [np.asarray(st.mx_operand_stats(w[g], mx.qdq(w[g], "mxfp4", axis=0, block_2d=True), axis=0,
                                           block_2d=True, rht=False, rht_seed=7, fmt="mxfp4")) for g in range(len(SIZES))]
  np.testing.assert_allclose(w_row, np.asarray(st.combine(jnp.asarray(np.stack(want_w)))), rtol=1e-6)
  dx_row, dy_row = np.asarray(jax.jit(functools.partial(
      st.mx_ragged_contracting_stats, lhs_recipe=(False,) * 3, rhs_recipe=(False,) * 3, rht_seed=7, dtype="float32",
      fmt="mxfp4"))(x, ct, sizes, jnp.uint32(1), jnp.uint32(2)))
  assert dx_row[field["elements"]] == M * K and dx_row[field["nonzero"]] == in_groups * K
  assert dx_row[field["scale_underflow"]] == 0  # along the rows, row 0's tiny values share blocks with group 0's rows
  assert dy_row[field["quantized_nonzero"]] > 0
