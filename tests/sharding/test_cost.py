"""sharding/cost.py reads the same cost from a compiled executable and from the HLO proto XLA dumps of it."""

import jax
import jax.numpy as jnp

import xla_fp4
from xla_fp4.sharding import cost


def test_the_dumped_proto_gives_the_compiled_cost():
  def loss(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))
  args = (jnp.ones((64, 128)), jnp.ones((128, 64)), jnp.ones((32, 64)))
  xla_fp4.enable(strict=True, keep_head=False)
  try:
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
  finally:
    xla_fp4.disable()
  from_executable = cost.cost(compiled)
  assert from_executable.dot_flops > 0 and from_executable.quantized_elements > 0
  module, = compiled.runtime_executable().hlo_modules()
  assert cost.hlo_proto_cost(module.as_serialized_hlo_module_proto()) == from_executable


def test_telemetry_changes_no_quantized_element_count(tmp_path):
  """The quantizers' telemetry forms (xla_fp4_*_stats) quantize as much as the plain ones: the cost model counts
  them too (it missed them, and undercounted quantized elements with telemetry on)."""
  def loss(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))
  args = (jnp.ones((64, 128)), jnp.ones((128, 64)), jnp.ones((32, 64)))
  counts = {}
  for telemetry in ("", str(tmp_path)):
    xla_fp4.enable(strict=True, keep_head=False, telemetry=telemetry)
    try:
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    finally:
      xla_fp4.disable()
    assert ("_stats" in compiled.as_text()) == bool(telemetry)
    counts[bool(telemetry)] = cost.cost(compiled).quantized_elements
  assert counts[True] == counts[False] > 0, counts
