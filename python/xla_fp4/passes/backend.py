"""The backend of one compilation: which kernel set the rewrite calls on the platform and which GEMM runs
(emulated on q·scale operands, or the FP4 GEMM on packed ones), and why (shown in the decision report)."""

import dataclasses

from xla_fp4.config import Config
from xla_fp4.kernels import registry
from xla_fp4.passes.rewrite import FfiKernels, ReferenceKernels


@dataclasses.dataclass(frozen=True)
class Backend:
  """What the rewrite emits on one platform, and why (shown in the decision report)."""
  kernel_set: object  # a rewrite.KernelSet: FfiKernels or ReferenceKernels
  kernels: str  # which kernels run: "cpu FFI kernels", "CUDA FFI kernels", or the plain StableHLO form and why
  gemm: str  # "native" (packed operands, FP4 GEMM) or "emulate" (high-precision GEMM on q·scale operands)
  gemm_reason: str

  def describe(self):
    return {"kernels": self.kernels, "gemm": self.gemm, "gemm_reason": self.gemm_reason}


def is_cuda(platform):
  return registry.xla_platform(platform) == "CUDA"


def is_cpu(platform):
  return registry.xla_platform(platform) == "cpu"


def lowering_platform(platform):
  """JAX's name of `platform` for lowering the twins (cpu, cuda), None for another (the default backend's)."""
  return "cuda" if is_cuda(platform) else "cpu" if is_cpu(platform) else None


def choose_backend(config: Config, platform, module, kernels=None, *, partitioned=1) -> Backend:
  """The kernel set and GEMM for `platform`: the platform's FFI kernels where they are registered, else the plain
  StableHLO form lowered from `xla_fp4.numerics`; the FP4 GEMM where config.backend asks for it (native) or where one
  runs in hardware (auto: CUDA with compute capability 10.x and cuBLASLt >= 12.8). `kernels(module)` overrides.
  `partitioned`: how many SPMD partitions the module runs as."""
  registered, why = registry.status(platform)
  if kernels is not None:
    kernel_set = kernels(module)
    described = type(kernel_set).__name__
  elif registered:
    mesh = None
    if partitioned > 1:
      from xla_fp4.sharding.device_rows import device_mesh  # the partitioners load with the compiled kernels
      mesh = device_mesh(module, partitioned)
    kernel_set, described = FfiKernels(partitioned=partitioned > 1, mesh=mesh), why
  else:
    kernel_set, described = ReferenceKernels(module, lowering_platform(platform)), f"plain StableHLO form ({why})"
  gemm, reason = gemm_choice(config, platform, kernel_set.has_packed, described)
  return Backend(kernel_set, described, gemm, reason)


def gemm_choice(config: Config, platform, packed, described):
  """(the GEMM, why): "native" or "emulate" on `platform` for config.backend, where `packed` says whether its kernel
  set runs the packed targets (the compiled kernels) and `described` which kernels those are. Raises where
  XLA_FP4_BACKEND=native cannot run."""
  if config.backend == "emulate":
    return "emulate", "XLA_FP4_BACKEND=emulate"
  if is_cuda(platform):
    fp4_gemm, fp4_why = registry.fp4_gemm_supported()
  else:
    fp4_gemm, fp4_why = False, f"no FP4 tensor cores on {platform} (XLA_FP4_BACKEND=native runs the C++ reference GEMM)"
  if config.backend == "native":
    if not packed:
      raise RuntimeError(f"XLA_FP4_BACKEND=native needs the compiled kernels for platform {platform!r} ({described}); "
                         "build them (see docs/cuda.md) or use XLA_FP4_BACKEND=emulate")
    if is_cuda(platform) and not fp4_gemm:  # the GEMM would fail at run time: refuse at compile time instead
      raise RuntimeError(f"XLA_FP4_BACKEND=native: {fp4_why}; use XLA_FP4_BACKEND=emulate or auto")
    return "native", "XLA_FP4_BACKEND=native"
  if fp4_gemm and packed:
    return "native", "auto: cuBLASLt FP4 GEMM (compute capability 10.x)"
  return "emulate", f"auto: {fp4_why if not fp4_gemm else described}"


def summary(config: Config, platform):
  """One line: what a compilation for `platform` would run under `config` (`python -m xla_fp4 info`)."""
  registered, why = registry.status(platform)
  kernels = why if registered else "plain StableHLO form (its registration line says why)"
  try:
    gemm, reason = gemm_choice(config, platform, registered, kernels)
  except RuntimeError as e:
    return f"fails to compile: {e}"
  return f"{gemm} GEMM ({reason}); kernels: {kernels}"
