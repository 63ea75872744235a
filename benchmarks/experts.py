"""Mixtures of experts under the pass, side by side in one run: per-device dot FLOPs and collective bytes from the
compiled HLO, XLA's temporary memory per device and step time of an MoE train step, with and without the pass, on one
device and sharded over 8 host devices (`--xla_force_host_platform_device_count=8`).

  python benchmarks/experts.py [--small] [--out benchmarks/results/experts.json]

Three MoE layers as users write them, each `jax.jit(jax.grad(loss))` of a residual stack of `layers` MoE blocks,
every expert GEMM (forward, dgrad, wgrad) in NVFP4 (keep_head=0, keep_first=0, keep_last=0):
- `einsum`: GShard-style dispatch and combine einsums around the expert einsums `ecd,edf->ecf` (the expert a batch
  dim), capacity = tokens / experts.
- `ragged`: tokens sorted by expert and `jax.lax.ragged_dot` (on CPU JAX expands it into dot_generals masked per
  group, which the pass quantizes per group).
- `dense`: every token meets every expert, weighted by the router's softmax (MaxText's `sparse_matmul=false`): the up
  projection `td,edf->tef` holds the expert as a free dim of its weight, the down projection `tef,efd->ted` as a
  batch dim.
`einsum` and `ragged` route top-1.
Layouts: `single` (one device), `expert_parallel` (tokens over all 8 devices, experts over all 8: the dispatch is an
all-to-all), `fsdp` (tokens over all 8 devices, expert weights sharded over all 8 along d_model and gathered).
Targets (issue 24): dot FLOPs <= 1.05x and collective bytes (scalar all-reduces aside) <= 1.10x of the unrewritten
step in every sharded layout. The pass's per-expert decode scales are reductions over each expert's slice, which XLA
partitions like any reduction: an all-reduce of one float per expert where a slice is split over devices.
The JSON also holds how far each sharded step's gradients are from the one-device step's, with and without the pass
(nearest rounding): a split contraction adds f32 partial sums in another order, with or without the pass.
`--small` runs tiny sizes for the test suite, which asserts the costs, not the times.
"""

import argparse
import os
import platform
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import xla_fp4  # noqa: E402
from xla_fp4.sharding.cost import cost  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharding import difference, time_steps, write_result  # noqa: E402

AXIS = "x"
PROGRAMS = ("einsum", "ragged", "dense")
LAYOUTS = {  # (tokens, router, expert weights [layers, E, d, f]) and the dispatched tokens [E, C, d] (einsum only)
    "single": None,
    "expert_parallel": dict(x=P(AXIS), router=P(), w=P(None, AXIS), dispatched=P(AXIS)),
    "fsdp": dict(x=P(AXIS), router=P(), w=P(None, None, AXIS), dispatched=None),
}


def make(layers, experts, d, f, tokens, dtype):
  k = jax.random.split(jax.random.key(0), 4)
  params = {"router": (jax.random.normal(k[0], (layers, d, experts)) * d ** -0.5).astype(dtype),
            "w_in": (jax.random.normal(k[1], (layers, experts, d, f)) * d ** -0.5).astype(dtype),
            "w_out": (jax.random.normal(k[2], (layers, experts, f, d)) * f ** -0.5 * 0.5).astype(dtype)}
  return params, jax.random.normal(k[3], (tokens, d)).astype(dtype)


def _einsum_block(x, router, w_in, w_out, dispatched):
  """Top-1 routing with capacity tokens / experts; `dispatched`: the sharding of the tokens per expert, or None."""
  experts = router.shape[-1]
  capacity = x.shape[0] // experts
  logits = (x @ router).astype(jnp.float32)
  choice = jax.nn.one_hot(jnp.argmax(logits, axis=-1), experts, dtype=jnp.float32)  # [T, E]
  position = (jnp.cumsum(choice, axis=0) - 1.0) * choice
  dispatch = choice[:, :, None] * jax.nn.one_hot(position, capacity, dtype=jnp.float32)  # [T, E, C]; overflow drops
  gate = jnp.sum(jax.nn.softmax(logits) * choice, axis=-1)
  xe = jnp.einsum("tec,td->ecd", dispatch.astype(x.dtype), x)
  if dispatched is not None:
    xe = jax.lax.with_sharding_constraint(xe, dispatched)
  h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", xe, w_in))
  ye = jnp.einsum("ecf,efd->ecd", h, w_out)
  return jnp.einsum("tec,ecd->td", (dispatch * gate[:, None, None]).astype(x.dtype), ye)


def _ragged_block(x, router, w_in, w_out, dispatched):
  """Top-1 routing, tokens sorted by expert, one ragged dot per expert GEMM, unsorted after."""
  experts = router.shape[-1]
  logits = (x @ router).astype(jnp.float32)
  choice = jnp.argmax(logits, axis=-1)
  gate = jnp.max(jax.nn.softmax(logits), axis=-1)
  order = jnp.argsort(choice)
  sizes = jnp.bincount(choice, length=experts).astype(jnp.int32)
  xs = x[order]
  h = jax.nn.gelu(jax.lax.ragged_dot(xs, w_in, sizes))
  ys = jax.lax.ragged_dot(h, w_out, sizes)
  return jnp.zeros_like(x).at[order].set(ys) * gate[:, None].astype(x.dtype)


