"""The GPU check: the pass on a GPU uses its CUDA kernels, computes what the CPU emulation computes, and how fast.

    benchmarks/gpu_check.sh                      # build with CUDA, the CUDA kernel tests, then this script
    python benchmarks/gpu_check.py --out F.json  # this script alone (the extension already built with CUDA)
    python benchmarks/gpu_check.py --platform cpu --small   # the same checks with CPU standing in for the GPU (CI)

One train step of the small GPT of examples/train_lm.py (bf16 activations and weights as MaxText trains, f32 loss),
gradients with XLA_FP4=1 in the emulate backend:
  - the compiled HLO of the step on the device calls the xla_fp4 custom-call targets (the CUDA FFI kernels: on a GPU
    the platform's registration is what makes XLA accept the calls);
  - the step on the device equals the CPU emulation of the same step up to the GEMMs' summation order: the quantized
    operands are bit-identical (tests/kernels/test_cuda_kernels.py), the accumulations are not, so loss and gradients
    are compared with a tolerance (gradient rel. L2 <= 2e-2, |loss difference| <= 1e-3 relative);
  - the step time with the pass against the unrewritten step, side by side (median of --repeats);
  - on compute capability 10.x (Blackwell) the native backend too: packed operands and cuBLASLt's FP4 GEMM, checked
    against the emulated step on the same device.
The quantizing kernels' speed on the device: each kernel's GB/s (its input and outputs) as a fraction of a copy of
the same bytes (KERNELS, float32 and bfloat16; a measurement the first lent GPU makes, not a check).
And one expert layer (`jax.lax.ragged_dot`: its forward, dgrad and wgrad, groups of uneven sizes), with the pass: on a
GPU XLA keeps each ragged dot a `chlo.ragged_dot`, which the pass turns into the grouped recipe's one ragged GEMM on
quantized operands (docs/design.md §3); the device's results must equal numerics.grouped's reference computed on the
CPU up to the GEMM's summation order (float32, rel. L2 <= 1e-4 per output), far from the unquantized layer. On
Blackwell the same layer under the native backend too: each ragged dot one grouped FP4 GEMM (xla_fp4_ragged_gemm_packed,
cuBLASLt's FP4 GEMM once per group), against the same reference.
Writes one JSON file (default benchmarks/results/gpu_check.json) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

GRAD_TOL = 2e-2  # gradient rel. L2, device vs CPU emulation (different GEMM summation orders)
LOSS_TOL = 1e-3  # relative loss difference


def _model(small):
  import train_lm
  cfg = train_lm.ModelConfig(seq=32 if small else 128, d_model=64 if small else 256, layers=2 if small else 4,
                             heads=2 if small else 4, d_ff=256 if small else 1024)
  return train_lm, train_lm.GPT(cfg), cfg


def _inputs(small):
  train_lm, model, cfg = _model(small)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, cfg.seq), jnp.int32))["params"]
  params = jax.device_get(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))  # the same values on every device
  batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (4 if small else 16, cfg.seq + 1), dtype=np.int32)
  step = jax.jit(jax.value_and_grad(functools.partial(train_lm.loss_fn, model)))
  return step, params, jnp.asarray(batch)


def _on(device, tree):
  return jax.device_put(tree, device)


def _targets(compiled_text):
  return sorted(set(re.findall(r'custom_call_target="(xla_fp4_[a-z_0-9]+)"', compiled_text)))


def _run(step, params, batch, device, repeats):
  """(loss, grads as numpy f32, custom-call targets in the compiled HLO, median seconds)."""
  args = _on(device, (params, batch))
  compiled = step.lower(*args).compile()
  loss, grads = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  grads = [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]
  return float(loss), grads, _targets(compiled.as_text()), statistics.median(times) if times else None


def _compare(a, b):
  """(relative loss difference, worst per-leaf gradient rel. L2) of two runs."""
  loss = abs(a[0] - b[0]) / max(abs(b[0]), 1e-12)
  grad = max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12)) for x, y in zip(a[1], b[1]))
  return loss, grad


EXPERT_TOL = 1e-4  # expert layer, float32: device vs the CPU reference (summation order only)


def _expert_layer():
  """(layer, its arguments, the grouped reference): a top-1 MoE expert layer's forward and both gradients."""
  from xla_fp4 import numerics as nv
  from xla_fp4.numerics import grouped
  sizes = jnp.asarray((40, 0, 23, 72, 9), jnp.int32)  # uneven groups, an empty one, 16 rows after the last
  k = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(k[0], (5, 64, 96)) * jnp.array([1.0, 2.0, 0.01, 1.0, 50.0])[:, None, None]
  x = jax.random.normal(k[1], (160, 64))
  ct = jax.random.normal(k[2], (160, 96))

  def layer(w, x, ct):
    h = jnp.sin(x)  # an activation (an argument could be taken for the weight)
    y, vjp = jax.vjp(lambda w, h: jax.lax.ragged_dot(h, w, sizes), w, h)
    return (y,) + vjp(ct)

  def reference(w, x, ct):
    h, rht = jnp.sin(x), nv.OperandRecipe(rht=True)
    return (grouped.ragged_dot(h, w, sizes), grouped.ragged_contracting_dot(h, ct, sizes, lhs_recipe=rht,
                                                                          rhs_recipe=rht),
            grouped.ragged_dot(ct, jnp.swapaxes(w, 1, 2), sizes))
  return layer, (w, x, ct), reference


