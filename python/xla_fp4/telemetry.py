"""Telemetry on the host: what the pass's probes record (passes/rewrite/probes.py), as files a person reads.

With `XLA_FP4_TELEMETRY=DIR` every NVFP4 GEMM the pass rewrites gets probes; the compiled kernels' sinks
(xla_fp4/telemetry_sink.h, one per extension) collect their rows while the program runs. `flush()` (every second on
a daemon thread, and at exit) drains them and appends one JSON line per operand and recorded step to
DIR/telemetry.jsonl:

  {"step", "module", "dot", "layer", "role", "operand", "format", "block", "amax", "s_dec", "elements", "underflow",
   "all_zero", "scale_underflow", "scale_saturated", "snr_db", "output_zeros", "alerts"}

`dot` is the GEMM's index in the module's program order (the decision report's `#`); `format` its number format
(nvfp4, nvfp4+4/6 with Four Over Six, mxfp4, mxfp8: an MX row's s_dec is 1 and its blocks are 1x32, numerics/
telemetry.py); `operand` is activation,
weight or gradient; `block` the block (a scanned stack's iteration counts) or null;
`output_zeros` a wgrad's fraction of exact zeros in the weight gradient (null for fprop and dgrad); `snr_db` null for
an all-zero operand, "inf" for an exact one. Alerts (once per GEMM operand and kind, in a warning per drain and in
DIR/alerts.jsonl): `all_zero` (nonzero elements and none survives), `underflow` (above `telemetry_underflow`), `snr`
(below `telemetry_snr_db`). In a multi-process run process 0 writes; every process records the same statistics.
"""

import atexit
import dataclasses
import itertools
import json
import math
import os
import sys
import threading
import time

from xla_fp4 import notice
from xla_fp4 import state
from xla_fp4.numerics import telemetry as stats

FILE = "telemetry.jsonl"
ALERTS = "alerts.jsonl"
_FLUSH_SECONDS = 1.0
_SHOWN = 8  # alerts spelled out per warning


@dataclasses.dataclass(frozen=True)
class Site:
  """One probed GEMM: what its records are called, and where they go."""
  directory: str
  module: str
  layer: str
  role: str
  operands: tuple  # (lhs kind, rhs kind): activation, weight, gradient
  underflow: float  # alert thresholds
  snr_db: float
  format: str = "nvfp4"  # noqa: A003 (the dot's number format: nvfp4, nvfp4+4/6, mxfp4, mxfp8)


_module_keys = itertools.count(1)  # process-wide, like the sinks' step counters


def register_module(program):
  """The key of a module the pass probes (the probes' `module` attribute), which names its step counters in the sinks.
  `program`: what identifies the training step it compiles (its name, layout and probed GEMMs). A program compiled
  again gets its first compilation's key, so that its steps go on counting: jax compiles a step function again when
  the shardings of its inputs change (flax.nnx's nnx.jit step does after its first call, its outputs sharded other
  than its inputs), and each compilation counting from 0 would record two step 0s."""
  current = state.current()
  with current.lock:
    return current.telemetry.modules.setdefault(program, next(_module_keys))


def register_site(module_key, site_index, site, strict_label):
  """Name GEMM `site_index` of module `module_key` (a Site) and start the writer."""
  current = state.current()
  with current.lock:
    current.telemetry.sites[(module_key, site_index)] = site
  for ext in _extensions():
    ext.telemetry_label(module_key, site_index, strict_label)
  _start()


def _extensions():
  """The loaded extensions, whose sinks hold records (the CUDA one only once the CUDA kernels are loaded)."""
  names = ("xla_fp4._xla_fp4_ext", "xla_fp4._xla_fp4_cuda")
  return [sys.modules[n] for n in names if n in sys.modules and hasattr(sys.modules[n], "telemetry_drain")]


def _start():
  current = state.current()
  with current.lock:
    if current.telemetry.writer is not None:
      return
    def loop():
      while True:
        time.sleep(_FLUSH_SECONDS)
        flush()

    current.telemetry.writer = threading.Thread(target=loop, name="xla_fp4 telemetry", daemon=True)
    current.telemetry.writer.start()
    atexit.register(flush)


def _process_index():
  import jax
  try:
    return jax.process_index()
  except Exception:  # noqa: BLE001 - no backend yet: a single process
    return 0


