"""Pure-JAX twins of the FFI kernels the pass emits, with the kernels' operands and attributes
(python/xla_fp4/kernels/__init__.py states the contract, kernels/targets.py names each target's twin): the same
numbers, bit for bit (tests/kernels). The pass lowers them into the program where no kernel is registered
(passes/rewrite/kernel_sets.py `ReferenceKernels`), and the scale and key of the partitioned pattern everywhere
(passes/rewrite/emitter.py)."""

import jax
import jax.numpy as jnp

from xla_fp4.numerics import collective
from xla_fp4.numerics import formats
from xla_fp4.numerics import mx
from xla_fp4.numerics import nvfp4
from xla_fp4.numerics.rht import rht_f32


def block_amax(x, *, axis, rht, rht_seed, digest):
  """xla_fp4_block_amax: max |v| of every 1x16 block along `axis`, v = its RHT when `rht`, NaN as +Inf; with `digest`
  (maxima, each block's digest)."""
  maxima = nvfp4.block_amax(x, axis=axis, rht_seed=rht_seed if rht else None)
  return (maxima, nvfp4.block_digest(x, axis=axis)) if digest else maxima


def qdq(x, s_dec, key, *, axis, block_2d, stochastic, rht, rht_seed, four_over_six=False):
  """xla_fp4_qdq with apply_global_scale false: q * scale of (rht(x) if rht else x), in x's dtype; `four_over_six`:
  each block's scale to 4 or to 6 (nvfp4._encode), as the kernels' attribute of that name."""
  x32 = x.astype(jnp.float32)
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  rounding = nvfp4.Rounding.STOCHASTIC if stochastic else nvfp4.Rounding.NEAREST
  return nvfp4.unscaled_values(x32, axis, block_2d, rounding, key, s_dec,
                               four_over_six=four_over_six).astype(x.dtype)


def decode_scale(block_maxima, peers=(), four_over_six=False):
  """The global decode scale s_dec = amax / (6 * 448) from xla_fp4_block_amax's output (NaN already +Inf there).

  Inlined into the program, amax * (1/2688) would be open to XLA's reassociation of constant products (into the GEMM's
  alpha): the barrier keeps the kernels' rounding. The pass lowers this twin into partitioned programs, where the max
  is a plain reduce that XLA turns into an all-reduce; in a shard_map body, where XLA adds none, the max is taken over
  the body's `peers` too (collective.py)."""
  amax = collective.max_over_peers(jnp.max(block_maxima), peers)
  return jax.lax.optimization_barrier(nvfp4.global_decode_scale(amax, four_over_six))


def stochastic_key(x, salt):
  """The stochastic-rounding key: `salt` (the site's, a uint32 scalar) xor'ed with x's digest, so that the rounding
  noise changes every step and differs between layers, yet is reproducible."""
  return salt ^ nvfp4.tensor_digest(x)


def digest_of_blocks(block_digests):
  """x's digest (stochastic_key's) from xla_fp4_block_amax's per-block digests: their wrapping sum. The pass lowers
  this twin into partitioned programs, where the sum is a plain reduce that XLA turns into an all-reduce."""
  return jnp.sum(block_digests, dtype=jnp.uint32)


def mx_qdq(x, key, *, axis, block_2d, stochastic, rht, rht_seed, fp8):
  """xla_fp4_mx_qdq: an MX format's q·scale of (rht(x) if rht else x) in x's dtype (numerics/mx.py; E4M3 elements
  with `fp8`, else E2M1): block-local, no tensor scale, so the emulated GEMM's alpha is 1. `key` as xla_fp4_qdq's (the
  pass gives stochastic_key(x, salt))."""
  x32 = x.astype(jnp.float32)
  if rht:
    x32 = rht_f32(x32, axis, rht_seed)
  fmt = formats.FORMATS["mxfp8" if fp8 else "mxfp4"]
  return mx.unscaled_values(x32, axis, fmt, block_2d, stochastic, key if stochastic else None).astype(x.dtype)


def qdq_with_scale(x, salt, *, axis, block_2d, stochastic, rht, rht_seed, four_over_six=False):
  """xla_fp4_qdq_with_scale: (qdq of x with its own s_dec and key, s_dec): the partitioned pattern on one device."""
  s_dec = decode_scale(block_amax(x, axis=axis, rht=rht, rht_seed=rht_seed, digest=False), four_over_six=four_over_six)
  key = stochastic_key(x, salt) if stochastic else salt
  return qdq(x, s_dec, key, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
             four_over_six=four_over_six), s_dec
