"""The compiled NVFP4 kernels: loading the extension, registering its XLA FFI targets, and calling them.

Every kernel has a pure-JAX twin in `xla_fp4.numerics` that defines its numbers (the pass's kernels, with their
attributes: `xla_fp4.numerics.kernel_twins`); the kernels agree with it bit for bit (the GEMM up to float32 summation
order).

Custom-call contract (for code that emits `stablehlo.custom_call` itself, like the compiler pass): `api_version = 4`
(typed FFI), `backend_config` a DictionaryAttr with exactly the attributes in `ATTRIBUTES[target]`, typed as follows:
  - `bool` attributes are `BoolAttr` (MLIR `true`/`false`, i.e. i1); XLA FFI decodes them as C++ `bool` (PRED scalar),
    which is also what `jax.ffi.ffi_call` emits for a Python bool. Do not pass them as integers.
  - `int` attributes are signless 64-bit `IntegerAttr` (`3 : i64`). `rht_seed` and `salt` must lie in [0, 2**32).
`custom_call_backend_config(target, attrs)` builds that dictionary. Operands and results are row-major, and the call
must say so in its `operand_layouts` and `result_layouts`: `custom_call(...)` emits such a call.

  xla_fp4_qdq(x: f32|bf16|f16[...], s_dec: f32[], key: u32[]) -> x's type
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, apply_global_scale: bool
      == numerics qdq of (rht(x) if rht else x) with global_scale=s_dec and the key's random bits; the result stays in
      the RHT space. s_dec = amax / (6 * 448), amax taken after the RHT when rht is on. With apply_global_scale
      false the result is q * scale (exact), the operand of an emulated GEMM that folds s_dec into its output.
      With stochastic false the key is not read (the pass passes a value there that orders the call).
  xla_fp4_qdq_with_scale(x: f32|bf16|f16[...]) -> (x's type, s_dec: f32[])
      attrs axis: i64, block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64, salt: i64
      measures x itself and then runs xla_fp4_qdq with apply_global_scale false: s_dec = amax * f32(1 / 2688), amax
      = max |rht(x) if rht else x| with NaN counted as +Inf; key = salt, xor'ed with the wrapping uint32 sum of x's
      element bits when stochastic (numerics.tensor_digest), so that the rounding differs every step. For tensors
      that are whole on one device: a partitioned program needs the global amax, i.e. a reduction XLA can partition.
  xla_fp4_rht(x: f32|bf16|f16[...]) -> f32[x.shape]; attrs axis: i64, rht_seed: i64    (== numerics.rht.rht_f32)
  xla_fp4_block_amax(x: f32|bf16|f16[...]) -> f32[x.shape, axis / 16]; attrs axis: i64, rht: bool, rht_seed: i64
      the max |v| of every 1x16 block (v = its RHT when rht), NaN as +Inf     (== numerics.block_amax); block-local,
      for partitioned programs: the max over the result, a plain reduction, is the global amax.
  xla_fp4_quantize_packed(x: f32|bf16|f16[rows, K], s_dec: f32[], key: u32[])
      -> (data: u8[rows, K/2], scales: u8[prod(numerics.padded_scale_shape(rows, K))])
      attrs block_2d: bool, stochastic: bool, rht: bool, rht_seed: i64                 (== numerics.pack(quantize(...)))
  xla_fp4_dequantize_packed(data: u8[rows, K/2], scales: u8[...], s_dec: f32[]) -> f32|bf16|f16[rows, K]; no attrs
  xla_fp4_gemm_packed(a_data: u8[M, K/2], a_scales: u8[...], b_data: u8[N, K/2], b_scales: u8[...], alpha: f32[])
      -> f32|bf16|f16[M, N]; no attrs. C = alpha * sum_k (qa*sa)(qb*sb), float32 accumulation; alpha = s_dec_a*s_dec_b.

Contraction sizes must be multiples of 16; a violated contract fails the call with an INVALID_ARGUMENT error that says
what was wrong. Nothing here touches JAX backends, so `register()` is safe in a plugin's `initialize()`.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from xla_fp4 import state
from xla_fp4.kernels import targets

QDQ_TARGET = targets.QDQ.name
QDQ_WITH_SCALE_TARGET = targets.QDQ_WITH_SCALE.name
RHT_TARGET = targets.RHT.name
BLOCK_AMAX_TARGET = targets.BLOCK_AMAX.name
QUANTIZE_PACKED_TARGET = targets.QUANTIZE_PACKED.name
DEQUANTIZE_PACKED_TARGET = targets.DEQUANTIZE_PACKED.name
GEMM_PACKED_TARGET = targets.GEMM_PACKED.name

# target -> {attribute name: Python type}; bool -> BoolAttr, int -> i64 IntegerAttr. The handlers bind the lists of
# xla_fp4/ffi_targets.h; the extension exports them and a test checks that this is the same (tests/kernels).
ATTRIBUTES = {t.name: dict(t.attributes) for t in targets.ALL}
TARGETS = tuple(ATTRIBUTES)

# What is registered, refused and warned about lives in the process state (xla_fp4/state.py).


def _load_extension():
  try:
    from xla_fp4 import _xla_fp4_ext
  except ImportError as e:
    return None, (f"the xla_fp4 C++ extension is not built ({e}); build it with `pip install -e .` from the checkout")
  return _xla_fp4_ext, "the xla_fp4 C++ extension is loaded"


_ext, _reason = _load_extension()


def available():
  """(True, reason) when the compiled extension loaded, else (False, why not)."""
  return _ext is not None, _reason


def extension():
  """The extension module; raises RuntimeError with the reason when it is not built."""
  if _ext is None:
    raise RuntimeError(_reason)
  return _ext


def _cuda_built():
  return _ext is not None and _ext.cuda_build.startswith("built")


def _load_cuda():
  """(xla_fp4._xla_fp4_cuda, "") or (None, why not). Imported on first use: it loads cuBLASLt."""
  if _ext is None:
    return None, _reason
  if not _cuda_built():
    return None, f"the xla_fp4 CUDA kernels were {_ext.cuda_build} (docs/cuda.md)"
  try:
    from xla_fp4 import _xla_fp4_cuda
  except ImportError as e:
    return None, f"the xla_fp4 CUDA kernels were built but do not load: {e}"
  return _xla_fp4_cuda, ""


def _xla_platform(platform):
  """XLA's name for a JAX backend platform: cpu, or CUDA for JAX's cuda/gpu (how custom-call targets are keyed)."""
  return "CUDA" if platform.lower() in ("cuda", "gpu") else platform.lower()


def runtime_ffi_api():
  """(major, minor) of the XLA FFI API of the running jaxlib, read from the headers it ships; None if unreadable."""
  import re
  try:
    with open(f"{jax.ffi.include_dir()}/xla/ffi/api/c_api.h") as f:
      text = f.read()
  except OSError:
    return None
  found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
  return None if None in found else tuple(int(m.group(1)) for m in found)


def _ffi_mismatch(module):
  """Why XLA would refuse `module`'s handlers (it accepts handlers built against its own or an older minor API)."""
  built, running = tuple(module.ffi_api_version), runtime_ffi_api()
  if running is None or (built[0] == running[0] and built[1] <= running[1]):
    return None
  return (f"the xla_fp4 kernels were built against XLA FFI API {built[0]}.{built[1]} but this jaxlib "
          f"({jax.lib.__version__}) runs {running[0]}.{running[1]}; reinstall xla-fp4 so it builds against this "
          "jaxlib: pip install --force-reinstall --no-deps --no-build-isolation .")