def _check_experts(device, cpu, backend="emulate"):
  """The expert layer with the pass on the device, against the grouped reference on the CPU; under the native backend
  each of its three ragged dots must run the grouped FP4 GEMM."""
  import xla_fp4
  layer, args, reference = _expert_layer()
  xla_fp4.enable(backend=backend, keep_head=False, min_dim=1, stochastic_rounding=False)
  compiled = jax.jit(layer).lower(*_on(device, args)).compile()
  got = [np.asarray(v, np.float32) for v in compiled(*_on(device, args))]
  xla_fp4.disable()
  want = [np.asarray(v, np.float32) for v in jax.jit(reference).lower(*_on(cpu, args)).compile()(*_on(cpu, args))]
  plain = [np.asarray(v, np.float32) for v in jax.jit(layer)(*_on(cpu, args))]
  rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))  # noqa: E731
  diffs = [rel(g, r) for g, r in zip(got, want)]
  quantized = [rel(p, r) for p, r in zip(plain, want)]
  grouped_fp4_gemms = compiled.as_text().count('custom_call_target="xla_fp4_ragged_gemm_packed"')
  return dict(ok=(max(diffs) <= EXPERT_TOL and min(quantized) > 100 * EXPERT_TOL
                  and (backend != "native" or grouped_fp4_gemms == 3)),
              rel_l2=dict(zip(("forward", "wgrad", "dgrad"), diffs)), tolerance=EXPERT_TOL,
              rel_l2_unquantized=dict(zip(("forward", "wgrad", "dgrad"), quantized)),
              ragged_dots_in_hlo=len(re.findall(r"ragged-dot\(", compiled.as_text())),
              grouped_fp4_gemms_in_hlo=grouped_fp4_gemms)


def _check_telemetry(step, params, batch, device, cpu):
  """The GPU step with telemetry: outputs bit-identical to the step without it; records (drained from the CUDA
  sink, written without a synchronisation) equal the CPU's for every GEMM operand (amax exactly, underflow within 1e-3,
  SNR within 0.1 dB: the operands are bit-identical where the upstream GEMMs agree; bf16 GEMMs need not)."""
  import tempfile
  import xla_fp4
  from xla_fp4 import telemetry
  records, outputs = {}, {}
  for where, dev in (("device", device), ("cpu", cpu)):
    directory = tempfile.mkdtemp(prefix=f"xla_fp4_gpu_check_telemetry_{where}_")
    xla_fp4.enable(backend="emulate", telemetry=directory)
    outputs[where] = _run(step, params, batch, dev, 0)
    telemetry.flush()
    records[where] = {(r["layer"], r["role"], r["operand"], r["block"]): r for r in telemetry.load(directory)}
  xla_fp4.enable(backend="emulate")
  plain = _run(step, params, batch, device, 0)
  xla_fp4.disable()
  same_outputs = _compare(outputs["device"], plain) == (0.0, 0.0)
  worst = dict(amax=0.0, underflow=0.0, snr_db=0.0)
  for key, r in records["cpu"].items():
    g = records["device"].get(key)
    if g is None:
      worst["missing"] = worst.get("missing", 0) + 1
      continue
    worst["amax"] = max(worst["amax"], abs(g["amax"] - r["amax"]) / max(r["amax"], 1e-30))
    worst["underflow"] = max(worst["underflow"], abs(g["underflow"] - r["underflow"]))
    if g["snr_db"] is not None and r["snr_db"] is not None:
      worst["snr_db"] = max(worst["snr_db"], abs(g["snr_db"] - r["snr_db"]))
  ok = (same_outputs and records["cpu"] and len(records["device"]) == len(records["cpu"]) and "missing" not in worst
        and worst["underflow"] <= 1e-3 and worst["snr_db"] <= 0.1)
  return dict(ok=bool(ok), outputs_unchanged=same_outputs, records=len(records["device"]), worst_difference=worst)


