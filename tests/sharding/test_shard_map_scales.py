"""A shard_map body's decode scales are the whole tensor's (passes/analysis/peers.py): its dots, dense and per
expert, quantize what one device quantizes. MaxText's sparse MoE runs its expert GEMMs in such a body under FSDP,
each device holding its own tokens; a scale measured per device made its sharded step-0 loss 0.014 from one
device's (DeepSeek-V3 and gpt-oss, unscanned).

The bodies run on 4 host devices, in a subprocess (the device count is fixed when the backend starts):
`python tests/sharding/test_shard_map_scales.py CASE` prints JSON."""

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import xla_fp4

ROOT = Path(__file__).resolve().parents[2]
DEVICES, GROUPS, ROWS, D, F = 4, 4, 64, 64, 128
# Rows of each group on each device: multiples of 16, so that the wgrad's 16-row blocks are one device's rows and one
# group's both sharded and on one device (the same blocks, the same quantization).
SIZES = np.array([[16, 32, 0, 16], [32, 0, 16, 16], [0, 16, 16, 32], [16, 16, 32, 0]], np.int32)


def _args():
  k = jax.random.split(jax.random.key(0), 4)
  # A wide spread of magnitudes between devices: a device's own amax would differ from the tensor's.
  x = jax.random.normal(k[0], (DEVICES * ROWS, D)) * jnp.repeat(jnp.array([1.0, 8.0, 0.5, 3.0]), ROWS)[:, None]
  return x, jax.random.normal(k[1], (D, D)) * 0.2, jax.random.normal(k[2], (GROUPS, D, F)) * 0.2


def _layer(x, w, we, sizes):
  return jnp.sum(jax.lax.ragged_dot(jnp.tanh(x @ w), we, sizes) ** 2)


def _sharded_loss(mesh):
  from jax.sharding import PartitionSpec as P

  @partial(jax.shard_map, mesh=mesh, in_specs=(P("fsdp"), P(), P(), P("fsdp")), out_specs=P())
  def body(x, w, we, sizes):
    return jax.lax.psum(_layer(x, w, we, sizes), "fsdp")
  return lambda x, w, we: body(x, w, we, jnp.asarray(SIZES.reshape(-1)))


def _one_device_order():
  """The rows of the one-device program: group by group, each device's rows of the group in device order."""
  starts = (np.cumsum(SIZES, axis=1) - SIZES).T  # [group, device]: where the group's rows start on the device
  order = [d * ROWS + starts[g, d] + r for g in range(GROUPS) for d in range(DEVICES) for r in range(SIZES[d, g])]
  return np.array(order + [d * ROWS + r for d in range(DEVICES) for r in range(SIZES[d].sum(), ROWS)])


def _one_device_loss(x, w, we):
  return _layer(x[_one_device_order()], w, we, jnp.asarray(SIZES.sum(axis=0)))


def _expert_parallel(mesh):
  """An einsum MoE in a body over experts x FSDP: (loss sharded, loss on one device, args). Each device holds 2 of
  the 4 experts and its tokens for them; the per-expert scales reduce over FSDP only."""
  from jax.sharding import PartitionSpec as P

  def layer(x, we):
    return jnp.sum(jnp.einsum("ecd,edf->ecf", x, we) ** 2)

  @partial(jax.shard_map, mesh=mesh, in_specs=(P("expert", "fsdp"), P("expert")), out_specs=P())
  def body(x, we):
    return jax.lax.psum(layer(x, we), ("expert", "fsdp"))
  k = jax.random.split(jax.random.key(1))
  scale = jnp.repeat(jnp.array([1.0, 8.0]), ROWS // 2)[None, :, None]  # the two FSDP shards' tokens differ widely
  return body, layer, (jax.random.normal(k[0], (GROUPS, ROWS, D)) * scale, jax.random.normal(k[1], (GROUPS, D, F)))


def _case(case):
  from jax.sharding import Mesh
  from xla_fp4.passes import analysis
  if case == "per_device":  # the scales before peers: each device's own
    analysis.peers.of_dots = lambda dots, groups, around: [()] * len(dots)
  if case == "expert_parallel":
    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(2, 2), ("expert", "fsdp"))
    sharded, one, args = _expert_parallel(mesh)
  else:
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("fsdp",))
    sharded, one, args = _sharded_loss(mesh), _one_device_loss, _args()
  argnums = tuple(range(len(args)))
  sharded, one = jax.value_and_grad(sharded, argnums), jax.value_and_grad(one, argnums)
  peers = [r.site.peers for r in analysis.analyze(jax.jit(sharded).lower(*args).compiler_ir("stablehlo")).records]
  xla_fp4.enable(strict=True, stochastic_rounding=False, keep_head=False, keep_first=0, keep_last=0)
  try:
    rows = xla_fp4.explain(sharded, *args)
    (l_s, g_s), (l_1, g_1) = jax.jit(sharded)(*args), jax.jit(one)(*args)
  finally:
    xla_fp4.disable()
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
  return dict(loss=rel(l_s, l_1), grads=[rel(a, b) for a, b in zip(g_s, g_1)], peers=peers,
              rows=[{k: r[k] for k in ("role", "decision", "groups")} for r in rows if r["role"] != "other"])


def _run(case):
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", PYTHONPATH=str(ROOT / "tests"))
  r = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_bodys_scales_are_the_whole_tensors():
  out = _run("peers")
  rows = out["rows"]
  # Both layers, every role, in NVFP4; the expert GEMMs per group.
  assert sorted((r["role"], r["groups"] is not None) for r in rows) == sorted(
      [(role, grouped) for role in ("fprop", "dgrad", "wgrad") for grouped in (False, True)]), rows
  assert all(r["decision"] == "nvfp4" for r in rows), rows
  # float32: what one device computes, but for the order of f32 sums (the rows split over devices, the psum)
  assert out["loss"] < 1e-6 and max(out["grads"]) < 1e-5, out


def test_expert_parallel_scales_reduce_over_the_axes_that_hold_one_expert():
  """Devices (0, 1) hold experts 0-1 and (2, 3) experts 2-3 (mesh expert x fsdp): an expert's scale is the max over
  its FSDP shards' tokens, never another expert's."""
  out = _run("expert_parallel")
  assert sorted(r["role"] for r in out["rows"]) == ["dgrad", "fprop", "wgrad"], out["rows"]
  assert all(r["decision"] == "nvfp4" and r["groups"] == "slices" for r in out["rows"]), out["rows"]
  assert {tuple(map(tuple, p)) for p in out["peers"]} == {((0, 1), (2, 3))}, out["peers"]
  assert out["loss"] < 1e-6 and max(out["grads"]) < 1e-5, out


def test_per_device_scales_would_differ_from_one_device():
  """The same check fails without peers: the test sees what it guards."""
  out = _run("per_device")
  assert out["loss"] > 1e-4 or max(out["grads"]) > 1e-3, out


if __name__ == "__main__":
  print(json.dumps(_case(sys.argv[1])))
