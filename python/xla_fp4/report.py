"""Decision rows and tables: what the pass decided for each dot, and why.

A row is a dict: index, layer, role, phase, block, lhs_shape, rhs_shape, dtype, flops, decision (keep, or the format it
is quantized in: nvfp4, mxfp4, mxfp8), rule, reason, recipe,
groups (an expert GEMM's analysis.Grouping: one decode scale per expert or group of tokens; else None), keep_blocks,
num_stacked, block_offset, block_stride (`flops` count every iteration of a scanned stack; `keep_blocks` of its
`num_stacked` iterations run the high-precision dot; iteration i is block block_offset + i * block_stride). Dump directories hold `{n:04d}_{module}.decisions.json` (the backend: which kernels and
which GEMM run and why; rows; unmatched rules) and a `.decisions.txt` table.
"""

import glob
import json
import os


def rows(sites, decisions, notes=None):
  notes = notes or {}
  out = []
  for s, d in zip(sites, decisions):
    reason = d.reason + (f"; {notes[s.index]}" if s.index in notes else "")
    block = s.block if s.block is not None else ("scan" if s.num_stacked else None)
    out.append(dict(index=s.index, layer=s.layer, role=s.role, phase=s.phase, block=block,
                    lhs_shape=list(s.gemm.lhs_shape), rhs_shape=list(s.gemm.rhs_shape), dtype=s.gemm.dtype,
                    flops=s.gemm.flops,
                    decision=d.decision, rule=d.rule, reason=reason,
                    recipe=None if d.lhs is None else {"lhs": _recipe(d.lhs), "rhs": _recipe(d.rhs)},
                    groups=s.groups.kind if s.groups is not None else None,
                    keep_blocks=list(d.keep_blocks), num_stacked=s.num_stacked, block_offset=s.block_offset,
                    block_stride=s.block_stride))
  return out


def _recipe(r):
  parts = ["2d" if r.block_2d else "1d", "sr" if r.stochastic else "rn"] + (["rht"] if r.rht else []) + (
      ["4/6"] if r.four_over_six else [])
  return "+".join(parts)


def _shape(s):
  return "x".join(map(str, s))


def table(rows, unmatched_rules=(), title="", backend=None, blocks=()):
  header = ("#", "layer", "role", "block", "lhs", "rhs", "decision", "recipe (lhs | rhs)", "reason")
  body = []
  for r in rows:
    recipe = f"{r['recipe']['lhs']} | {r['recipe']['rhs']}" if r.get("recipe") else ""
    if recipe and r.get("groups"):
      recipe += " per group"
    body.append((str(r["index"]), r["layer"] or "-", r["role"], "" if r["block"] is None else str(r["block"]),
                 _shape(r["lhs_shape"]), _shape(r["rhs_shape"]), r["decision"], recipe, r["reason"]))
  widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  lines = [f"== {title}" if title else "", fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
  lines.append(summary(rows))
  if backend:
    lines.append(f"kernels: {backend['kernels']}; GEMM: {backend['gemm']} ({backend['gemm_reason']})")
  if unmatched_rules:
    lines.append(f"rules that matched nothing: {', '.join(unmatched_rules)}")
  lines += [f"blocks: {b}" for b in blocks]
  return "\n".join(l for l in lines if l is not None) + "\n"


def load(dump_dir):
  """[(module name, payload dict)] for every decisions file in `dump_dir`, in dump order."""
  files = sorted(glob.glob(os.path.join(dump_dir, "*.decisions.json")))
  if not files:
    raise FileNotFoundError(f"no *.decisions.json in {dump_dir!r}; run with XLA_FP4_DUMP_DIR={dump_dir} first")
  out = []
  for f in files:
    with open(f) as fh:
      out.append((os.path.basename(f)[:-len(".decisions.json")], json.load(fh)))
  return out


def load_decisions(dump_dir):
  """All decision rows of a dump dir, each with its "module"."""
  return [dict(row, module=name) for name, payload in load(dump_dir) for row in payload["decisions"]]


def quantized_flops(row):
  """The dot FLOPs a row runs quantized (in any format): a scanned dot's kept layers run the high-precision dot."""
  if row["decision"] == "keep":
    return 0
  return row["flops"] * (1 - len(row.get("keep_blocks") or ()) / (row.get("num_stacked") or 1))


def flop_share(rows):
  """Share of the rows' dot FLOPs that run quantized (0 without FLOPs)."""
  total = sum(r["flops"] for r in rows)
  return sum(map(quantized_flops, rows)) / total if total else 0.0


def formats_named(rows):
  """The formats the rows quantize in, as text: "NVFP4", or e.g. "NVFP4/MXFP8"."""
  names = sorted({r["decision"] for r in rows if r["decision"] != "keep"}, key=lambda f: (f != "nvfp4", f))
  return "/".join(n.upper() for n in names) or "NVFP4"


def summary(rows):
  """The table's last line: how many dots are quantized, in which formats, and their share of the dot FLOPs."""
  counts = {}
  for r in rows:
    if r["decision"] != "keep":
      counts[r["decision"]] = counts.get(r["decision"], 0) + 1
  share = f"{100 * flop_share(rows):.1f}% of dot FLOPs"
  if set(counts) <= {"nvfp4"}:
    return f"{counts.get('nvfp4', 0)}/{len(rows)} dots in NVFP4, {share}"
  each = ", ".join(f"{n} {f}" for f, n in sorted(counts.items()))
  return f"{sum(counts.values())}/{len(rows)} dots quantized ({each}), {share}"


def nvfp4_flop_share(dump_dir, module_filter=None):
  """Share of dot FLOPs that run in NVFP4 over the dumped modules (optionally only those whose name contains
  `module_filter`)."""
  return flop_share([r for r in load_decisions(dump_dir) if module_filter is None or module_filter in r["module"]])


def print_report(dump_dir):
  for name, payload in load(dump_dir):
    print(table(payload["decisions"], payload.get("unmatched_rules", ()), title=name, backend=payload.get("backend"),
                blocks=payload.get("blocks", ())))