# The quantizing kernels whose speed the GPU check reports (issue 46: each as a fraction of a copy of the same bytes).
KERNELS = {
    "qdq 1x16 nearest": lambda k, x, s: k.qdq(x, s),
    "qdq 16x16 nearest": lambda k, x, s: k.qdq(x, s, block_2d=True),
    "qdq 1x16 stochastic": lambda k, x, s: k.qdq(x, s, 7, stochastic=True),
    "qdq 1x16 rht": lambda k, x, s: k.qdq(x, s, rht=True),
    "qdq 1x16 stochastic rht axis 0": lambda k, x, s: k.qdq(x, s, 7, axis=0, stochastic=True, rht=True),
    "qdq_with_scale 1x16": lambda k, x, s: k.qdq_with_scale(x),
    "quantize_packed 1x16": lambda k, x, s: k.quantize_packed(x, s),
    "quantize_packed 16x16": lambda k, x, s: k.quantize_packed(x, s, block_2d=True),
    "quantize_packed 1x16 axis 0": lambda k, x, s: k.quantize_packed(x, s, axis=0),
    # an output gradient's two copies (dgrad's, wgrad's with the RHT) from one read, and from two quantizers' two
    "quantize_packed_pair gradient": lambda k, x, s: k.quantize_packed_pair(
        x, s, s, 7, 8, row_stochastic=True, col_stochastic=True, col_rht=True),
    "quantize_packed two gradient": lambda k, x, s: (k.quantize_packed(x, s, 7, stochastic=True),
                                                     k.quantize_packed(x, s, 8, axis=0, stochastic=True, rht=True)),
    "block_amax": lambda k, x, s: k.block_amax(x),
    "mx_qdq mxfp4": lambda k, x, s: k.mx_qdq(x),
    "mx_qdq mxfp8": lambda k, x, s: k.mx_qdq(x, fp8=True),
    "mx_quantize_packed mxfp4": lambda k, x, s: k.mx_quantize_packed(x),
    "mx_quantize_packed mxfp8": lambda k, x, s: k.mx_quantize_packed(x, fp8=True),
}


