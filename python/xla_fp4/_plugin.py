"""The `jax_plugins` entry point: JAX calls `initialize()` at its first backend query, before any lowering.

It only reads the configuration, registers the FFI targets and installs the compile hook; it must not touch backends
(calling jax.devices() here deadlocks).
"""

from xla_fp4 import config


def initialize():
  cfg = config.load()  # a bad XLA_FP4* value raises here, naming the variable
  if cfg.enabled:
    from xla_fp4 import api
    api.enable_config(cfg)