def _register(xla_platform, module):
  """Register `module`'s handlers for `xla_platform` once; raises RuntimeError with the reason when XLA would not
  take them (an incompatible FFI API fails the whole backend at start-up, so it is checked here first)."""
  current = state.current()
  with current.lock:
    if xla_platform in current.registered:
      return
    if xla_platform in current.refused:
      raise RuntimeError(current.refused[xla_platform])
    why = _ffi_mismatch(module)
    if why is not None:
      current.refused[xla_platform] = why
      raise RuntimeError(why)
    # CPU targets register at once; CUDA ones wait in JAX until its CUDA plugin starts (xla_client keeps them).
    for name, capsule in module.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, api_version=1)
    current.registered.add(xla_platform)


def register():
  """Register the CPU targets with XLA (idempotent). Raises RuntimeError with the reason when that is not possible."""
  _register("cpu", extension())


def register_cuda():
  """Register the CUDA targets if the CUDA kernels were built and load (idempotent); returns whether they were."""
  module, why = _load_cuda()
  if module is None:
    return False
  _register("CUDA", module)
  return True


def register_all():
  """Register every platform the kernels were built for; never raises, warns once for each platform whose kernels
  exist but cannot be registered. {platform: (registered, reason)}; the pass uses the plain StableHLO form of the
  kernels on a platform whose targets are not registered."""
  out, current = {}, state.current()
  for platform, load in (("cpu", lambda: (_ext, _reason)), ("CUDA", _load_cuda)):
    module, why = load()
    built = module is not None or (platform == "CUDA" and _cuda_built())
    if module is not None:
      try:
        _register(platform, module)
        why = f"{platform} FFI kernels registered"
      except RuntimeError as e:
        why = str(e)
    ok = platform in current.registered
    if not ok and (built or platform == "cpu") and why not in current.warned:
      current.warned.add(why)
      warnings.warn(f"xla_fp4: {why}. NVFP4 on {platform} uses the plain StableHLO form of the kernels (same numbers, "
                    "slower).", RuntimeWarning, stacklevel=2)
    out[platform] = (ok, why)
  return out


