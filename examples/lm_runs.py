"""Run examples/train_lm.py in a subprocess per precision mode and summarise the runs.

Shared by examples/demo.py (baseline vs NVFP4) and benchmarks/convergence.py (the ablation study).
Each run is a separate process so that the ``XLA_FP4*`` environment, which the xla-fp4 plugin reads
once at start-up, is exactly what the run says: every inherited ``XLA_FP4*`` variable is removed
first and the run's own are set on top.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

TRAIN_LM = Path(__file__).resolve().parent / "train_lm.py"


def flags(**kw) -> list[str]:
    """train_lm.py command-line flags from keyword arguments: d_model=128 -> --d-model 128."""
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v not in (False, None):
            out += [flag, str(v)]
    return out


def user_fp4_knobs() -> dict[str, str]:
    """The caller's XLA_FP4_* settings (not XLA_FP4 itself nor the dump dir), to pass on to an NVFP4 run."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("XLA_FP4_") and k != "XLA_FP4_DUMP_DIR"}


def run_train(name: str, train_flags: list[str], out_json: Path, fp4_env: dict[str, str] | None = None,
              dump_dir: Path | None = None, progress: bool = True) -> dict:
    """Run train_lm.py once and return its JSON result.

    fp4_env None: a high-precision baseline (no XLA_FP4* variable set). Otherwise XLA_FP4=1 plus
    these variables; with dump_dir, the pass writes its decisions there (the folder is emptied
    first so that stale decision files cannot be mistaken for this run's).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
    run_env: dict[str, str] = {}
    if fp4_env is not None:
        run_env = {"XLA_FP4": "1", **fp4_env}
        if dump_dir is not None:
            shutil.rmtree(dump_dir, ignore_errors=True)
            dump_dir.mkdir(parents=True)
            run_env["XLA_FP4_DUMP_DIR"] = str(dump_dir)
    env.update(run_env)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(TRAIN_LM), *train_flags, "--name", name, "--out", str(out_json)]
    if not progress:
        cmd.append("--no-progress")
    shown = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(run_env.items())),
                      "python", *map(shlex.quote, [os.path.relpath(c) if c.endswith(".py") else c
                                                   for c in cmd[1:]])])
    print(f"\n[{name}] $ {shown}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name!r} failed with exit status {proc.returncode}: {shown}")
    return json.loads(out_json.read_text())


def nvfp4_flop_share(dump_dir: Path | None) -> tuple[float | None, str]:
    """(share of the training step's GEMM FLOPs that ran in NVFP4, note) from the pass's decision dump.

    The share is None, with the reason in the note, when it cannot be known: xla_fp4 is not
    importable or the run dumped no decisions (the pass did not run).
    """
    if dump_dir is None:
        return None, "no dump dir"
    try:
        from xla_fp4 import report
    except ImportError as e:
        return None, f"xla_fp4 is not importable ({e})"
    try:
        modules = {row["module"] for row in report.load_decisions(str(dump_dir))}
    except FileNotFoundError:
        return None, f"no decision files in {dump_dir}: the NVFP4 pass did not run (is xla-fp4 installed?)"
    train_modules = sorted(m for m in modules if "train_step" in m)
    if not train_modules:
        return None, (f"no decisions for the training step in {dump_dir} (only {sorted(modules)}): "
                      "did the pass fail on it? See the run's warnings")
    return report.nvfp4_flop_share(str(dump_dir), module_filter="train_step"), ", ".join(train_modules)


def summarize(runs: dict[str, dict], shares: dict[str, float | None], baseline: str = "baseline") -> list[dict]:
    """One row per run: final losses, the relative gap to the baseline and the step-time ratio."""
    base = runs.get(baseline)
    rows = []
    for name, r in runs.items():
        row = {"run": name, "final_train_loss": r["final_train_loss"], "final_val_loss": r["final_val_loss"],
               "val_gap_pct": None, "train_gap_pct": None, "step_time_s": r["mean_step_time_s"],
               "step_time_ratio": None, "first_step_s": r["first_step_time_s"],
               "nvfp4_flop_share": shares.get(name), "completed_steps": r["completed_steps"],
               "steps": r["config"]["steps"]}
        if base is not None:
            row["val_gap_pct"] = 100 * (r["final_val_loss"] / base["final_val_loss"] - 1)
            row["train_gap_pct"] = 100 * (r["final_train_loss"] / base["final_train_loss"] - 1)
            row["step_time_ratio"] = r["mean_step_time_s"] / base["mean_step_time_s"]
        rows.append(row)
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """The summary rows as an aligned text table, or as a markdown table."""
    def num(v, fmt):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    def pct(v):
        return "n/a" if num(v, "+.2f") == "n/a" else num(v, "+.2f") + "%"

    header = ["run", "train loss", "val loss", "val gap vs baseline", "step time", "step time ratio",
              "first step (compile)", "NVFP4 share of GEMM FLOPs"]
    body = []
    for r in rows:
        steps = "" if r["completed_steps"] == r["steps"] else f" (diverged at step {r['completed_steps']})"
        body.append([r["run"] + steps, num(r["final_train_loss"], ".4f"), num(r["final_val_loss"], ".4f"),
                     "-" if r["run"] == "baseline" else pct(r["val_gap_pct"]),
                     num(1e3 * r["step_time_s"], ".0f") + " ms", num(r["step_time_ratio"], ".2f") + "x",
                     num(r["first_step_s"], ".1f") + " s",
                     "n/a" if r["nvfp4_flop_share"] is None else f"{100 * r['nvfp4_flop_share']:.1f}%"])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]) + "\n"


def _smooth(values: list[float], window: int) -> np.ndarray:
    """Trailing moving average (shorter windows at the start), so curve i is the mean of steps i-window+1..i."""
    v = np.asarray(values, dtype=np.float64)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_runs(runs: dict[str, dict], path: Path, title: str, zoom_fraction: float = 0.4) -> None:
    """Loss curves of several runs: smoothed train loss (solid) and validation loss (dashed, markers);
    the right panel zooms on the last `zoom_fraction` of the steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    zoom_lo, zoom_vals = None, []
    for i, (name, r) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        steps = np.arange(1, len(r["train_loss"]) + 1)
        window = max(1, r["config"]["steps"] // 40)
        train = _smooth(r["train_loss"], window)
        vsteps = [v["step"] for v in r["val_loss"]]
        vloss = [v["loss"] for v in r["val_loss"]]
        zoom_lo = int(r["config"]["steps"] * (1 - zoom_fraction))
        for ax in axes:
            ax.plot(steps, train, color=color, lw=1.2, alpha=0.8, label=f"{name} train (avg {window})")
            ax.plot(vsteps, vloss, color=color, lw=1.2, ls="--", marker="o", ms=3, label=f"{name} val")
        zoom_vals += [x for s, x in zip(steps, train) if s >= zoom_lo]
        zoom_vals += [x for s, x in zip(vsteps, vloss) if s >= zoom_lo]
    axes[0].set_title(title)
    axes[1].set_title(f"last {int(100 * zoom_fraction)}% of the steps")
    finite = [v for v in zoom_vals if math.isfinite(v)]
    if zoom_lo is not None and finite:
        lo, hi = min(finite), max(finite)
        pad = 0.05 * (hi - lo) + 1e-3
        axes[1].set_xlim(zoom_lo, max(len(r["train_loss"]) for r in runs.values()))
        axes[1].set_ylim(lo - pad, hi + pad)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