def _dense_block(x, router, w_in, w_out, dispatched):
  """Every token through every expert, the outputs weighted by the router's softmax."""
  weights = jax.nn.softmax((x @ router).astype(jnp.float32)).astype(x.dtype)
  h = jax.nn.gelu(jnp.einsum("td,edf->tef", x, w_in))
  return jnp.einsum("ted,te->td", jnp.einsum("tef,efd->ted", h, w_out), weights)


def loss(params, x, program, dispatched=None):
  block = {"einsum": _einsum_block, "ragged": _ragged_block, "dense": _dense_block}[program]
  for i in range(params["router"].shape[0]):
    x = x + block(x, params["router"][i], params["w_in"][i], params["w_out"][i], dispatched)
  return jnp.mean(x.astype(jnp.float32) ** 2)


def place(params, x, layout):
  spec = LAYOUTS[layout]
  if spec is None:
    return jax.device_put((params, x), jax.devices()[0]), None
  mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  placed = {"router": put(params["router"], spec["router"]), "w_in": put(params["w_in"], spec["w"]),
            "w_out": put(params["w_out"], spec["w"])}
  dispatched = NamedSharding(mesh, spec["dispatched"]) if spec["dispatched"] is not None else None
  return (placed, put(x, spec["x"])), dispatched


def measure(program, layout, dtype, sizes, repeats):
  params, x = make(*sizes, dtype)
  args, dispatched = place(params, x, layout)
  step = jax.jit(jax.grad(lambda p, x: loss(p, x, program, dispatched)))
  single_args, _ = place(params, x, "single")
  single_step = jax.jit(jax.grad(lambda p, x: loss(p, x, program)))
  out = {}
  for name in ("none", "pass", "pass_nearest"):
    if name == "none":
      xla_fp4.disable()
    else:
      xla_fp4.enable(strict=True, keep_head=False, keep_first=0, keep_last=0,
                     **({"stochastic_rounding": False} if name == "pass_nearest" else {}))
    compiled = step.lower(*args).compile()
    out[name] = {"compiled": compiled, "cost": cost(compiled),
                 "temp": compiled.memory_analysis().temp_size_in_bytes}
    if name != "pass":
      out[name]["rel"] = difference(compiled(*args), single_step(*single_args))[1]
  xla_fp4.disable()
  t = time_steps([out["none"]["compiled"], out["pass"]["compiled"]], [args, args], repeats)
  none, new = out["none"]["cost"], out["pass"]["cost"]
  return {
      "program": program, "layout": layout, "dtype": jnp.dtype(dtype).name,
      "dot_flops": {"none": none.dot_flops, "pass": new.dot_flops, "ratio": new.dot_flops / none.dot_flops},
      "collective_bytes": {"none": none.collective_bytes, "pass": new.collective_bytes,
                           "ratio_excluding_scalar": new.large_collective_bytes / max(none.large_collective_bytes, 1),
                           "scalar_pass": new.scalar_collective_bytes,
                           "collectives_none": none.collectives, "collectives_pass": new.collectives},
      "temp_bytes_per_device": {"none": out["none"]["temp"], "pass": out["pass"]["temp"],
                                "ratio": out["pass"]["temp"] / max(out["none"]["temp"], 1)},
      "step_s": {"none": t[0], "pass": t[1], "ratio": t[1] / t[0]},
      "rel_l2_sharded_minus_single": {"none": out["none"]["rel"], "pass_nearest": out["pass_nearest"]["rel"]},
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="tiny sizes (the test suite's run)")
  ap.add_argument("--programs", default=",".join(PROGRAMS))
  ap.add_argument("--layouts", default=",".join(LAYOUTS))
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  # (layers, experts, d_model, d_ff, tokens)
  sizes = (2, 8, 64, 128, 256) if args.small else (2, 8, 256, 512, 2048)
  repeats = args.repeats or (2 if args.small else 10)
  rows = [measure(program, layout, jnp.dtype(dt), sizes, repeats) for dt in args.dtypes.split(",")
          for program in args.programs.split(",") for layout in args.layouts.split(",")]
  result = {"benchmark": "experts", "devices": 8,
            "sizes": dict(zip(("layers", "experts", "d_model", "d_ff", "tokens"), sizes)),
            "jax": jax.__version__, "machine": platform.machine(), "cpus": os.cpu_count(), "rows": rows}
  for r in rows:
    print(f"{r['program']:7s} {r['layout']:16s} {r['dtype']:9s} dot flops x{r['dot_flops']['ratio']:.3f}  collective "
          f"bytes x{r['collective_bytes']['ratio_excluding_scalar']:.3f} "
          f"(+{r['collective_bytes']['scalar_pass']} B scalar)  temp memory x{r['temp_bytes_per_device']['ratio']:.2f}"
          f"  step x{r['step_s']['ratio']:.2f}  rel |sharded-single| none "
          f"{r['rel_l2_sharded_minus_single']['none']:.1e} pass {r['rel_l2_sharded_minus_single']['pass_nearest']:.1e}",
          file=sys.stderr)
  write_result(result, args.out)
  return result


if __name__ == "__main__":
  main()
