"""The compile hook: where the pass meets JAX's compilation (a private API: jax._src.compiler).

`jax._src.compiler.compile_or_get_cached(backend, computation, ...)` is the funnel of jit, AOT compile, grad, pmap and
shard_map (docs/design.md §4). We wrap it: the StableHLO module goes through the pass before XLA (and before the
persistent cache key is computed from it, so rewritten and original programs never share cache entries).
Other private JAX modules the project uses: jax._src.lib.mlir (the MLIR bindings and dialects; passes/),
jax._src.interpreters.mlir (custom_call and the IR context; kernels/ and sharding/shards.py), jax._src.lib
.xla_client and jax._src.xla_bridge (the custom-call partitioners; sharding/register.py); docs/design.md §4 lists
what each relies on. The installation (JAX's wrapped function and the config) stays here, as the patch of JAX is the
process's; what the hook has told the user is in xla_fp4/state.py.
"""

import inspect
import logging
import re
import threading

import jax
from jax._src import compiler

from xla_fp4 import notice, report, state
from xla_fp4.config import BEFORE_USER_RULES, Config
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
  if state.current().first_time("pass failed"):
    notice.warn(f"xla_fp4: {what} on module {pipeline.module_name(computation)!r} ({type(e).__name__}: {e}); "
                "compiling it unchanged. Set XLA_FP4_STRICT=1 to raise instead. (Warned once per process.)",
                RuntimeWarning)
  logger.debug("xla_fp4 failure", exc_info=True)


def _compile_or_get_cached(backend, computation, *args, **kwargs):
  config = _installed["config"]
  original = _installed["original"]
  try:
    result = pipeline.transform(computation, config, platform=backend.platform)
    if config.dump_dir and result.rows:
      pipeline.dump(config.dump_dir, computation, result)
    _tell(config, pipeline.module_name(computation), result)
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


def _tell(config, module, result):
  """What a user should hear about one compilation, once: that the pass is active and where its report is; that an
  exclude pattern or a rule of theirs matched no dot of a module that trains (a typo, or another layer naming)."""
  if result.changed and state.current().first_time("active"):
    share = report.flop_share(result.rows)
    where = (f"the decisions are in {config.dump_dir} (python -m xla_fp4 report {config.dump_dir})" if config.dump_dir
             else "set XLA_FP4_DUMP_DIR=DIR to write the decisions, or call xla_fp4.explain(step, *args)")
    logger.warning(f"xla_fp4 is on: module {module!r} runs {share:.1%} of its dot FLOPs in "
                   f"{report.formats_named(result.rows)}; {where}.")
  if all(r["rule"] in BEFORE_USER_RULES for r in result.rows):
    return  # no dot reached the user's choices: nothing they wrote could have matched
  user = {u.name: f"rule {u.name!r} ({u.reason})" for u in config.rules}
  if config.exclude:
    user["exclude_regex"] = f"XLA_FP4_EXCLUDE={config.exclude!r}"
  layers = sorted({r["layer"] for r in result.rows if r["role"] != "other" and r["layer"]})
  named = (f"whose linear layers are {', '.join(layers[:8])}{', ...' if len(layers) > 8 else ''}" if layers
           else "whose linear layers carry no names")
  for name in (n for n in result.unmatched_rules if n in user):
    if state.current().first_time(("unmatched", name, module)):
      positional = any(re.fullmatch(r"(block_\d+/)?linear_\d+", layer) for layer in layers)
      hint = (" The parameters reach the program as a flat list of leaves (nnx.jit, Equinox, penzai): its layers are "
              "named by where they run, block_<b>/linear_<k>; or mark them with xla_fp4.exclude(), or under nnx.jit "
              "split the module (nnx.split + jax.jit) to keep its paths." if positional else "")
      logger.warning(f"xla_fp4: {user[name]} matched no dot of module {module!r}, {named}; check the pattern "
                     f"against the layer paths of `python -m xla_fp4 report` or xla_fp4.explain.{hint}")


def install(config: Config):
  """Route every compilation through the pass with `config` (idempotent; a second call swaps the config)."""
  _check_jax()
  with _lock:
    _installed["config"] = config
    if _installed["original"] is None:
      _installed["original"] = compiler.compile_or_get_cached
      compiler.compile_or_get_cached = _compile_or_get_cached
  jax.clear_caches()  # executables compiled before would otherwise be reused unchanged


def install_error(error: BaseException):
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
