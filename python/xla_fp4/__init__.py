"""xla-fp4: NVFP4 training for unmodified JAX programs.

    XLA_FP4=1 python train.py          # through the jax_plugins entry point
    import xla_fp4; xla_fp4.enable()    # or from Python
"""

from xla_fp4 import numerics
from xla_fp4.api import disable, enable, exclude, explain

__all__ = ["numerics", "enable", "disable", "exclude", "explain"]