def registered(platform):
  """Whether the FFI targets are registered for `platform` (a backend's platform name: cpu, cuda, gpu)."""
  return platform is not None and _xla_platform(platform) in state.current().registered


def status(platform):
  """(registered, reason) for `platform`: which kernels the pass can call there, or why it uses the StableHLO form."""
  if platform is None:
    return False, "no platform"
  xla_platform, current = _xla_platform(platform), state.current()
  if xla_platform in current.registered:
    return True, f"{xla_platform} FFI kernels"
  if xla_platform in current.refused:
    return False, current.refused[xla_platform]
  if xla_platform == "CUDA":
    module, why = _load_cuda()
    return False, why or "the CUDA FFI kernels are not registered (xla_fp4.enable() registers them)"
  if xla_platform == "cpu":
    return False, (_reason if _ext is None
                   else "the CPU FFI kernels are not registered (xla_fp4.enable() registers them)")
  return False, f"xla_fp4 has no kernels for platform {platform!r}"


def info():
  """What was built and what registers, per platform (`python -m xla_fp4 info`). Registers the targets."""
  out = {"jax": jax.__version__, "jaxlib XLA FFI API": runtime_ffi_api()}
  if _ext is None:
    return {**out, "cpu kernels": _reason}
  out["kernels built against XLA FFI API"] = tuple(_ext.ffi_api_version)
  out["CUDA kernels"] = _ext.cuda_build
  for platform, (ok, why) in register_all().items():
    out[f"{platform} registration"] = why
  if registered("CUDA"):
    out["FP4 GEMM"] = fp4_gemm_supported()[1] or "runs (compute capability 10.x, cuBLASLt >= 12.8)"
  return out


def fp4_gemm_supported():
  """(True, reason) when an FP4 tensor-core GEMM can run here (CUDA build, compute capability 10.x,
  cuBLASLt >= 12.8)."""
  module, why = _load_cuda()
  if module is None:
    return False, why
  return tuple(module.fp4_gemm_supported())


def backend_config_attributes(target, attrs):
  """{name: MLIR attribute} of a custom call to `target` (needs an active MLIR context); see the module docstring."""
  from jax.extend.mlir import ir
  want = ATTRIBUTES[target]
  if set(attrs) != set(want):
    raise ValueError(f"{target} takes attributes {sorted(want)}, got {sorted(attrs)}")
  i64 = ir.IntegerType.get_signless(64)
  out = {}
  for name, value in attrs.items():
    if want[name] is bool:
      out[name] = ir.BoolAttr.get(bool(value))
    else:
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"attribute {name} of {target} must be an integer, got {value!r}")
      out[name] = ir.IntegerAttr.get(i64, int(value))
  return out


def custom_call(target, result_types, operands, config):
  """A `stablehlo.custom_call` to kernel `target` at the current insertion point (needs an MLIR context); `config`:
  its backend_config attributes (`backend_config_attributes`). The call fixes row-major layouts for its operands and
  results: left free, XLA's layout assignment may give one another layout (a result that is all-gathered along its
  last dim gets that dim major), and the kernel would read or write the wrong elements."""
  from jax._src.interpreters import mlir
  from jax.extend.mlir import ir

  def row_major(types):
    return [tuple(range(ir.RankedTensorType(t).rank - 1, -1, -1)) for t in types]

  return mlir.custom_call(target, result_types=result_types, operands=operands, api_version=4, backend_config=config,
                          operand_layouts=row_major([o.type for o in operands]),
                          result_layouts=row_major(result_types))


def custom_call_backend_config(target, attrs):
  """The `backend_config` DictionaryAttr of a custom call to `target` (needs an active MLIR context)."""
  from jax.extend.mlir import ir
  return ir.DictAttr.get(backend_config_attributes(target, attrs))


