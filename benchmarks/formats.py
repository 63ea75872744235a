"""The number formats side by side (issue 42): NVFP4, NVFP4 with Four Over Six, MXFP4 and MXFP8 on one residual-MLP
training step, measured in one run.

  python benchmarks/formats.py [--small] [--out benchmarks/results/formats.json]

Per format:
- `gemm_rel_error`: one fprop GEMM (activations 1xB along K, weights in the format's 2D tiles) against float64, as
  relative Frobenius error, on Gaussian activations with a few outlier rows;
- `quantize_vs_copy`: the quantizer the emulated pass runs for that format (the C++ kernels xla_fp4_qdq_with_scale
  and xla_fp4_mx_qdq) on a 4096 x 4096 float32 tensor, as a fraction of a copy's bandwidth (the same bytes read and
  written); `packed_quantize_vs_copy`: the native backend's packer (xla_fp4_quantize_packed after its block maxima,
  xla_fp4_mx_quantize_packed), its time against a copy of the same tensor;
- `step_time_ratio`: the emulated train step over the unrewritten one (one device, float32), timed interleaved;
- `fsdp_collective_bytes_ratio`: collective bytes per device under FSDP over 8 host devices, pass / none (scalar
  all-reduces aside); `fsdp_packed_weight_gathers_ratio`: the bytes of the weights' gathers with packed operands
  (XLA_FP4_PACKED_GATHERS, the native backend's form), pass / none (sharding/cost.py tells weights from data);
- `rel_l2_vs_high_precision`: the step's gradients against the unrewritten step's.
"""

import argparse
import json
import os
import platform
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import sharding as bench  # noqa: E402

import xla_fp4  # noqa: E402
from xla_fp4 import kernels  # noqa: E402
from xla_fp4.numerics import formats  # noqa: E402
from xla_fp4.numerics import gemm as nv  # noqa: E402
from xla_fp4.sharding.cost import cost  # noqa: E402

FORMATS = ("nvfp4", "nvfp4+4/6", "mxfp4", "mxfp8")


def _options(fmt):
  return dict(four_over_six=True) if fmt == "nvfp4+4/6" else dict(format=fmt)


def gemm_error(fmt, m, k, n):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[:: max(m // 8, 1)] *= 30.0  # outlier rows, as activations have
  w = (rng.standard_normal((k, n)) * k ** -0.5).astype(np.float32)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  name, fos = fmt.split("+")[0], fmt.endswith("+4/6")
  f = formats.FORMATS[name]
  got = nv.dot_general(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())),
                       a_recipe=nv.OperandRecipe(format=name, four_over_six=fos),
                       b_recipe=nv.OperandRecipe(block_2d=f.tiles_2d, format=name, four_over_six=fos))
  return float(np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact))


def quantize_vs_copy(fmt, size, repeats):
  x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  copy = jax.jit(lambda v: v * 1.0)
  fos = fmt.endswith("+4/6")
  if fmt.startswith("nvfp4"):
    quantize = jax.jit(lambda v: kernels.qdq_with_scale(v, axis=1, four_over_six=fos)[0])
    packed = jax.jit(lambda v: kernels.quantize_packed(
        v, jnp.max(kernels.block_amax(v, axis=1)) / (1536.0 if fos else 2688.0), four_over_six=fos))
  else:
    quantize = jax.jit(lambda v: kernels.mx_qdq(v, axis=1, fp8=fmt == "mxfp8"))
    packed = jax.jit(lambda v: kernels.mx_quantize_packed(v, fp8=fmt == "mxfp8"))
  t_copy, t_quant, t_packed = bench.time_steps([copy, quantize, packed], [(x,), (x,), (x,)], repeats)
  return dict(quantize_vs_copy=t_copy / t_quant, packed_quantize_vs_copy=t_copy / t_packed)


def step_and_collectives(fmt, sizes, repeats):
  layers, d, f, batch, seq = sizes
  params, x = bench.make(layers, d, f, batch, seq, jnp.float32, False)
  step = bench.step_fn(False)
  options = dict(**_options(fmt), keep_head=False, keep_first=0, keep_last=0, strict=True)
  one = jax.device_put((params, x), jax.devices()[0])
  base = step.lower(*one).compile()
  xla_fp4.enable(**options)
  try:
    quantized = step.lower(*one).compile()
  finally:
    xla_fp4.disable()
  t_base, t_fp = bench.time_steps([base, quantized], [one, one], repeats)
  rel = bench.difference(quantized(*one), base(*one))[1]
  spec = bench.LAYOUTS["fsdp"]
  mesh = jax.make_mesh(spec.mesh, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  placed = bench.place(mesh, params, x, "fsdp")
  n_params = len(jax.tree.leaves(params))
  is_data = lambda number, dtype, dims: number >= n_params  # noqa: E731 (the tokens follow the weights)
  none = cost(step.lower(*placed).compile(), is_data=is_data)
  compiled = {}
  for name, extra in (("emulated", {}), ("packed", dict(packed_gathers=True))):
    xla_fp4.enable(**options, **extra)
    try:
      compiled[name] = cost(step.lower(*placed).compile(), is_data=is_data)
    finally:
      xla_fp4.disable()
  gathers = lambda c: c.collective_bytes_by_kind["weight_gathers"]  # noqa: E731
  return dict(step_time_ratio=t_fp / t_base, step_s=dict(none=t_base, pass_=t_fp), rel_l2_vs_high_precision=rel,
              fsdp_collective_bytes_ratio=compiled["emulated"].large_collective_bytes / max(
                  none.large_collective_bytes, 1),
              fsdp_packed_weight_gathers_ratio=gathers(compiled["packed"]) / max(gathers(none), 1))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="tiny sizes (the test suite's run)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  sizes = (2, 64, 256, 8, 32) if args.small else (4, 512, 2048, 8, 128)
  size, repeats = (512, 2) if args.small else (4096, 7)
  xla_fp4.enable()  # registers the kernels
  xla_fp4.disable()
  rows = []
  for fmt in FORMATS:
    f = formats.FORMATS[fmt.split("+")[0]]
    row = dict(format=fmt, bits_per_element=f.bits, block=f.block, scale=f.scale,
               gemm_rel_error=gemm_error(fmt, 256, 1024, 256), **quantize_vs_copy(fmt, size, repeats),
               **step_and_collectives(fmt, sizes, repeats))
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  result = dict(benchmark="formats", sizes=dict(zip(("layers", "d_model", "d_ff", "batch", "seq"), sizes)),
                quantize_size=size, jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count(), rows=rows)
  text = json.dumps(result, indent=1)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
