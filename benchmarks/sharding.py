"""Sharded programs under the pass, side by side in one run: per-device dot FLOPs and collective bytes from the
compiled HLO, XLA's temporary memory per device, step time (the default recipe, stochastic rounding included), and
how far the sharded step is from the one-device step (nearest rounding), with and without the pass.

  python benchmarks/sharding.py [--small] [--out benchmarks/results/sharding.json]

The program is a residual MLP train step, `x = x + gelu(x @ w1) @ w2` per layer, `jax.jit(jax.grad(loss))`, on 8 host
devices (`--xla_force_host_platform_device_count=8`, mesh data=2 x model=4 unless the layout says otherwise). Layouts:
data parallel, FSDP, tensor parallel (w1 column-, w2 row-parallel over all 8 devices), 2D (batch over data, tensor
parallel over model), a scanned layer stack under FSDP, and MaxText's FSDP x tensor parallelism (weights FSDP over
data and tensor-parallel over model, the activations' features over model too) on data=2 x model=4 and on data=4 x
model=2 (MaxText's fsdp4_tp2); float32 and bfloat16. The pass runs with keep_head=0
keep_first=0 keep_last=0 (the last layer, whose output is the loss's, would be the head, and the last block kept):
every GEMM goes through the partitioned kernels. Step times are also taken on a 2-device mesh (model=2), as many
devices as the machine's cores, as on a pod where every device has its own compute: 8 host devices on 2 cores run in
turn what a layout replicates (the JSON's `quantized_elements.replication`: elements quantized per device x devices /
one device's count). And they are taken for the same program with the tokens flattened to one dim (`flat_*`): XLA's
CPU dot with two contracting dims (the baseline's wgrad over batch and sequence) is slow (the float32 step as written
takes 0.34 s on one device, flattened 0.19 s), the pass merges those dims, and so the one-device ratio as written
compares a slow baseline with a pass that does not pay for it. Targets (issue 8): dot FLOPs <= 1.05x and
collective bytes (scalar all-reduces aside) <= 1.10x in every layout, and the sharded step-time ratio (pass / none)
within 10% of the one-device ratio. `--small` runs tiny sizes for the test suite, which asserts the costs, not
the times.

Backends (`--backends`, issue 21): each layout's first row is the emulate backend's, timed; beside it the same step is
compiled with the native backend (every NVFP4 GEMM as `xla_fp4_gemm_packed` on packed operands) and with the emulate
backend's packed gathers (`packed_gathers`), costed and compared with the emulate backend's gradients, not timed (on
CPU the FP4 GEMM is the C++ reference). Every row splits its collective bytes into weight gathers, activation gathers
and reductions (sharding/cost.py). Issue 21's targets: native runs every NVFP4 GEMM packed, GEMM work <= 1.05x,
collective bytes <= 1.0x, FSDP weight gathers packed.

Differences to the one-device step: a sharded contraction (the wgrad over tokens under data parallelism, K in a
row-parallel layer) adds f32 partial sums in another order than one device does, with or without the pass, so the
JSON reports both programs' |sharded - one device| side by side. In float32 that stays at rounding level; in bfloat16
the baseline's one-ulp differences upstream can flip an FP4 rounding decision downstream, so the pass's difference is
larger there (a few 1e-3 relative), as it would be between any two runs that differ in the last bit. Where no
contraction is split the sharded step is bit-identical under nearest rounding (tests/sharding/test_layouts.py).

XLA flags from the environment's XLA_FLAGS apply to both programs and are recorded in the JSON (`xla_flags`).
benchmarks/results/sharding_no_combiner.json is the float32 run with XLA CPU's all-reduce combiner off
(`XLA_FLAGS=--xla_disable_hlo_passes=cpu-all-reduce-combiner`): what that pass does to the temporary memory
(docs/design.md §5).
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import xla_fp4  # noqa: E402
from xla_fp4.sharding.cost import cost  # noqa: E402

ALL = ("data", "model")


@dataclasses.dataclass(frozen=True)
class Layout:
  x: P
  w1: P
  w2: P
  scanned: bool = False
  constrained: bool = False  # every layer keeps the residual stream sharded like x
  mesh: tuple = (2, 4)  # (data, model)


# MaxText's FSDP x tensor parallelism: the weights FSDP-sharded over data and tensor-parallel over model, and the
# residual stream's features sharded over model too (its activation_embed axis), constrained so in every layer.
_FSDP_TP_EMBED = dict(x=P("data", None, "model"), w1=P("data", "model"), w2=P("model", "data"), constrained=True)
LAYOUTS = {
    "data_parallel": Layout(P(ALL), P(), P()),
    "fsdp": Layout(P(ALL), P(ALL, None), P(ALL, None)),
    "tensor_parallel": Layout(P(), P(None, ALL), P(ALL, None)),
    "2d": Layout(P("data"), P(None, "model"), P("model", None)),
    "scan_fsdp": Layout(P(ALL), P(None, ALL, None), P(None, ALL, None), scanned=True),
    "fsdp_tp_embed": Layout(**_FSDP_TP_EMBED),
    # On this mesh each quantized version of an activation was all-gathered along its features (1.21x the bytes)
    # until the fprop's and dgrad's operands left their K's sharding to the dot (sharding/partition.py).
    "fsdp_tp_embed_4x2": Layout(**_FSDP_TP_EMBED, mesh=(4, 2)),
    # The same, scanned: the wgrads' RHT-quantized operands are all-gathered along their features, where the
    # baseline reads the activation it gathered for the fprop or the dgrad (docs/design.md §5).
    "scan_fsdp_tp_embed_4x2": Layout(**dict(_FSDP_TP_EMBED, w1=P(None, "data", "model"), w2=P(None, "model", "data")),
                                     scanned=True, mesh=(4, 2)),
}


def loss(params, x, scanned, residual=None):
  """`residual`: the sharding every layer's input and output are constrained to, or None."""
  w1, w2 = params
  keep = (lambda a: a) if residual is None else (lambda a: jax.lax.with_sharding_constraint(a, residual))  # noqa: E731

  def layer(x, w):
    x = keep(x)
    return keep(x + jax.nn.gelu(x @ w[0]) @ w[1])

  if scanned:
    x = jax.lax.scan(lambda x, w: (layer(x, w), None), x, (w1, w2))[0]
  else:
    for a, b in zip(w1, w2):
      x = layer(x, (a, b))
  return jnp.mean(x.astype(jnp.float32) ** 2)


