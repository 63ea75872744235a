"""Throughput of every quantizing CPU kernel against a copy of the same tensor, measured side by side in one run.

    python benchmarks/kernels.py                          # 4096x4096 f32 and bf16 -> benchmarks/results/kernels.json
    python benchmarks/kernels.py --size 1024 --repeats 3  # quick look

Kernels (each in the recipe variants below where it takes them):
  qdq              xla_fp4_qdq (the caller's s_dec), the emulate backend's quantize-dequantize in partitioned programs,
                   as the pass emits it (apply_global_scale false: q * scale)
  qdq_with_scale   xla_fp4_qdq_with_scale, what the pass emits elsewhere: it also measures amax (and the key), one more read
  packed           xla_fp4_quantize_packed, the native backend's operand (E2M1 pairs and E4M3 scales, K-major)
  packed_stats     xla_fp4_quantize_packed_stats in a recorded step (telemetry's statistics from the same pass)
  packed_pair      xla_fp4_quantize_packed_pair: a value's row-wise and column-wise packed copies from one read
  packed_two       the same two copies from two xla_fp4_quantize_packed calls (two reads), for the pair's gain
  block_amax       xla_fp4_block_amax (a partitioned program's per-block maxima; with the RHT; with the key's digest)
  mx_qdq, mx_packed  the MX formats' quantizers (MXFP4 and MXFP8, nearest)
  grouped          an expert stack's quantizer, each expert with its own scale (numerics.grouped.slice_qdq, which the
                   pass lowers into the program: XLA-compiled JAX, no C++ kernel)
  jax              the pure-JAX qdq (numerics.qdq with the caller's s_dec), for scale

A kernel's rate is (input + output bytes) / time; the copy is a jitted `x * 1` (XLA makes it a plain copy of x), whose
rate is 2 * x's bytes / time. Each entry times `--repeats` rounds of (copy, kernel) after a warm-up call and reports
both medians, so the ratio compares calls made moments apart on the same (shared) machine. Targets (issue 46): nearest
forms >= 0.9x a copy, stochastic and RHT forms >= 0.75x.
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
from xla_fp4.numerics import grouped
from xla_fp4.numerics.rht import rht_f32

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> quantizer recipe
    "1x16_nearest": dict(block_2d=False, stochastic=False, rht=False),
    "16x16_nearest": dict(block_2d=True, stochastic=False, rht=False),
    "1x16_stochastic": dict(block_2d=False, stochastic=True, rht=False),
    "1x16_rht": dict(block_2d=False, stochastic=False, rht=True),
    # A wgrad's gradient operand: the RHT and the blocks run down the token axis (axis 0 of a row-major matrix).
    "1x16_stochastic_rht_axis0": dict(block_2d=False, stochastic=True, rht=True, axis=0),
}
# The pair quantizer's (row-wise copy, column-wise copy) recipes: an output gradient's (the dgrad's and the wgrad's:
# stochastic rounding both ways, the RHT down the tokens) and an activation's (the fprop's and the wgrad's).
PAIR_VARIANTS = {
    "1x16_stochastic|stochastic_rht_axis0": (dict(stochastic=True, rht=False), dict(stochastic=True, rht=True)),
    "1x16_nearest|rht_axis0": (dict(stochastic=False, rht=False), dict(stochastic=False, rht=True)),
}
RHT_SEED = 0
TARGET_NEAREST, TARGET_STOCHASTIC_OR_RHT = 0.9, 0.75
EXPERTS = 8  # the grouped rows: x as a stack of this many experts


def target(variant):
  return TARGET_STOCHASTIC_OR_RHT if ("stochastic" in variant or "rht" in variant) else TARGET_NEAREST


def _reference(x, s_dec, key, *, block_2d, stochastic, rht, axis=-1):
  """The pure-JAX qdq with the kernel's contract (numerics.qdq of the RHT-transformed x with the caller's s_dec)."""
  y = rht_f32(x.astype(jnp.float32), axis, RHT_SEED) if rht else x
  y = nv.qdq(y, axis=axis, block_2d=block_2d, rounding="stochastic" if stochastic else "nearest", key=key,
             global_scale=s_dec)
  return y.astype(x.dtype)


def _packed_axis(r):
  return 0 if r.get("axis", -1) == 0 else 1


def kernel_table(x, s_dec):
  """{(kernel, variant): jitted fn of x}: every quantizing kernel in the variants it takes."""
  key = jnp.uint32(1234)
  table = {}
  for name, r in VARIANTS.items():
    r = {"axis": -1, **r}
    s = s_dec[name]
    table["qdq", name] = lambda x, r=r, s=s: kernels.qdq(x, s, key, rht_seed=RHT_SEED, apply_global_scale=False, **r)
    table["qdq_with_scale", name] = lambda x, r=r: kernels.qdq_with_scale(x, 1234, rht_seed=RHT_SEED, **r)
    packed = {**r, "axis": _packed_axis(r)}
    table["packed", name] = lambda x, r=packed, s=s: kernels.quantize_packed(x, s, key, rht_seed=RHT_SEED, **r)
    table["jax", name] = lambda x, r=r, s=s: _reference(x, s, key, **r)
  plain = s_dec["1x16_nearest"]
  table["packed_stats", "1x16_nearest"] = lambda x: kernels.quantize_packed_stats(x, plain, key, step=0, axis=1)
  table["packed_stats", "1x16_stochastic_rht_axis0"] = lambda x: kernels.quantize_packed_stats(
      x, s_dec["1x16_stochastic_rht_axis0"], key, step=0, axis=0, stochastic=True, rht=True, rht_seed=RHT_SEED)
  # A GEMM pair's two packed copies of one value (rewrite/pairs.py): the pair quantizer's one read of x against the two
  # quantizers' two reads ("two", one jitted function); both move the same bytes, so their rates compare directly.
  for name, (row, col) in PAIR_VARIANTS.items():
    s_row, s_col = s_dec["1x16_nearest"], s_dec["1x16_stochastic_rht_axis0"]
    table["packed_pair", name] = lambda x, row=row, col=col: kernels.quantize_packed_pair(
        x, s_row, s_col, key, key, row_stochastic=row["stochastic"], row_rht=row["rht"],
        col_stochastic=col["stochastic"], col_rht=col["rht"], rht_seed=RHT_SEED)
    table["packed_two", name] = lambda x, row=row, col=col: (
        kernels.quantize_packed(x, s_row, key, axis=1, rht_seed=RHT_SEED, **row),
        kernels.quantize_packed(x, s_col, key, axis=0, rht_seed=RHT_SEED, **col))
  table["block_amax", "1x16_nearest"] = lambda x: kernels.block_amax(x)
  table["block_amax", "1x16_rht"] = lambda x: kernels.block_amax(x, rht=True, rht_seed=RHT_SEED)
  table["block_amax", "1x16_nearest_digest"] = lambda x: kernels.block_amax(x, digest=True)
  for fmt, fp8 in (("mxfp4", False), ("mxfp8", True)):
    table["mx_qdq", f"1x32_{fmt}_nearest"] = lambda x, fp8=fp8: kernels.mx_qdq(x, key, fp8=fp8)
    table["mx_packed", f"1x32_{fmt}_nearest"] = lambda x, fp8=fp8: kernels.mx_quantize_packed(x, key, fp8=fp8)
  for name in ("1x16_nearest", "16x16_nearest", "1x16_stochastic"):
    r = VARIANTS[name]
    table["grouped", name] = lambda x, r=r: grouped.slice_qdq(
        x.reshape(EXPERTS, -1, x.shape[-1]), 1234, groups=(0,), axis=2, rht_seed=RHT_SEED, **r)
  return {k: jax.jit(f) for k, f in table.items()}


def _bytes(tree):
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def _timed(fn, x):
  start = time.perf_counter()
  jax.block_until_ready(fn(x))
  return time.perf_counter() - start


def side_by_side(fn, copy, x, repeats):
  """(median kernel seconds, median copy seconds, output bytes) over rounds of one copy and one kernel call."""
  out = jax.block_until_ready(fn(x))  # compile and warm up
  jax.block_until_ready(copy(x))
  kernel_s, copy_s = [], []
  for _ in range(repeats):
    copy_s.append(_timed(copy, x))
    kernel_s.append(_timed(fn, x))
  return statistics.median(kernel_s), statistics.median(copy_s), _bytes(out)


def run(size, repeats, only=None):
  kernels.register()
  results = []
  copy = jax.jit(lambda x: x * 1)
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    x32 = x.astype(jnp.float32)
    s_dec = {name: nv.global_decode_scale(nv.amax(rht_f32(x32, r.get("axis", -1), RHT_SEED) if r["rht"] else x32))
             for name, r in VARIANTS.items()}
    for (kernel, variant), fn in kernel_table(x, s_dec).items():
      if only and kernel not in only:
        continue
      seconds, copy_seconds, out_bytes = side_by_side(fn, copy, x, repeats)
      moved, copy_moved = x.size * x.dtype.itemsize + out_bytes, 2 * x.size * x.dtype.itemsize
      fraction = (moved / seconds) / (copy_moved / copy_seconds)
      entry = {"dtype": jnp.dtype(dtype).name, "shape": [size, size], "kernel": kernel, "variant": variant,
               "seconds": seconds, "gb_per_s": moved / seconds / 1e9, "copy_seconds": copy_seconds,
               "copy_gb_per_s": copy_moved / copy_seconds / 1e9, "fraction_of_copy_bandwidth": fraction}
      if kernel not in ("jax", "grouped", "packed_two"):  # the C++ kernels carry the targets; the rest are for scale
        entry["target"] = target(variant)
        entry["meets_target"] = fraction >= entry["target"]
      results.append(entry)
      mark = "" if "target" not in entry else ("  ok" if entry["meets_target"] else f"  < {entry['target']}")
      print(f"{entry['dtype']:9s} {kernel:15s} {variant:28s} {entry['gb_per_s']:6.2f} GB/s  copy "
            f"{entry['copy_gb_per_s']:5.2f}  {fraction:5.2f} x copy{mark}", flush=True)
  return results


def cpu():
  """The CPU's model name and the widest vector ISA of the kernels' clones it runs (cpu_common.h
  XLA_FP4_VECTOR_CLONES): the kernels' arithmetic, and so their rate against a copy, depends on both."""
  try:
    info = Path("/proc/cpuinfo").read_text()
  except OSError:
    return {"model": platform.processor() or platform.machine(), "vector_isa": "unknown"}
  # "key<tabs>: value" lines; the number of tabs varies by key and kernel version.
  fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
  model = fields.get("model name") or platform.machine()
  flags = set(fields.get("flags", "").split())
  if platform.machine() not in ("x86_64", "AMD64"):
    return {"model": model, "vector_isa": f"{platform.machine()} (no vector clones)"}
  isa = "x86-64-v4 (AVX-512)" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "baseline x86-64")
  return {"model": model, "vector_isa": isa}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", type=int, default=4096, help="square matrix side (a multiple of 256)")
  parser.add_argument("--repeats", type=int, default=10, help="rounds of (copy, kernel) per entry (medians reported)")
  parser.add_argument("--only", nargs="*", help="these kernels only (names above)")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels.json")
  args = parser.parse_args()
  results = run(args.size, args.repeats, args.only)
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "jax": jax.__version__, "python": platform.python_version(), "machine": platform.machine(),
      "cpu_count": os.cpu_count(), "cpu": cpu(), "load_average_at_end": os.getloadavg(),
      "method": "rounds of (copy, kernel) after a warm-up, medians of each; GB/s = (input + output bytes) / time; "
                "qdq and the packers take a precomputed s_dec",
      "repeats": args.repeats, "targets": {"nearest": TARGET_NEAREST, "stochastic_or_rht": TARGET_STOCHASTIC_OR_RHT},
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