def _attrs(target, **attrs):
  """ffi_call keyword attributes with the contract's Python types (bool stays bool, ints become int)."""
  return {name: want(attrs[name]) for name, want in ATTRIBUTES[target].items()}


def _u8_scales(scales):
  scales = jnp.asarray(scales)
  return jax.lax.bitcast_convert_type(scales, jnp.uint8) if scales.dtype == jnp.float8_e4m3fn else scales


def _scalar(value, dtype):
  return jnp.asarray(value, dtype).reshape(())


def qdq(x, s_dec, key=0, *, axis=-1, block_2d=False, stochastic=False, rht=False, rht_seed=0,
        apply_global_scale=True):
  """Fake-quantize x (see the module docstring) with the C++ kernel; the result has x's shape and dtype."""
  register()
  x = jnp.asarray(x)
  call = jax.ffi.ffi_call(QDQ_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return call(x, _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32),
              **_attrs(QDQ_TARGET, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
                       apply_global_scale=apply_global_scale))


def qdq_with_scale(x, salt=0, *, axis=-1, block_2d=False, stochastic=False, rht=False, rht_seed=0):
  """(q * scale in x's shape and dtype, s_dec) with s_dec and the rounding key measured from x (module docstring)."""
  register()
  x = jnp.asarray(x)
  call = jax.ffi.ffi_call(QDQ_WITH_SCALE_TARGET, (jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                  jax.ShapeDtypeStruct((), jnp.float32)))
  return call(x, **_attrs(QDQ_WITH_SCALE_TARGET, axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht,
                          rht_seed=rht_seed, salt=salt))


def rht(x, *, axis=-1, seed=0):
  """The random Hadamard transform along `axis`, float32 result."""
  register()
  x = jnp.asarray(x)
  call = jax.ffi.ffi_call(RHT_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
  return call(x, **_attrs(RHT_TARGET, axis=axis, rht_seed=seed))


def block_amax(x, *, axis=-1, rht=False, rht_seed=0):
  """float32 max |v| per 1x16 block along `axis` (x's shape with the axis divided by 16); see the module docstring."""
  register()
  x = jnp.asarray(x)
  shape = list(x.shape)
  shape[axis] //= 16
  call = jax.ffi.ffi_call(BLOCK_AMAX_TARGET, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
  return call(x, **_attrs(BLOCK_AMAX_TARGET, axis=axis, rht=rht, rht_seed=rht_seed))


def quantize_packed(x, s_dec, key=0, *, block_2d=False, stochastic=False, rht=False, rht_seed=0):
  """x (rows, K) -> (data uint8 (rows, K/2), scales uint8 flat swizzled); see numerics.pack."""
  from xla_fp4.numerics.packing import padded_scale_shape
  register()
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"quantize_packed takes a matrix (rows, K) with K last, got shape {x.shape}")
  rows, k = x.shape
  n_scales = int(np.prod(padded_scale_shape(rows, k)))
  call = jax.ffi.ffi_call(QUANTIZE_PACKED_TARGET, (jax.ShapeDtypeStruct((rows, k // 2), jnp.uint8),
                                                   jax.ShapeDtypeStruct((n_scales,), jnp.uint8)))
  return call(x, _scalar(s_dec, jnp.float32), _scalar(key, jnp.uint32),
              **_attrs(QUANTIZE_PACKED_TARGET, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed))


def dequantize_packed(data, scales, s_dec, *, dtype=jnp.float32):
  """Packed data and swizzled scales (uint8 or float8_e4m3fn) -> (rows, K) in `dtype`."""
  register()
  data = jnp.asarray(data)
  call = jax.ffi.ffi_call(DEQUANTIZE_PACKED_TARGET, jax.ShapeDtypeStruct((data.shape[0], 2 * data.shape[1]), dtype))
  return call(data, _u8_scales(scales), _scalar(s_dec, jnp.float32))


def gemm_packed(a_data, a_scales, b_data, b_scales, alpha, *, dtype=jnp.float32):
  """C (M, N) = alpha * A·Bᵀ of two packed K-major operands, float32 accumulation (the CPU reference FP4 GEMM)."""
  register()
  a_data, b_data = jnp.asarray(a_data), jnp.asarray(b_data)
  call = jax.ffi.ffi_call(GEMM_PACKED_TARGET, jax.ShapeDtypeStruct((a_data.shape[0], b_data.shape[0]), dtype))
  return call(a_data, _u8_scales(a_scales), b_data, _u8_scales(b_scales), _scalar(alpha, jnp.float32))
