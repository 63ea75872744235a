"""The cost of telemetry, side by side in one run: the step time of a train step under the pass without telemetry,
with telemetry every step and every 10 steps (XLA_FP4_TELEMETRY_EVERY), on CPU.

  python benchmarks/telemetry.py [--small] [--out benchmarks/results/telemetry.json]

The program is a residual MLP train step (`x = x + gelu(x @ w1) @ w2` per layer, `jax.jit(jax.grad(loss))`, the
default recipe), on one device, and under FSDP (weights and tokens sharded over every device) on 8 host devices and on
as many as the machine has cores (`fsdp_cores`), where each device measures its shard in the quantizer's pass and
records its own rows, which the sink adds (docs/design.md §7).

Each row (layout, dtype) runs in a process of its own, as a training run does. In it each mode with telemetry is
measured against the mode without, one at a time (so that the writer thread drains only that mode's records), in
rounds of 10 steps in which the two alternate step by step: a machine that other work slows down for a while (this
project's machines are shared) slows both alike. A round's ratio is the mode's time over the time without telemetry,
where the mode's time includes draining what the writer thread has left of the round's records (telemetry.flush);
the ratio reported is the median over rounds. A round of every-10 holds exactly one recorded step. The control is the
step without telemetry compiled again and measured the same way against itself: how far two identical programs read
apart on this machine, the method's noise. (In one process for all rows, a mode measured after another row's
every-step phase read slower: FSDP float32 every 10 steps 1.11x, against 0.98x alone, on the same code.)
Target (issue 23): every 10 steps within 3% of the step without telemetry.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xla_fp4  # noqa: E402
from sharding import write_result  # noqa: E402
from xla_fp4 import telemetry  # noqa: E402

# (mode, telemetry every N steps): every 10 is measured before every step; "control": without, compiled again (the
# method's noise)
MODES = (("off", None), ("control", None), ("every_10", 10), ("every_1", 1))
# FSDP layouts: how many host devices. "fsdp_cores": as many as the machine's cores (benchmarks/sharding.py's "cores"
# step times), as on a pod where every device has its own compute; over 8 host devices on 2 cores, 4 device threads
# take turns on each core.
FSDP_DEVICES = {"fsdp": 8, "fsdp_cores": 2}


def train_step(layers, d_model, d_ff, tokens, dtype):
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)
  params = [(jax.random.normal(keys[2 * i], (d_model, d_ff), dtype) * d_model ** -0.5,
             jax.random.normal(keys[2 * i + 1], (d_ff, d_model), dtype) * d_ff ** -0.5) for i in range(layers)]
  x = jax.random.normal(keys[-1], (tokens, d_model), dtype)

  def loss(params, x):
    for w1, w2 in params:
      x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x.astype(jnp.float32) ** 2)

  return jax.grad(loss), (params, x)


def measure(layout, dtype, sizes, steps, rounds):
  fn, args = train_step(*sizes, dtype)
  if layout in FSDP_DEVICES:
    from jax.sharding import NamedSharding, PartitionSpec as P
    n = FSDP_DEVICES[layout]
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    args = jax.device_put(args, NamedSharding(mesh, P("d")))
  compiled, dirs = {}, {}
  for mode, every in MODES:
    dirs[mode] = tempfile.mkdtemp(prefix=f"xla_fp4_telemetry_{mode}_") if every else ""
    xla_fp4.enable(telemetry=dirs[mode], telemetry_every=every or 1)
    compiled[mode] = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled[mode](*args))  # warm-up
  times = {mode: [] for mode, _ in MODES}  # per round, the mean step time
  ratios = {mode: [] for mode, _ in MODES if mode != "off"}
  for mode in ratios:  # one mode with telemetry at a time, so that the writer drains that mode's records only
    for _ in range(rounds):
      spent = {"off": 0.0, mode: 0.0}
      for i in range(steps):  # the two alternate step by step: a machine slowed by other work slows both alike
        for m in (("off", mode) if i % 2 == 0 else (mode, "off")):  # and each goes first as often
          start = time.perf_counter()
          jax.block_until_ready(compiled[m](*args))
          spent[m] += time.perf_counter() - start
      start = time.perf_counter()
      telemetry.flush()  # what the writer thread has left of the round's records, in the mode's time
      spent[mode] += time.perf_counter() - start
      ratios[mode].append(spent[mode] / spent["off"])
      for m, t in spent.items():
        times[m].append(t / steps)
  telemetry.flush()
  records = {mode: len(telemetry.load(d)) if d else 0 for mode, d in dirs.items()}
  for d in dirs.values():
    if d:
      shutil.rmtree(d)
  median = {mode: statistics.median(t) for mode, t in times.items()}
  return {"layout": layout, "dtype": jnp.dtype(dtype).name,
          "step_s": median,
          "ratio": {mode: statistics.median(r) for mode, r in ratios.items()},
          "ratio_per_round": {mode: [round(v, 4) for v in r] for mode, r in ratios.items()},
          "records": records}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true", help="tiny sizes (the test suite's run)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # LAYOUT,DTYPE: one row, in this process
  args = ap.parse_args(argv)
  # (layers, d_model, d_ff, tokens)
  sizes = (2, 64, 128, 64) if args.small else (4, 256, 1024, 1024)
  steps, rounds = (10, 2) if args.small else (10, 15)
  if args.row:
    layout, dtype = args.row.split(",")
    write_result(measure(layout, jnp.dtype(dtype), sizes, steps, rounds), args.out)
    return
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for layout in ("one_device", *FSDP_DEVICES):
      for dtype in ("float32", "bfloat16"):  # each row in a process of its own (the docstring)
        out = os.path.join(tmp, f"{layout}_{dtype}.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--row", f"{layout},{dtype}", "--out", out]
                       + (["--small"] if args.small else []), check=True)
        with open(out) as f:
          rows.append(json.load(f))
  write_result({"benchmark": "telemetry", "sizes": dict(zip(("layers", "d_model", "d_ff", "tokens"), sizes)),
                "steps_per_round": steps, "rounds": rounds, "jax": jax.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "rows": rows}, args.out)


if __name__ == "__main__":
  main()
