"""xla-fp4: NVFP4 training for unmodified JAX programs.

    XLA_FP4=1 python train.py          # through the jax_plugins entry point
    import xla_fp4; xla_fp4.enable()    # or from Python
"""

from importlib import metadata as _metadata

from xla_fp4 import numerics
from xla_fp4.api import disable, enable, exclude, explain

try:
  __version__ = _metadata.version("xla-fp4")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
  __version__ = "unknown"

__all__ = ["numerics", "enable", "disable", "exclude", "explain", "__version__"]
