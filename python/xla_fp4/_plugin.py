"""The `jax_plugins` entry point: JAX calls `initialize()` at its first backend query, before any lowering.

It only reads the configuration, registers the FFI targets and installs the compile hook; it must not touch backends
(calling jax.devices() here deadlocks).
"""

from xla_fp4 import config


def initialize():
  try:
    cfg = config.load()
  except ValueError as e:
    # JAX logs and swallows plugin errors; fail the first compilation instead, so a typo is never silently ignored.
    from xla_fp4 import hook
    hook.install_error(e)
    raise
  if cfg.enabled:
    from xla_fp4 import api
    api.enable_config(cfg)