def _bytes(tree):
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _kernel_bandwidth(device, small, repeats):
  """Each quantizing kernel on the device on a (rows, K) operand, float32 and bfloat16: GB/s of its input plus its
  outputs, and that as a fraction of a copy of the same bytes on the device (a jitted x * 1, timed alike); the median
  of `repeats` calls after a warm-up. A measurement, not a check."""
  from xla_fp4 import kernels
  n = 256 if small else 4096
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    s_dec = jax.device_put(jnp.float32(1 / 2688), device)

    def seconds(fn):
      jax.block_until_ready(fn(x, s_dec))
      times = []
      for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, s_dec))
        times.append(time.perf_counter() - start)
      return statistics.median(times)

    copy = jax.jit(lambda v, s: v * jnp.asarray(1, v.dtype))
    copy_gb_s = 2 * _bytes(x) / seconds(copy) / 1e9
    rows = out.setdefault(jnp.dtype(dtype).name, {"copy_gb_s": copy_gb_s})
    for name, call in KERNELS.items():
      fn = jax.jit(functools.partial(call, kernels))
      gb_s = (_bytes(x) + _bytes(jax.eval_shape(fn, x, s_dec))) / seconds(fn) / 1e9
      rows[name] = dict(gb_s=gb_s, of_copy=gb_s / copy_gb_s)
  return dict(shape=[n, n], kernels=out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--platform", default="cuda", help="the device platform to check (cpu: a stand-in, for CI)")
  p.add_argument("--small", action="store_true", help="a tiny model (CI)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
  args = p.parse_args(argv)

  import xla_fp4
  from xla_fp4 import kernels
  try:
    device = jax.devices(args.platform)[0]
  except RuntimeError as e:
    sys.exit(f"gpu_check: no {args.platform} device ({e}); run it on a machine with an NVIDIA GPU and jax[cuda]")
  cpu = jax.devices("cpu")[0]
  step, params, batch = _inputs(args.small)
  result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=str(getattr(device, "device_kind", device)), platform=args.platform, jax=jax.__version__,
                small=args.small, checks={})
  checks = result["checks"]

  baseline = _run(step, params, batch, device, args.repeats)  # no pass installed yet
  xla_fp4.enable(backend="emulate")
  result["kernels"] = kernels.info()
  emulated = _run(step, params, batch, device, args.repeats)
  reference = _run(step, params, batch, cpu, 0)  # the CPU emulation: C++ kernels, the numbers of xla_fp4.numerics
  loss_diff, grad_diff = _compare(emulated, reference)
  checks["device runs the xla_fp4 targets"] = dict(
      ok="xla_fp4_qdq_with_scale" in emulated[2] and kernels.status(args.platform)[0], targets=emulated[2],
      registered=kernels.status(args.platform)[1])
  checks["device == CPU emulation"] = dict(ok=loss_diff <= LOSS_TOL and grad_diff <= GRAD_TOL,
                                           loss=[emulated[0], reference[0]], loss_rel_diff=loss_diff,
                                           grad_rel_l2=grad_diff, tolerance=dict(loss=LOSS_TOL, grad=GRAD_TOL))
  result["step_seconds"] = dict(none=baseline[3], emulate=emulated[3], ratio_emulate=emulated[3] / baseline[3])

  result["kernel_bandwidth"] = _kernel_bandwidth(device, args.small, args.repeats)
  xla_fp4.disable()
  checks["expert layer on the device == grouped reference"] = _check_experts(device, cpu)
  checks["telemetry on the device == CPU, outputs unchanged"] = _check_telemetry(step, params, batch, device, cpu)

  fp4_gemm, why = kernels.fp4_gemm_supported() if args.platform != "cpu" else (False, "cpu stand-in")
  capability = str(getattr(device, "compute_capability", "") or "")
  result["fp4_gemm"] = dict(supported=fp4_gemm, reason=why, compute_capability=capability)
  if capability.startswith("10.") and not fp4_gemm:
    # A Blackwell GPU must run the FP4 GEMM: a check that skipped it would pass without testing what it is for.
    checks["FP4 GEMM runs on compute capability 10.x"] = dict(ok=False, compute_capability=capability, reason=why)
  if fp4_gemm:
    xla_fp4.enable(backend="native")
    native = _run(step, params, batch, device, args.repeats)
    loss_diff, grad_diff = _compare(native, emulated)
    checks["native == emulate on the device"] = dict(
        ok="xla_fp4_gemm_packed" in native[2] and loss_diff <= LOSS_TOL and grad_diff <= GRAD_TOL,
        targets=native[2], loss_rel_diff=loss_diff, grad_rel_l2=grad_diff)
    result["step_seconds"].update(native=native[3], ratio_native=native[3] / baseline[3])
    for fmt in ("mxfp4", "mxfp8"):  # cuBLASLt's VEC32_UE8M0 block-scaled GEMMs against the same format emulated
      xla_fp4.enable(backend="emulate", format=fmt)
      emulated_mx = _run(step, params, batch, device, 0)
      xla_fp4.enable(backend="native", format=fmt)
      native_mx = _run(step, params, batch, device, args.repeats)
      loss_diff, grad_diff = _compare(native_mx, emulated_mx)
      checks[f"native {fmt} == emulate {fmt} on the device"] = dict(
          ok="xla_fp4_mx_gemm_packed" in native_mx[2] and loss_diff <= LOSS_TOL and grad_diff <= GRAD_TOL,
          targets=native_mx[2], loss_rel_diff=loss_diff, grad_rel_l2=grad_diff)
      result["step_seconds"][f"native_{fmt}"] = native_mx[3]
    xla_fp4.disable()
    checks["expert layer native on the device == grouped reference"] = _check_experts(device, cpu, "native")
  xla_fp4.disable()

  result["ok"] = all(c["ok"] for c in checks.values())
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
  for name, c in checks.items():
    details = json.dumps({k: v for k, v in c.items() if k != "ok"}, default=str)
    print(f"{'PASS' if c['ok'] else 'FAIL'}  {name}: {details}")
  for dtype, rows in result["kernel_bandwidth"]["kernels"].items():
    print(f"kernels, {dtype}: " + ", ".join(f"{name} {r['of_copy']:.2f}x" for name, r in rows.items()
                                           if name != "copy_gb_s") + f" of a copy ({rows['copy_gb_s']:.1f} GB/s)")
  print(f"step seconds: {json.dumps(result['step_seconds'])}\nwrote {args.out}")
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