def records(raw, sites):
  """The JSON records of raw sink rows [(module, site, block, step, device, values)] of known `sites`."""
  out = []
  width = len(stats.FIELDS)
  for module, site_index, block, step, _device, values in raw:
    site = sites.get((module, site_index))
    if site is None:
      continue
    rows = [values[i * width:(i + 1) * width] for i in range(len(values) // width)]
    zeros = rows[2][0] / rows[2][1] if site.role == "wgrad" and rows[2][1] else None
    for kind, row in zip(site.operands, rows):
      summary = stats.summary(row)
      record = dict(step=step, module=site.module, dot=site_index, layer=site.layer, role=site.role, operand=kind,
                    format=site.format,
                    block=block if block >= 0 else None, **summary, output_zeros=zeros)
      record["alerts"] = _alerts(record, site)
      out.append((site, record))
  return out


def _alerts(record, site):
  alerts = []
  if record["all_zero"]:
    alerts.append("all_zero")
  if record["underflow"] > site.underflow:
    alerts.append("underflow")
  if record["snr_db"] is not None and record["snr_db"] < site.snr_db:
    alerts.append("snr")
  return alerts


def _describe(record):
  block = "" if record["block"] is None else f" block {record['block']}"
  what = {"all_zero": lambda: "quantized to all zeros",
          "underflow": lambda: f"{record['underflow']:.1%} of its nonzero elements quantize to zero",
          "snr": lambda: f"quantization SNR {record['snr_db']:.1f} dB"}
  return [f"{record['module']}: {record['layer'] or '?'} {record['role']} {record['operand']}{block}: {what[a]()} "
          f"at step {record['step']}" for a in record["alerts"]]


def jsonable(record):
  """The record as JSON takes it: an exact quantization's SNR (inf) as "inf"; `load` reads it back."""
  return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in record.items()}


def flush():
  """Drain the sinks, append their records to each GEMM's DIR/telemetry.jsonl and warn on alerts (once per GEMM
  operand and kind)."""
  current = state.current()
  with current.telemetry.lock:
    raw = [r for ext in _extensions() for r in ext.telemetry_drain()]
    if not raw:
      return
    with current.lock:
      sites = dict(current.telemetry.sites)
    writes, alerts, new = {}, {}, []
    for site, record in records(raw, sites):
      writes.setdefault(site.directory, []).append(json.dumps(jsonable(record)))
      for alert, message in zip(record["alerts"], _describe(record)):
        key = (site.module, record["layer"], record["role"], record["operand"], record["block"], alert)
        if current.first_time(("telemetry",) + key):
          new.append(message)
          alerts.setdefault(site.directory, []).append(json.dumps(dict(alert=alert, message=message,
                                                                       step=record["step"])))
    if new:  # one warning per drain, so that a large model's first alerts do not flood the log
      shown = "\n  ".join(new[:_SHOWN])
      more = f"\n  ... and {len(new) - _SHOWN} more" if len(new) > _SHOWN else ""
      where = ", ".join(sorted(os.path.join(d, ALERTS) for d in alerts))
      notice.warn(f"xla_fp4: {len(new)} new telemetry alert(s) (each GEMM operand and kind once; all in {where}):\n  "
                  f"{shown}{more}")
    if _process_index() != 0:
      return
    for files, name in ((writes, FILE), (alerts, ALERTS)):
      for directory, lines in files.items():
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name), "a") as f:
          f.write("\n".join(lines) + "\n")


# -- reading: `python -m xla_fp4 telemetry DIR` ----------------------------------------------------------------------

ROLES = ("fprop", "dgrad", "wgrad")


