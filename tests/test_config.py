import pytest

import xla_fp4
from xla_fp4 import config


def test_defaults_and_env_parsing():
  cfg = config.load(environ={"XLA_FP4": "true", "XLA_FP4_KEEP_LAST": "3", "XLA_FP4_RHT": "0"})
  assert cfg.enabled and cfg.keep_last == 3 and cfg.rht is False and cfg.keep_first == "auto"
  assert config.load(environ={}).enabled is False


@pytest.mark.parametrize("env,value,fragment", [
    ("XLA_FP4", "yes", "accepted values are 1, 0, true, false"),
    ("XLA_FP4_BACKEND", "tpu", "auto, emulate, native"),
    ("XLA_FP4_KEEP_FIRST", "-1", "'auto' or a non-negative integer"),
    ("XLA_FP4_EXCLUDE", "(", "not a valid regular expression"),
    ("XLA_FP4_MIN_DIM", "x", "integers"),
])
def test_bad_values_name_the_variable_and_the_accepted_values(env, value, fragment):
  with pytest.raises(ValueError) as e:
    config.load(environ={env: value})
  assert env in str(e.value) and fragment in str(e.value) and repr(value) in str(e.value)


def test_unknown_python_option_is_a_clear_error():
  with pytest.raises(TypeError, match="unknown xla_fp4 option.*rhtt"):
    xla_fp4.enable(rhtt=False)


def test_option_table_lists_every_option():
  table = config.markdown_table()
  for o in config.OPTIONS:
    assert f"`{o.env}`" in table


def test_a_misspelt_variable_is_named_with_the_closest_one():
  lines = config.unknown_variables({"XLA_FP4": "1", "XLA_FP4_TELEMTRY": "/tmp/t", "XLA_FP4_CUDA": "ON",
                                    "XLA_FP4_FROBNICATE": "1", "XLA_FLAGS": "", "PATH": "/bin"})
  assert lines == ["xla_fp4: XLA_FP4_FROBNICATE is not an xla_fp4 variable and does nothing; `python -m xla_fp4 "
                   "options` lists the variables",
                   "xla_fp4: XLA_FP4_TELEMTRY is not an xla_fp4 variable and does nothing; did you mean "
                   "XLA_FP4_TELEMETRY?"]


def test_the_plugin_warns_once_per_misspelt_variable_in_one_line():
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  env.update(XLA_FP4="1", XLA_FP4_EXCLUDES="mlp")
  r = subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; jax.jit(lambda a: a @ a)(jnp.ones((32, 32)))"],
                     env=env, capture_output=True, text=True)
  said = [line for line in r.stderr.splitlines() if "XLA_FP4_EXCLUDES" in line]
  assert r.returncode == 0 and len(said) == 1, r.stderr
  assert "did you mean XLA_FP4_EXCLUDE?" in said[0]
  assert not any(line.startswith(" ") for line in r.stderr.splitlines()), r.stderr  # no source line echoed


def test_version_and_info_name_each_platforms_backend():
  import subprocess
  import sys
  assert xla_fp4.__version__ not in ("", "unknown")
  out = subprocess.run([sys.executable, "-m", "xla_fp4", "info"], capture_output=True, text=True, check=True).stdout
  lines = {line.split(":")[0]: line for line in out.splitlines()}
  assert lines["cpu backend (XLA_FP4_BACKEND=auto)"].startswith("cpu backend (XLA_FP4_BACKEND=auto): emulate GEMM")
  assert "kernels: cpu FFI kernels" in lines["cpu backend (XLA_FP4_BACKEND=auto)"]
  assert "CUDA backend (XLA_FP4_BACKEND=auto)" in lines
