"""A data-parallel program on 4 (host) devices: the pass keeps it working, and amax stays a global reduction, so the
sharded step equals the single-device step bit for bit (nearest rounding). The two also take the pass's two forms (a
partitioned module: reductions feeding xla_fp4_qdq; one device: xla_fp4_qdq_with_scale), so this checks that they
agree. Runs in a subprocess: the device count is fixed when JAX's backend starts."""

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    def loss(w1, w2, x):
      return jnp.mean(jnp.tanh(x @ w1) @ w2)
    w1 = jax.random.normal(jax.random.key(0), (64, 128)) * 0.1
    w2 = jax.random.normal(jax.random.key(1), (128, 64)) * 0.1
    x = jax.random.normal(jax.random.key(2), (8, 32, 64))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    grad = lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))
    base = grad()(w1, w2, x)
    xla_fp4.enable(strict=True, stochastic_rounding=False)
    single, sharded = grad()(w1, w2, x), grad()(w1, w2, xs)
    hlo = lambda *a: grad().lower(*a).compile().as_text()
    single_hlo, sharded_hlo = hlo(w1, w2, x), hlo(w1, w2, xs)
    assert "xla_fp4_qdq_with_scale" in single_hlo, "one device: the kernel measures amax"
    assert "xla_fp4_qdq_with_scale" not in sharded_hlo and '"xla_fp4_qdq"' in sharded_hlo, "partitioned: reductions"
    xla_fp4.enable(strict=True)
    sharded_sr = grad()(w1, w2, xs)
    for s, d, b, r in zip(single, sharded, base, sharded_sr):
      assert jnp.array_equal(s, d), "sharded != single device"
      assert not jnp.array_equal(s, b), "the pass did not run"
      assert jnp.isfinite(r).all() and float(jnp.linalg.norm(r - b) / jnp.linalg.norm(b)) < 0.5
    print("OK")
""")


def test_data_parallel_step_matches_single_device():
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
