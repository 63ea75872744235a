"""Loading the compiled extension and registering its FFI targets with XLA, per platform.

Entry points: `register_all()` (what `xla_fp4.enable()` calls: every platform built, never raises, warns once per
platform that cannot register), `register(platform)` (one platform, raising the reason: direct kernel calls),
`status(platform)` (whether the pass can call the kernels there, or why it emits their StableHLO form), `info()` (what
`python -m xla_fp4 info` prints), `fp4_gemm_supported()`, and `extension()` / `available()` (the loaded extension,
or why not). What is registered, refused and warned about is in the process state (xla_fp4/state.py). Nothing here
touches JAX backends, so registering is safe in a plugin's `initialize()`.
"""

import re

import jax

from xla_fp4 import notice
from xla_fp4 import state



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


def xla_platform(platform):
  """XLA's name for a JAX backend platform: cpu, or CUDA for JAX's cuda/gpu (how custom-call targets are keyed); the
  one place a platform name is normalised. None stays None."""
  if platform is None:
    return None
  return "CUDA" if platform.lower() in ("cuda", "gpu") else platform.lower()


def runtime_ffi_api():
  """(major, minor) of the XLA FFI API of the running jaxlib, read from the headers it ships; None if unreadable."""
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


def _register(platform_name, module):
  """Register `module`'s handlers for `xla_platform` once; raises RuntimeError with the reason when XLA would not
  take them (an incompatible FFI API fails the whole backend at start-up, so it is checked here first)."""
  current = state.current()
  with current.lock:
    if platform_name in current.registered:
      return
    if platform_name in current.refused:
      raise RuntimeError(current.refused[platform_name])
    why = _ffi_mismatch(module)
    if why is not None:
      current.refused[platform_name] = why
      raise RuntimeError(why)
    # CPU targets register at once; CUDA ones wait in JAX until its CUDA plugin starts (xla_client keeps them).
    for name, capsule in module.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform_name, api_version=1)
    current.registered.add(platform_name)


def register(platform="cpu"):
  """Register the targets of one platform (a JAX platform name: cpu, cuda, gpu) with XLA (idempotent). Raises
  RuntimeError with the reason when that is not possible (kernels not built, not loadable, or refused)."""
  name = xla_platform(platform)
  if name == "cpu":
    module, why = _ext, _reason
  elif name == "CUDA":
    module, why = _load_cuda()
  else:
    module, why = None, f"xla_fp4 has no kernels for platform {platform!r}"
  if module is None:
    raise RuntimeError(why)
  _register(name, module)


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
    if not ok and (built or platform == "cpu") and current.first_time(("registration", why)):
      notice.warn(f"xla_fp4: {why}. NVFP4 on {platform} uses the plain StableHLO form of the kernels (same numbers, "
                  "slower).", RuntimeWarning)
    out[platform] = (ok, why)
  return out


def status(platform):
  """(registered, reason) for `platform`: which kernels the pass can call there, or why it uses the StableHLO form."""
  if platform is None:
    return False, "no platform"
  name, current = xla_platform(platform), state.current()
  if name in current.registered:
    return True, f"{name} FFI kernels"
  if name in current.refused:
    return False, current.refused[name]
  if name == "CUDA":
    module, why = _load_cuda()
    return False, why or "the CUDA FFI kernels are not registered (xla_fp4.enable() registers them)"
  if name == "cpu":
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
  if status("CUDA")[0]:
    out["FP4 GEMM"] = fp4_gemm_supported()[1] or "runs (compute capability 10.x, cuBLASLt >= 12.8)"
  return out


def fp4_gemm_supported():
  """(True, reason) when an FP4 tensor-core GEMM can run here (CUDA build, compute capability 10.x,
  cuBLASLt >= 12.8)."""
  module, why = _load_cuda()
  if module is None:
    return False, why
  return tuple(module.fp4_gemm_supported())