def load(directory):
  """Every record of DIR/telemetry.jsonl, in the order written ("inf" SNRs as float inf)."""
  path = os.path.join(directory, FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: run the program with XLA_FP4=1 XLA_FP4_TELEMETRY={directory}")
  out = []
  with open(path) as f:
    for line in f:
      if line.strip():
        record = json.loads(line)
        if record.get("snr_db") == "inf":
          record["snr_db"] = math.inf
        out.append(record)
  return out


def _layer(record):
  block = "" if record["block"] is None else f"[{record['block']}]"
  return f"{record['module']}:{record['layer'] or '?'}{block}"


def _label(record):
  """A heatmap row: the layer, its block, the operand (the panel names the role, the title the module)."""
  block = "" if record["block"] is None else f"[{record['block']}]"
  return f"{record['layer'] or '?'}{block} {record['operand']}"


def _gemm(record):
  return f"{_layer(record)} {record['role']} {record['operand']}"


def worst(records, n=10):
  """The GEMM operands with the most underflow and with the lowest SNR: two lists of (name, worst value, step of the
  worst, first step with an alert or None, steps recorded)."""
  by_gemm = {}
  for r in records:
    by_gemm.setdefault(_gemm(r), []).append(r)

  def rank(key, pick):
    rows = []
    for name, rs in by_gemm.items():
      valued = [r for r in rs if r[key] is not None]
      if not valued:
        continue
      w = pick(valued, key=lambda r: r[key])
      alerted = [r["step"] for r in rs if r["alerts"]]
      rows.append((name, w[key], w["step"], min(alerted) if alerted else None, len(rs)))
    return sorted(rows, key=lambda row: row[1], reverse=pick is max)[:n]

  return rank("underflow", max), rank("snr_db", min)


def print_worst(records, n=10, file=None):
  file = file or sys.stdout
  by_underflow, by_snr = worst(records, n)
  steps = sorted({r["step"] for r in records})
  print(f"{len(records)} records, steps {steps[0]}..{steps[-1]}" if steps else "no records", file=file)
  for title, rows, fmt in (("most underflow (nonzero elements that quantize to zero)", by_underflow, "{:.2%}"),
                           ("lowest quantization SNR (dB)", by_snr, "{:.1f}")):
    print(f"\n{title}:", file=file)
    width = max([len(r[0]) for r in rows] + [4])
    print(f"  {'GEMM operand':<{width}}  {'worst':>8}  {'at step':>7}  {'alerts since':>12}  {'steps':>5}", file=file)
    for name, value, step, since, count in rows:
      print(f"  {name:<{width}}  {fmt.format(value):>8}  {step:>7}  {'-' if since is None else since:>12}  "
            f"{count:>5}", file=file)


def network_order(records):
  """{(layer, block): rank} in the order the network runs its layers: by block (a scanned stack's iteration, a
  decoder layer), then by the program order of the layer's forward GEMM; layers outside blocks (embeddings, the
  head) before or after the blocks, where their forward GEMM is."""
  first = {}
  for r in sorted(records, key=lambda r: (r["role"] != "fprop", r.get("dot", 0))):
    first.setdefault(r["layer"], r.get("dot", 0))
  blocked = [first[r["layer"]] for r in records if r["block"] is not None]
  lo, hi = (min(blocked), max(blocked)) if blocked else (0, 0)

  def key(layer, block):
    if block is None:
      return (-1 if first[layer] < lo else math.inf, first[layer])
    return (block, first[layer])
  keys = sorted({(r["layer"], r["block"]) for r in records}, key=lambda lb: key(*lb))
  return {lb: i for i, lb in enumerate(keys)}


# The heatmaps' fixed color scales, so that two runs' plots compare: underflow 0-25% (the default alert is at 10%),
# SNR 0-25 dB (NVFP4's round-to-nearest on Gaussian data reads about 17-20 dB; the default alert is below 5).
_SCALES = {"underflow": (0.0, 0.25), "snr_db": (0.0, 25.0)}


def plot(records, directory):
  """Heatmaps of GEMM operand x step, one panel per role, rows in network order (`network_order`), on fixed color
  scales (`_SCALES`): DIR/telemetry_underflow.png and DIR/telemetry_snr.png. Returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  steps = sorted({r["step"] for r in records})
  column = {s: i for i, s in enumerate(steps)}
  order = network_order(records)
  modules = ", ".join(sorted({r["module"] for r in records}))
  paths = []
  for key, title, cmap, name in (("underflow", "underflow: fraction of nonzero elements that quantize to 0", "magma_r",
                                  "telemetry_underflow.png"),
                                 ("snr_db", "quantization SNR (dB; higher is better)", "viridis",
                                  "telemetry_snr.png")):
    roles = [role for role in ROLES if any(r["role"] == role for r in records)] or ["fprop"]
    vmin, vmax = _SCALES[key]
    rows_per_panel = max(len({(r["layer"], r["block"], r["operand"]) for r in records if r["role"] == role})
                         for role in roles)
    width = max(len(_label(r)) for r in records) if records else 10
    fig, axes = plt.subplots(1, len(roles), figsize=(len(roles) * (3.5 + 0.06 * width), 1.5 + 0.18 * rows_per_panel),
                             squeeze=False, layout="constrained")
    for ax, role in zip(axes[0], roles):
      mine = [r for r in records if r["role"] == role]
      names = sorted({(r["layer"], r["block"], r["operand"]) for r in mine},
                     key=lambda n: (order[n[:2]], n[2]))
      row = {n: i for i, n in enumerate(names)}
      grid = np.full((len(names), len(steps)), np.nan)
      for r in mine:
        if r[key] is not None:
          grid[row[(r["layer"], r["block"], r["operand"])], column[r["step"]]] = min(r[key], 99.0)
      image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax,
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(names) - 0.5, -0.5) if steps else None)
      ax.set_yticks(range(len(names)), [_label(dict(layer=n[0], block=n[1], operand=n[2])) for n in names],
                    fontsize=6)
      ax.set_xlabel("step")
      ax.set_title(role, fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.9, extend="max")
    fig.suptitle(f"{title}\n{modules}", fontsize=9)
    path = os.path.join(directory, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths
