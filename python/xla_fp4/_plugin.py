"""The `jax_plugins` entry point: JAX calls `initialize()` at its first backend query, before any lowering.

It only reads the configuration, registers the FFI targets and installs the compile hook; it must not touch backends
(calling jax.devices() here deadlocks).
"""

from xla_fp4 import config


def initialize():
  from xla_fp4 import notice
  for line in config.unknown_variables():
    notice.warn(line)
  try:
    cfg = config.load()
  except ValueError as e:
    # JAX logs and swallows what initialize() raises, with a traceback. A bad XLA_FP4_* value is a launch error, like a
    # bad command-line flag: the first compilation ends the program with one line saying what to fix, no traceback.
    from xla_fp4 import hook
    hook.install_error(SystemExit(f"xla_fp4: {e} Set it to an accepted value or unset it."))
    return
  if cfg.enabled:
    from xla_fp4 import api
    api.enable_config(cfg)
