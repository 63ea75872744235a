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
