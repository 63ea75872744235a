"""Throughput of the C++ qdq kernel against the XLA-compiled pure-JAX qdq, with a copy-class baseline, in one run.

    python benchmarks/kernels.py                          # 4096x4096 f32 and bf16 -> benchmarks/results/kernels.json
    python benchmarks/kernels.py --size 1024 --repeats 3  # quick look

`cpp` and `jax` take the same precomputed s_dec (xla_fp4_qdq's contract: the caller reduces amax), so those timings
cover quantize + dequantize only; `cpp_with_scale` is xla_fp4_qdq_with_scale, which the pass emits in unpartitioned
programs: it also measures amax (and, when stochastic, the key) from x, one more read. GB/s counts input + output
bytes; the baseline is a jitted `x * 1`, which XLA turns into a plain copy of the same bytes. Each entry is the median
of --repeats timed calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from xla_fp4 import kernels, numerics as nv
from xla_fp4.numerics.rht import rht_f32

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> qdq recipe
    "1x16_nearest": dict(block_2d=False, stochastic=False, rht=False),
    "16x16_nearest": dict(block_2d=True, stochastic=False, rht=False),
    "1x16_stochastic": dict(block_2d=False, stochastic=True, rht=False),
    "1x16_rht": dict(block_2d=False, stochastic=False, rht=True),
    # A wgrad's gradient operand: the RHT and the blocks run down the token axis (axis 0 of a row-major matrix).
    "1x16_stochastic_rht_axis0": dict(block_2d=False, stochastic=True, rht=True, axis=0),
}
RHT_SEED = 0


def _reference(x, s_dec, key, *, block_2d, stochastic, rht, axis=-1):
  """The pure-JAX qdq with the kernel's contract (numerics.qdq of the RHT-transformed x with the caller's s_dec)."""
  y = rht_f32(x.astype(jnp.float32), axis, RHT_SEED) if rht else x
  y = nv.qdq(y, axis=axis, block_2d=block_2d, rounding="stochastic" if stochastic else "nearest", key=key,
             global_scale=s_dec)
  return y.astype(x.dtype)


def _median_seconds(fn, args, repeats):
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _entry(seconds, x):
  moved = 2 * x.size * x.dtype.itemsize
  return {"seconds": seconds, "gb_per_s": moved / seconds / 1e9, "elements_per_s": x.size / seconds}


def run(size, repeats):
  kernels.register()
  key = jnp.uint32(1234)
  results = []
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    copy = _entry(_median_seconds(jax.jit(lambda x: x * 1), (x,), repeats), x)
    results.append({"dtype": jnp.dtype(dtype).name, "shape": [size, size], "impl": "copy_baseline", **copy})
    for name, recipe in VARIANTS.items():
      recipe = {"axis": -1, **recipe}
      x32 = x.astype(jnp.float32)
      s_dec = nv.global_decode_scale(nv.amax(rht_f32(x32, recipe["axis"], RHT_SEED) if recipe["rht"] else x32))
      impls = {
          "cpp": jax.jit(lambda x, s, k, r=recipe: kernels.qdq(x, s, k, rht_seed=RHT_SEED, **r)),
          "cpp_with_scale": jax.jit(lambda x, s, k, r=recipe: kernels.qdq_with_scale(x, 1234, rht_seed=RHT_SEED, **r)),
          "jax": jax.jit(lambda x, s, k, r=recipe: _reference(x, s, k, **r)),
      }
      for impl, fn in impls.items():
        e = _entry(_median_seconds(fn, (x, s_dec, key), repeats), x)
        e["fraction_of_copy_bandwidth"] = e["gb_per_s"] / copy["gb_per_s"]
        results.append({"dtype": jnp.dtype(dtype).name, "shape": [size, size], "variant": name, "impl": impl, **e})
        print(f"{jnp.dtype(dtype).name:9s} {name:26s} {impl:14s} {e['gb_per_s']:7.2f} GB/s "
              f"{e['elements_per_s'] / 1e9:6.3f} Gelem/s  {e['fraction_of_copy_bandwidth']:5.2f} x copy", flush=True)
    print(f"{jnp.dtype(dtype).name:9s} {'copy baseline':41s} {copy['gb_per_s']:7.2f} GB/s", flush=True)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", type=int, default=4096, help="square matrix side (a multiple of 16)")
  parser.add_argument("--repeats", type=int, default=10, help="timed calls per entry (median reported)")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.json")
  args = parser.parse_args()
  results = run(args.size, args.repeats)
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "jax": jax.__version__, "python": platform.python_version(), "machine": platform.machine(),
      "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
      "method": "median of repeats after warm-up; GB/s = (input + output bytes) / time; s_dec precomputed",
      "repeats": args.repeats,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
