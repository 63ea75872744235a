"""Activation through the jax_plugins entry point, driven only by the environment, in fresh processes."""

import json
import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp
    def loss(w1, w2, x):
      return jnp.sum(jnp.tanh(x @ w1) @ w2)
    args = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(64, 64), (64, 64), (32, 64)])]
    print(float(jax.jit(jax.grad(loss))(*args).sum()))
""")


def _run(env_extra, tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  env.update(env_extra)
  return subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, cwd=tmp_path)


def test_env_var_alone_activates_the_pass_and_dumps(tmp_path):
  dump = tmp_path / "dump"
  base = _run({}, tmp_path)
  fp4 = _run({"XLA_FP4": "1", "XLA_FP4_DUMP_DIR": str(dump)}, tmp_path)
  assert base.returncode == 0 and fp4.returncode == 0, fp4.stderr
  assert base.stdout != fp4.stdout  # the gradient changed: NVFP4 ran
  names = sorted(os.listdir(dump))
  assert any(n.endswith(".before.mlir") for n in names) and any(n.endswith(".after.mlir") for n in names)
  rows = [r for n in names if n.endswith(".decisions.json") for r in json.load(open(dump / n))["decisions"]]
  assert {r["role"] for r in rows if r["decision"] == "nvfp4"} >= {"fprop", "wgrad"}
  report = subprocess.run([sys.executable, "-m", "xla_fp4", "report", str(dump)], capture_output=True, text=True)
  assert report.returncode == 0 and "% of dot FLOPs" in report.stdout


def test_bad_env_value_is_a_clear_error(tmp_path):
  r = _run({"XLA_FP4": "maybe"}, tmp_path)
  assert r.returncode != 0 and "XLA_FP4 = 'maybe'" in r.stderr and "accepted values are 1, 0, true, false" in r.stderr


def test_deterministic_across_processes(tmp_path):
  outs = []
  for i in range(2):
    d = tmp_path / f"d{i}"
    r = _run({"XLA_FP4": "1", "XLA_FP4_DUMP_DIR": str(d), "PYTHONHASHSEED": str(i)}, tmp_path)
    assert r.returncode == 0, r.stderr
    after = sorted(p for p in os.listdir(d) if p.endswith(".after.mlir"))
    outs.append([open(d / p).read() for p in after])
  assert outs[0] == outs[1]
