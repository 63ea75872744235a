"""Public Python API: enable / disable the pass, exclude code from it, explain its decisions."""

import contextlib
import functools

import jax

from xla_fp4 import config as config_mod
from xla_fp4 import hook, report
from xla_fp4.passes import pipeline
from xla_fp4.passes.analysis import EXCLUDE_ATTRIBUTE


def enable_config(cfg):
  from xla_fp4 import kernels
  from xla_fp4.sharding import register
  kernels.register_all()  # every platform built; a platform that cannot register gets the StableHLO form, and a warning
  register.register()
  hook.install(cfg)


def enable(**options):
  """Turn NVFP4 on for every later compilation; options override XLA_FP4_* (see the README's option table)."""
  enable_config(config_mod.load(**{**options, "enabled": True}))


def disable():
  """Turn NVFP4 off for later compilations (already compiled functions keep their executables)."""
  hook.uninstall()


class _Exclude(contextlib.ContextDecorator):
  """Marks every op traced inside with a frontend attribute (jax's set_xla_metadata), which JAX also writes on the
  backward pass's transposed dots; the pass keeps marked dots in high precision."""

  def __enter__(self):
    from jax.experimental import xla_metadata
    self._scope = xla_metadata.set_xla_metadata(**{EXCLUDE_ATTRIBUTE: "true"})
    return self._scope.__enter__()

  def __exit__(self, *exc):
    return self._scope.__exit__(*exc)


def exclude(fn=None):
  """Keep the GEMMs traced inside in high precision: `with xla_fp4.exclude():` or `@xla_fp4.exclude`."""
  if fn is None:
    return _Exclude()
  if not callable(fn):
    raise TypeError(f"xla_fp4.exclude decorates a function or is used as `with xla_fp4.exclude():`; got {fn!r}")
  return functools.wraps(fn)(_Exclude()(fn))


def explain(fn, *args, **kwargs):
  """Lower `fn(*args, **kwargs)` (without compiling or running it); print and return the pass's decision rows.
  The options are the enabled pass's (xla_fp4.enable or XLA_FP4=1); where the pass is not enabled, the XLA_FP4_*
  environment's, and the printout says so."""
  lowered = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs)
  # eqx.filter_jit's `lower` wraps JAX's Lowered (in `.lowered`); jax.jit, nnx.jit and Haiku under jax.jit return it
  lowered = getattr(lowered, "lowered", lowered)
  module = lowered.compiler_ir("stablehlo")
  cfg = hook.installed_config()
  source = "the enabled pass's options"
  if cfg is None:
    cfg = config_mod.load(enabled=True)
    source = "the pass is not enabled: options from the XLA_FP4_* environment"
  rows, unmatched, blocks = pipeline.decisions(module, cfg)
  print(report.table(rows, unmatched, title=f"{pipeline.module_name(module)} ({source})", blocks=blocks), end="")
  return rows
