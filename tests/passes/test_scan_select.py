"""Scanned layer stacks: one dot serves every layer, yet the high-precision blocks hold per iteration."""

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4

LAYERS = 8
ROOT = Path(__file__).resolve().parents[2]


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


# A scanned stack whose layer runs in a shard_map body (MaxText's sparse MoE under FSDP): the weight enters the body
# sharded and is gathered there, and the body is isolated from above, so the loop's block index must come in as one
# of its operands. JAX inlines a shard_map over one device, so these run on 2 host devices, in a subprocess (the
# device count is fixed when the backend starts): `python tests/passes/test_scan_select.py CASE` prints JSON.
def _sharded_model(mesh):
  from jax.sharding import PartitionSpec as P

  def layer(h, w):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P("fsdp"))
    def body(h, w):
      return jnp.tanh(h @ jax.lax.all_gather(w, "fsdp", tiled=True))
    return body(h, w), None

  def model(ws, x):
    h, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
    return jnp.sum(h ** 2)
  return model


def _sharded_case(case):
  """Gradients of the sharded model: as is and with the pass (kept blocks), relative to the baseline per layer."""
  from jax.sharding import Mesh
  from xla_fp4.passes import rewrite
  from xla_fp4.passes.rewrite import scope
  if case == "unthreaded":  # the construction before the fix: the block index read inside the body, not passed in
    rewrite.into_shard_maps = scope.into_shard_maps = lambda value, op: value
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  step = jax.jit(jax.grad(_sharded_model(mesh)))
  base = step(*_args())
  out = {"manual_computations": str(step.lower(*_args()).compiler_ir("stablehlo")).count("sdy.manual_computation")}
  for name, options in {"all_kept": dict(keep_first=0, keep_last=LAYERS), "none_kept": dict(keep_first=0, keep_last=0),
                        "last_kept": dict(keep_first=0, keep_last=1)}.items():
    xla_fp4.enable(strict=case != "unthreaded", **options)
    with warnings.catch_warnings(record=True) as said:
      warnings.simplefilter("always")
      g = jax.jit(jax.grad(_sharded_model(mesh)))(*_args())
    rows = xla_fp4.explain(step, *_args())
    xla_fp4.disable()
    out[name] = dict(rel=[float(jnp.linalg.norm(g[i] - base[i]) / jnp.linalg.norm(base[i])) for i in range(LAYERS)],
                     warnings=[str(w.message) for w in said],
                     rows=[{k: r[k] for k in ("role", "decision", "keep_blocks")} for r in rows])
  return out


def _run_sharded(case):
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(ROOT / "tests"))
  r = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_kept_blocks_select_inside_a_shard_map_body():
  out = _run_sharded("threaded")
  assert out["manual_computations"] >= 2  # the layer's forward and backward bodies
  assert out["all_kept"]["rel"] == [0.0] * LAYERS  # every iteration kept: the operands themselves, bit for bit
  assert min(out["none_kept"]["rel"]) > 1e-3
  # Keeping the last block gives its iteration the high-precision GEMMs (the layers before it still add NVFP4 noise).
  assert out["last_kept"]["rel"][LAYERS - 1] != out["none_kept"]["rel"][LAYERS - 1], out
  # Every GEMM of the layer is classified through the bodies (the remat's gathered weight is a residual one returns).
  rows = out["last_kept"]["rows"]
  assert sorted(r["role"] for r in rows) == ["dgrad", "fprop", "fprop", "wgrad"], rows
  assert all(r["decision"] == "nvfp4" and r["keep_blocks"] == [LAYERS - 1] for r in rows), rows
  assert not any(o["warnings"] for o in (out["all_kept"], out["none_kept"], out["last_kept"]))


def test_a_use_across_an_isolated_region_falls_back_before_the_verifier():
  """The verifier crashed the process on a value read across a shard_map body's isolation (MaxText's Qwen3-MoE under
  FSDP): the pass checks for it first, and the program compiles unchanged with a warning (the process lives on)."""
  out = _run_sharded("unthreaded")
  assert out["last_kept"]["rel"] == [0.0] * LAYERS  # the original module
  said = out["all_kept"]["warnings"]  # the first compilation warns (once per process)
  assert any("reads values across an isolated region" in w and "compiling it unchanged" in w for w in said), said


if __name__ == "__main__":
  print(json.dumps(_sharded_case(sys.argv[1])))


@pytest.mark.parametrize("remat", [True, False])
def test_kept_iteration_cases_merge_and_pair_under_the_native_backend(monkeypatch, remat):
  """A scanned stack with a kept block under the native backend, where each dot sits in a kept-iteration case: the
  dgrad's and the wgrad's cases of an iteration select alike and read neither's results, so they merge
  (rewrite/cases.py) and the output gradient both read gets one pair quantizer (rewrite/pairs.py); the gradients
  equal those with every case and quantizer apart bit for bit (stochastic rounding), and the kept block's too; with
  and without remat. (MaxText's scanned fsdp8 step, whose dots read the block index in the loop's own scope, checks
  the other path: there the pass once looked for shard_map bodies around the merged cases' erased results.)"""
  from xla_fp4.passes.rewrite import cases, pairs

  def model(ws, x):
    h, _ = jax.lax.scan(jax.checkpoint(_layer) if remat else _layer, x, ws)
    return jnp.sum(h ** 2)

  def grads_and_calls():
    xla_fp4.enable(strict=True, keep_head=False, keep_first=1, keep_last=0, backend="native")
    try:
      step = jax.jit(jax.grad(model))
      text = step.lower(*_args()).compile().as_text()
      return step(*_args()), text.count("conditional("), text.count('"xla_fp4_quantize_packed_pair"')
    finally:
      xla_fp4.disable()

  merged, merged_cases, merged_pairs = grads_and_calls()
  monkeypatch.setattr(cases, "merge", lambda found: 0)
  monkeypatch.setattr(pairs, "fuse", lambda kernels, packings: 0)
  apart, apart_cases, apart_pairs = grads_and_calls()
  assert (merged_pairs, apart_pairs) == (1, 0), (merged_pairs, apart_pairs)
  assert merged_cases < apart_cases, (merged_cases, apart_cases)
  assert jnp.array_equal(merged, apart)
