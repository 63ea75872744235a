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
  """One line: what (the variable and its value), what is accepted, what to do; no traceback."""
  r = _run({"XLA_FP4": "maybe"}, tmp_path)
  assert r.returncode != 0 and "XLA_FP4 = 'maybe'" in r.stderr and "accepted values are 1, 0, true, false" in r.stderr
  assert "Traceback" not in r.stderr and "unset it" in r.stderr, r.stderr
  assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1, r.stderr


def test_deterministic_across_processes(tmp_path):
  outs = []
  for i in range(2):
    d = tmp_path / f"d{i}"
    r = _run({"XLA_FP4": "1", "XLA_FP4_DUMP_DIR": str(d), "PYTHONHASHSEED": str(i)}, tmp_path)
    assert r.returncode == 0, r.stderr
    after = sorted(p for p in os.listdir(d) if p.endswith(".after.mlir"))
    outs.append([open(d / p).read() for p in after])
  assert outs[0] == outs[1]


def test_the_pass_says_once_that_it_is_on_and_where_the_report_goes(tmp_path):
  dump = tmp_path / "dump"
  r = _run({"XLA_FP4": "1", "XLA_FP4_DUMP_DIR": str(dump)}, tmp_path)
  lines = [line for line in r.stderr.splitlines() if "xla_fp4 is on" in line]
  assert r.returncode == 0 and len(lines) == 1, r.stderr
  assert "% of its dot FLOPs in NVFP4" in lines[0] and f"python -m xla_fp4 report {dump}" in lines[0]
  assert "xla_fp4 is on" not in _run({}, tmp_path).stderr


def test_an_exclude_or_rule_that_matches_nothing_is_a_warning(tmp_path):
  """A typo in XLA_FP4_EXCLUDE or a rule's layer pattern would otherwise silently keep the layer in NVFP4."""
  r = _run({"XLA_FP4": "1", "XLA_FP4_EXCLUDE": "atention", "XLA_FP4_RULES": '[{"layer": "mlp", "decision": "keep"}]'},
           tmp_path)
  assert r.returncode == 0, r.stderr
  assert "XLA_FP4_EXCLUDE='atention' matched no dot" in r.stderr, r.stderr
  assert "rule 'user_rule_0'" in r.stderr and "matched no dot" in r.stderr
  matched = _run({"XLA_FP4": "1", "XLA_FP4_EXCLUDE": "dot_general|.*"}, tmp_path)
  assert "matched no dot" not in matched.stderr, matched.stderr