def make(layers, d, f, batch, seq, dtype, scanned, flat=False):
  """Parameters and input; `flat`: tokens as one dim, x of shape (batch * seq, d)."""
  k = jax.random.split(jax.random.key(0), 3)
  w1 = (jax.random.normal(k[0], (layers, d, f)) * d ** -0.5).astype(dtype)
  w2 = (jax.random.normal(k[1], (layers, f, d)) * f ** -0.5 * 0.5).astype(dtype)
  x = jax.random.normal(k[2], (batch * seq, d) if flat else (batch, seq, d)).astype(dtype)
  params = (w1, w2) if scanned else (list(w1), list(w2))
  return params, x


def place(mesh, params, x, layout):
  spec = LAYOUTS[layout]
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  w1, w2 = params
  xs = spec.x
  if x.ndim == 2 and len(xs) == 3:  # tokens flattened: (batch, seq) -> one dim, sharded like batch
    xs = P(xs[0], xs[2])
  if spec.scanned:
    return (put(w1, spec.w1), put(w2, spec.w2)), put(x, xs)
  return ([put(a, spec.w1) for a in w1], [put(b, spec.w2) for b in w2]), put(x, xs)


def step_fn(scanned, residual=None):
  return jax.jit(jax.grad(lambda p, x: loss(p, x, scanned, residual)))


def difference(a, b):
  """(max |a - b|, ||a - b|| / ||b||) over all leaves, in float32."""
  a = [np.asarray(u, np.float32) for u in jax.tree.leaves(a)]
  b = [np.asarray(v, np.float32) for v in jax.tree.leaves(b)]
  l2 = lambda xs: float(np.sqrt(sum(np.sum(np.square(x)) for x in xs)))  # noqa: E731
  return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b)), l2([u - v for u, v in zip(a, b)]) / l2(b)


