"""The compile hook: where the pass meets JAX's compilation (a private API: jax._src.compiler).

`jax._src.compiler.compile_or_get_cached(backend, computation, ...)` is the funnel of jit, AOT compile, grad, pmap and
shard_map (docs/design.md §4). We wrap it: the StableHLO module goes through the pass before XLA (and before the
persistent cache key is computed from it, so rewritten and original programs never share cache entries).
Other private JAX modules the project uses: jax._src.lib.mlir (the MLIR bindings and dialects; passes/),
jax._src.interpreters.mlir (custom_call and the IR context; kernels/ and sharding/partition.py), jax._src.lib
.xla_client and jax._src.xla_bridge (the custom-call partitioners; sharding/partition.py); docs/design.md §4 lists
what each relies on. The installation (JAX's wrapped function and the config) is this module's, as the patch of JAX is the process's; whether
the hook has warned is in xla_fp4/state.py.
"""

import inspect
import logging
import threading
import warnings

import jax
from jax._src import compiler

from xla_fp4 import state
from xla_fp4.config import Config
from xla_fp4.passes import pipeline

logger = logging.getLogger("xla_fp4")
_lock = threading.Lock()
_installed = {"original": None, "config": None}  # JAX's compile_or_get_cached while wrapped, the pass's Config


def _check_jax():
  params = list(inspect.signature(compiler.compile_or_get_cached).parameters)
  if params[:2] != ["backend", "computation"]:
    raise RuntimeError(f"xla_fp4 supports jax versions whose compiler.compile_or_get_cached(backend, computation, ...) "
                       f"it can wrap; jax {jax.__version__} has {params}. Upgrade xla_fp4 or pin jax 0.10.2-0.12.")


def _warn_once(what, computation, e):
  current = state.current()
  if not current.hook_warned:
    current.hook_warned = True
    warnings.warn(f"xla_fp4: {what} on module {pipeline.module_name(computation)!r} ({type(e).__name__}: {e}); "
                  "compiling it unchanged. Set XLA_FP4_STRICT=1 to raise instead. (Warned once per process.)",
                  RuntimeWarning, stacklevel=3)
  logger.debug("xla_fp4 failure", exc_info=True)


def _compile_or_get_cached(backend, computation, *args, **kwargs):
  config = _installed["config"]
  original = _installed["original"]
  try:
    result = pipeline.transform(computation, config, platform=backend.platform)
    if config.dump_dir and result.rows:
      pipeline.dump(config.dump_dir, computation, result)
  except Exception as e:  # the user's program must keep working: compile the original module
    if config.strict:
      raise
    _warn_once("the NVFP4 pass failed", computation, e)
    return original(backend, computation, *args, **kwargs)
  if not result.changed:
    return original(backend, computation, *args, **kwargs)
  try:
    return original(backend, result.module, *args, **kwargs)
  except Exception as e:  # XLA rejected the rewritten module (e.g. a partitioner or a kernel registration failed)
    if config.strict:
      raise
    _warn_once("XLA could not compile the NVFP4 module", computation, e)
    return original(backend, computation, *args, **kwargs)


def install(config: Config):
  """Route every compilation through the pass with `config` (idempotent; a second call swaps the config)."""
  _check_jax()
  with _lock:
    _installed["config"] = config
    if _installed["original"] is None:
      _installed["original"] = compiler.compile_or_get_cached
      compiler.compile_or_get_cached = _compile_or_get_cached
  jax.clear_caches()  # executables compiled before would otherwise be reused unchanged


def install_error(error: Exception):
  """Make every compilation raise `error` (a configuration error found where raising is not possible)."""
  def refuse(*args, **kwargs):
    raise error
  with _lock:
    if _installed["original"] is None:
      _installed["original"] = compiler.compile_or_get_cached
    compiler.compile_or_get_cached = refuse


def uninstall():
  with _lock:
    if _installed["original"] is not None:
      compiler.compile_or_get_cached = _installed["original"]
      _installed["original"] = None
      _installed["config"] = None
  jax.clear_caches()


def installed_config():
  return _installed["config"]
