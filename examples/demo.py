"""The xla-fp4 demo: train the same unmodified script twice, in high precision and with XLA_FP4=1.

    python examples/demo.py                 # ~10 minutes on 2 CPU cores
    python examples/demo.py --steps 50      # flags after the demo's own go to train_lm.py

Runs examples/train_lm.py (which imports nothing from xla_fp4) as two subprocesses with identical
flags: a baseline with no XLA_FP4* variable set, then with XLA_FP4=1 and XLA_FP4_DUMP_DIR=<out>/dumps
(any XLA_FP4_* knobs in the caller's environment, e.g. XLA_FP4_RHT=0, are passed on to this run).
The NVFP4 run also records telemetry every 10 steps (XLA_FP4_TELEMETRY=<out>/telemetry,
XLA_FP4_TELEMETRY_EVERY=10, alerts above 40% underflow; the caller's settings win). Then prints a table
(final train/val loss, the relative validation gap, the step-time ratio and the share of the training
step's GEMM FLOPs that ran in NVFP4), the pass's decision report and the GEMMs that lose most to 4 bits,
and writes to <out> (default out/demo/): baseline.json, nvfp4.json, summary.json, summary.md,
decisions.txt, loss_curves.png and telemetry/ (telemetry.jsonl, telemetry_underflow.png,
telemetry_snr.png).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm_runs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Sized for ~10 minutes for both runs on 2 CPU cores (see the README).
DEMO_FLAGS = dict(steps=300, batch=16, seq=128, d_model=128, layers=4, heads=4, lr=3e-3, seed=0,
                  eval_every=50)


def decision_report(dump_dir: Path) -> tuple[str, str]:
    """(the training step's decision tables, the whole `python -m xla_fp4 report <dump_dir>`) as text,
    or why there are none."""
    try:
        from xla_fp4 import report
    except ImportError as e:
        return (f"(no decision report: xla_fp4 is not importable: {e})\n",) * 2
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            report.print_report(str(dump_dir))
        train = "".join(report.table(payload["decisions"], payload.get("unmatched_rules", ()), title=name)
                        for name, payload in report.load(str(dump_dir)) if "train_step" in name)
    except FileNotFoundError as e:
        return (f"(no decision report: {e})\n",) * 2
    return train or "(the pass dumped no decisions for the training step)\n", buf.getvalue()


def telemetry_report(directory: Path) -> str:
    """The worst GEMM operands of the NVFP4 run's telemetry, with its heatmaps written, or why there are none."""
    try:
        from xla_fp4 import telemetry
        records = telemetry.load(str(directory))
    except (ImportError, FileNotFoundError) as e:
        return f"(no telemetry: {e})"
    buf = io.StringIO()
    telemetry.print_worst(records, 5, file=buf)
    paths = telemetry.plot(records, str(directory)) if records else []
    return buf.getvalue() + "".join(f"wrote {p}\n" for p in paths)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Unrecognised flags are passed on to train_lm.py (both runs).")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "demo", help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args, extra = p.parse_known_args(argv)
    train_flags = lm_runs.flags(**DEMO_FLAGS) + extra
    out, dumps, tel = args.out, args.out / "dumps", args.out / "telemetry"
    shutil.rmtree(tel, ignore_errors=True)
    telemetry_env = {"XLA_FP4_TELEMETRY": str(tel), "XLA_FP4_TELEMETRY_EVERY": "10",
                     "XLA_FP4_TELEMETRY_UNDERFLOW": "0.4"}

    t0 = time.perf_counter()
    runs = {
        "baseline": lm_runs.run_train("baseline", train_flags, out / "baseline.json",
                                      progress=not args.no_progress),
        "nvfp4": lm_runs.run_train("nvfp4", train_flags, out / "nvfp4.json",
                                   fp4_env={**telemetry_env, **lm_runs.user_fp4_knobs()}, dump_dir=dumps,
                                   progress=not args.no_progress),
    }
    wall = time.perf_counter() - t0

    share, share_note = lm_runs.nvfp4_flop_share(dumps)
    rows = lm_runs.summarize(runs, {"baseline": 0.0, "nvfp4": share})
    train_report, full_report = decision_report(dumps)
    (out / "decisions.txt").write_text(full_report)
    lm_runs.plot_runs(runs, out / "loss_curves.png",
                      title=f"train_lm.py: baseline vs XLA_FP4=1 ({runs['baseline']['config']['steps']} steps)")
    (out / "summary.md").write_text(lm_runs.format_table(rows, markdown=True))
    (out / "summary.json").write_text(json.dumps({"rows": rows, "flop_share_source": share_note,
                                                  "train_flags": train_flags, "wall_time_s": wall}, indent=1))

    print(f"\n== NVFP4 decisions for the training step (all modules: python -m xla_fp4 report {dumps})\n")
    print(train_report)
    print(f"== baseline vs NVFP4 ({wall / 60:.1f} min for both runs)\n")
    print(lm_runs.format_table(rows))
    if share is None:
        print(f"NVFP4 FLOP share: n/a: {share_note}")
        print("WARNING: without the pass both runs are high precision; install xla-fp4 first "
              "(see the README).")
    else:
        print(f"NVFP4 FLOP share over: {share_note}")
    print(f"\n== what 4 bits did to each GEMM (python -m xla_fp4 telemetry {tel})\n")
    print(telemetry_report(tel))
    print(f"\nwrote {out}/: baseline.json nvfp4.json summary.md summary.json decisions.txt loss_curves.png "
          "telemetry/")
    print("One run per mode says little about convergence: the study with five seeds per arm and its intervals is "
          "docs/convergence.md (python benchmarks/convergence.py).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