def time_steps(fns, args, repeats):
  """Median seconds per call of each fn, interleaved so that machine noise hits all alike."""
  times = [[] for _ in fns]
  for fn, a in zip(fns, args):
    jax.block_until_ready(fn(*a))  # compile and warm up
  for _ in range(repeats):
    for i, (fn, a) in enumerate(zip(fns, args)):
      t = time.perf_counter()
      jax.block_until_ready(fn(*a))
      times[i].append(time.perf_counter() - t)
  return [statistics.median(t) for t in times]


# backend name -> xla_fp4.enable options; "emulate" is the default recipe's emulation
BACKENDS = {"emulate": {}, "native": {"backend": "native"}, "emulate_packed": {"packed_gathers": True}}


def measure(layout, dtype, sizes, repeats, backends=("emulate",)):
  """The layout's rows, one per backend (the first, emulate, also timed)."""
  spec = LAYOUTS[layout]
  scanned, constrained = spec.scanned, spec.constrained
  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = jax.make_mesh(spec.mesh, ALL, axis_types=auto)
  # As many devices as this machine has cores (model=2 of the first two): host devices beyond the cores take turns,
  # and every collective waits for all of them.
  cores = jax.make_mesh((1, 2), ALL, axis_types=auto, devices=jax.devices()[:2])
  params, x = make(*sizes, dtype, scanned)
  sharded_args = place(mesh, params, x, layout)
  cores_args = place(cores, params, x, layout)
  one = jax.devices()[0]
  single_args = jax.device_put((params, x), one)
  # The same program with tokens flattened to one dim: on one device XLA's CPU dot with two contracting dims (the
  # baseline's wgrad over batch and sequence) is slow, and the pass merges them, which flatters the one-device ratio.
  flat_params, flat_x = make(*sizes, dtype, scanned, flat=True)
  flat_cores_args = place(cores, flat_params, flat_x, layout)
  flat_single_args = jax.device_put((flat_params, flat_x), one)

  def compiled(args):
    return step_fn(scanned, args[1].sharding if constrained else None).lower(*args).compile()

  n_inputs = len(jax.tree.leaves(sharded_args))
  is_data = lambda number, dtype, dims: number == n_inputs - 1  # noqa: E731  (x: the last argument)

  def costed(entry):
    """Cost and XLA's temporary memory per device of `entry`'s sharded and one-device programs."""
    entry["cost"] = cost(entry["sharded"], is_data)
    entry["single_cost"] = cost(entry["single"])
    entry["temp"] = {k: entry[k].memory_analysis().temp_size_in_bytes for k in ("sharded", "single")}
    entry["qdq_calls"] = entry["sharded"].as_text().count('custom_call_target="xla_fp4_qdq')

  # none: the unrewritten program; pass: the default recipe (stochastic rounding), timed and costed; pass_nearest:
  # nearest rounding, compared with one device (the same quantized values). The other backends (costed, not timed):
  # native (the FP4 GEMM on packed operands; on CPU the C++ reference GEMM, whose speed says nothing of a GPU's) and
  # emulate with packed gathers.
  runs = [("none", None), ("pass", {}), ("pass_nearest", {"stochastic_rounding": False})]
  for backend in backends:
    if backend != "emulate":
      options = BACKENDS[backend]
      runs += [(backend, options), (backend + "_nearest", dict(options, stochastic_rounding=False))]
  out = {}
  for name, options in runs:
    if options is None:
      xla_fp4.disable()
    else:
      # Every layer in NVFP4 (no head, no kept blocks): each GEMM exercises the partitioned kernels.
      xla_fp4.enable(strict=True, keep_head=False, keep_first=0, keep_last=0, **options)
    # Compiled executables keep the setting they were compiled with (enable/disable clear the jit caches).
    entry = out[name] = {"sharded": compiled(sharded_args), "single": compiled(single_args)}
    if name in ("none", "pass"):
      entry["cores"] = compiled(cores_args)
      entry["flat_cores"] = compiled(flat_cores_args)
      entry["flat_single"] = compiled(flat_single_args)
    if not name.endswith("_nearest"):
      costed(entry)
    if name == "none" or name.endswith("_nearest"):
      reference = entry["single"](*single_args)
      entry["grads"] = entry["sharded"](*sharded_args)
      entry["diff"], entry["rel"] = difference(entry["grads"], reference)
      entry["scale"] = max(float(np.max(np.abs(np.asarray(g, np.float32)))) for g in jax.tree.leaves(reference))
  xla_fp4.disable()
  kinds = ("sharded", "single", "cores", "flat_cores", "flat_single")
  t = time_steps([out[n][k] for k in kinds for n in ("none", "pass")],
                 [a for a in (sharded_args, single_args, cores_args, flat_cores_args, flat_single_args)
                  for _ in range(2)], repeats)
  devices = mesh.devices.size
  base = {"layout": layout, "dtype": jnp.dtype(dtype).name, "mesh": dict(zip(ALL, spec.mesh))}

  def costs(new_name):
    """The row fields every backend reports: `new_name`'s program against the unrewritten one."""
    none, new = out["none"]["cost"], out[new_name]["cost"]
    temp = {"sharded_none": out["none"]["temp"]["sharded"], "sharded_pass": out[new_name]["temp"]["sharded"],
            "single_none": out["none"]["temp"]["single"], "single_pass": out[new_name]["temp"]["single"]}
    temp.update(sharded_ratio=temp["sharded_pass"] / temp["sharded_none"],
                single_ratio=temp["single_pass"] / temp["single_none"])
    nearest = out["pass_nearest" if new_name == "pass" else new_name + "_nearest"]
    return {
        "dot_flops": {"none": none.dot_flops, "pass": new.dot_flops, "ratio": new.dot_flops / none.dot_flops},
        # the FP4 GEMMs (xla_fp4_gemm_packed) and the emulated quantizations (xla_fp4_qdq calls) of the sharded step
        "packed_gemms": new.packed_gemms, "qdq_calls": out[new_name]["qdq_calls"],
        "collective_bytes": {"none": none.collective_bytes, "pass": new.collective_bytes,
                             "ratio_excluding_scalar": new.large_collective_bytes
                             / max(none.large_collective_bytes, 1),
                             "scalar_pass": new.scalar_collective_bytes, "collectives_pass": new.collectives,
                             "collectives_none": none.collectives,
                             # scalar collectives aside; sharding/cost.py says how a collective is told apart
                             "by_kind": {k: {"none": none.collective_bytes_by_kind[k],
                                             "pass": new.collective_bytes_by_kind[k],
                                             "ratio": new.collective_bytes_by_kind[k]
                                             / max(none.collective_bytes_by_kind[k], 1)}
                                         for k in new.collective_bytes_by_kind}},
        "temp_bytes_per_device": temp,
        # Elements the pass's kernels quantize per device, and that times the devices over one device's count: above
        # 1 where a layout replicates a quantized tensor (a replicated weight under data parallelism, a replicated
        # activation under tensor parallelism); a pod runs that on every device at once, 8 host devices on 2 cores
        # do not.
        "quantized_elements": {"per_device": new.quantized_elements,
                               "one_device": out[new_name]["single_cost"].quantized_elements,
                               "replication": new.quantized_elements * devices
                               / out[new_name]["single_cost"].quantized_elements},
        # max |sharded - one device| over the gradients, and max |gradient| (one device) to read it against
        **{key: {"none": out["none"][field], "pass_nearest": nearest[field]}
           for key, field in (("max_abs_sharded_minus_single", "diff"), ("max_abs_gradient", "scale"),
                              ("rel_l2_sharded_minus_single", "rel"))},
    }

  rows = [{**base, "backend": "emulate", **costs("pass"), "step_s": {
      "sharded_none": t[0], "sharded_pass": t[1], "single_none": t[2], "single_pass": t[3],
      "cores_none": t[4], "cores_pass": t[5],
      "sharded_ratio": t[1] / t[0], "single_ratio": t[3] / t[2], "cores_ratio": t[5] / t[4],
      "sharded_over_single_ratio": (t[1] / t[0]) / (t[3] / t[2]),
      "cores_over_single_ratio": (t[5] / t[4]) / (t[3] / t[2]),
      "flat_cores_none": t[6], "flat_cores_pass": t[7], "flat_single_none": t[8], "flat_single_pass": t[9],
      "flat_cores_ratio": t[7] / t[6], "flat_single_ratio": t[9] / t[8],
      "flat_cores_over_single_ratio": (t[7] / t[6]) / (t[9] / t[8])}}]
  for backend in backends:
    if backend != "emulate":
      # max |this backend's sharded gradients - the emulate backend's| (nearest rounding): the same numbers
      diff, rel = difference(out[backend + "_nearest"]["grads"], out["pass_nearest"]["grads"])
      rows.append({**base, "backend": backend, **costs(backend),
                   "sharded_minus_emulate": {"max_abs": diff, "rel_l2": rel}})
  return rows


