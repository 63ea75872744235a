"""Scanned layer stacks: one dot serves every layer, yet the high-precision blocks hold per iteration."""

import jax
import jax.numpy as jnp
import numpy as np

import xla_fp4

LAYERS = 8


def _layer(h, w):
  return jnp.tanh(h @ w), None


def _model(ws, x):
  h, _ = jax.lax.scan(jax.checkpoint(_layer), x, ws)
  return jnp.sum(h ** 2)


def _args():
  return (jax.random.normal(jax.random.key(0), (LAYERS, 64, 64)) * 0.2,
          jax.random.normal(jax.random.key(1), (32, 64)))


def _grad(**options):
  xla_fp4.enable(strict=True, **options)
  try:
    return jax.jit(jax.grad(_model))(*_args())
  finally:
    xla_fp4.disable()


def test_every_block_kept_is_bit_identical_to_baseline():
  base = jax.jit(jax.grad(_model))(*_args())
  assert jnp.array_equal(_grad(keep_first=0, keep_last=LAYERS), base)


def test_kept_blocks_select_per_iteration():
  base = jax.jit(jax.grad(_model))(*_args())
  none, last = _grad(keep_first=0, keep_last=0), _grad(keep_first=0, keep_last=1)
  first = _grad(keep_first=1, keep_last=0)
  err = lambda g: np.array([float(jnp.linalg.norm(g[i] - base[i]) / jnp.linalg.norm(base[i])) for i in range(LAYERS)])
  assert (err(none) > 1e-3).all()
  # Keeping only the first block: its forward and dgrad/wgrad run in high precision, the others do not. The first
  # layer's gradient still sees NVFP4 noise from later layers, so compare against running everything in NVFP4.
  assert not jnp.array_equal(first[0], none[0])
  assert not jnp.array_equal(last[LAYERS - 1], none[LAYERS - 1])


def test_decisions_report_the_scanned_stack():
  rows = xla_fp4.explain(jax.grad(_model), *_args())
  linear = [r for r in rows if r["role"] != "other"]
  assert {r["role"] for r in linear} == {"fprop", "dgrad", "wgrad"}
  assert all(r["block"] == "scan" and r["keep_blocks"] == [LAYERS - 1] for r in linear)


def test_a_kept_iteration_runs_the_dot_in_high_precision():
  """In a kept iteration the GEMM gets the operands themselves (the case's other branch), so with float32 operands
  the first layer of the stack, kept and fed the model's own input, is the baseline's bit for bit."""
  def layers(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w),) * 2, x, ws)[1]
  base = jax.jit(layers)(*_args())
  xla_fp4.enable(strict=True, keep_head=False, keep_first=1, keep_last=0, forward_only=True)
  try:
    rows = xla_fp4.explain(layers, *_args())
    kept_first = jax.jit(layers)(*_args())
  finally:
    xla_fp4.disable()
  assert [r["keep_blocks"] for r in rows if r["role"] == "fprop"] == [[0]]
  assert jnp.array_equal(kept_first[0], base[0])
  assert not jnp.array_equal(kept_first[1], base[1])