def write_result(result, out):
  """The benchmark's JSON to the file `out`, or to stdout when None."""
  text = json.dumps(result, indent=1)
  if out:
    with open(out, "w") as f:
      f.write(text + "\n")
  else:
    print(text)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="tiny sizes (the test suite's run)")
  ap.add_argument("--layouts", default=",".join(LAYOUTS))
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--backends", default=",".join(BACKENDS),
                  help="emulate (timed) and, costed beside it, native and emulate_packed (packed_gathers)")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  # (layers, d_model, d_ff, batch, seq): 4 layers, so the default policy keeps one block (the last) in high precision
  sizes = (4, 128, 256, 16, 32) if args.small else (4, 256, 1024, 16, 128)  # the second: issue 8's measurement
  repeats = args.repeats or (2 if args.small else 10)
  backends = args.backends.split(",")
  assert backends[0] == "emulate" and set(backends) <= set(BACKENDS), f"--backends: emulate first, of {list(BACKENDS)}"
  rows = [row for dt in args.dtypes.split(",") for layout in args.layouts.split(",")
          for row in measure(layout, jnp.dtype(dt), sizes, repeats, backends)]
  result = {"benchmark": "sharding", "devices": 8,
            "sizes": dict(zip(("layers", "d_model", "d_ff", "batch", "seq"), sizes)),
            "jax": jax.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "xla_flags": os.environ["XLA_FLAGS"].split(), "rows": rows}
  for r in rows:
    if r["backend"] != "emulate":
      kinds = r["collective_bytes"]["by_kind"]
      print(f"{r['layout']:22s} {r['dtype']:9s} {r['backend']:14s} FP4 GEMMs {r['packed_gemms']} qdq "
            f"{r['qdq_calls']} dot flops x{r['dot_flops']['ratio']:.3f} collective bytes "
            f"x{r['collective_bytes']['ratio_excluding_scalar']:.3f} (weight gathers "
            f"x{kinds['weight_gathers']['ratio']:.3f}) temp memory x{r['temp_bytes_per_device']['sharded_ratio']:.2f}"
            f" rel L2 vs emulate {r['sharded_minus_emulate']['rel_l2']:.1e}", file=sys.stderr)
      continue
    print(f"{r['layout']:22s} {r['dtype']:9s} dot flops x{r['dot_flops']['ratio']:.3f}  collective bytes "
          f"x{r['collective_bytes']['ratio_excluding_scalar']:.3f} (+{r['collective_bytes']['scalar_pass']} B scalar)  "
          f"step pass/none 8 dev {r['step_s']['sharded_ratio']:.2f} 2 dev {r['step_s']['cores_ratio']:.2f} "
          f"one device {r['step_s']['single_ratio']:.2f}  flat tokens: 2 dev {r['step_s']['flat_cores_ratio']:.2f} "
          f"one device {r['step_s']['flat_single_ratio']:.2f}  "
          f"quantized x{r['quantized_elements']['replication']:.2f}  "
          f"temp memory x{r['temp_bytes_per_device']['sharded_ratio']:.2f} one device "
          f"x{r['temp_bytes_per_device']['single_ratio']:.2f}  "
          f"rel |sharded-single| none {r['rel_l2_sharded_minus_single']['none']:.1e} "
          f"pass {r['rel_l2_sharded_minus_single']['pass_nearest']:.1e}", file=sys.stderr)
  write_result(result, args.out)
  return result


if __name__ == "__main__":
  main()
