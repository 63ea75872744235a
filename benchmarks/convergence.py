"""Convergence study: NVFP4 training of examples/train_lm.py against a high-precision baseline, with
the ablations of the NVFP4 recipe (arXiv 2509.25149).

    python benchmarks/convergence.py            # all 7 runs, sequentially (~1 hour on 2 CPU cores)
    python benchmarks/convergence.py --quick    # smoke test: tiny model, a few steps, out/convergence-quick/
    python benchmarks/convergence.py --only baseline,nvfp4 --resume

Every run uses the same flags, seed and data; only the XLA_FP4* environment differs (see RUNS).
Writes benchmarks/results/convergence.json (per-step train loss, validation curves, summary rows),
benchmarks/results/convergence.png (loss curves, with a zoom on the final steps) and the results
table in docs/convergence.md (between the results markers; the rest of that file is kept).
The pass's decision dumps go to out/convergence/dumps/<run>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import lm_runs  # noqa: E402

# name -> (XLA_FP4* environment, or None for the high-precision baseline; description)
RUNS: dict[str, tuple[dict[str, str] | None, str]] = {
    "baseline": (None, "high precision (FP32), no XLA_FP4"),
    "nvfp4": ({}, "full recipe: XLA_FP4=1 with the defaults"),
    "no_rht": ({"XLA_FP4_RHT": "0"}, "no random Hadamard transform on wgrad"),
    "no_sr": ({"XLA_FP4_STOCHASTIC_ROUNDING": "0"}, "round-to-nearest gradients"),
    "no_2d": ({"XLA_FP4_2D_WEIGHTS": "0"}, "1x16 weight blocks instead of 16x16"),
    "no_hp_layers": ({"XLA_FP4_KEEP_FIRST": "0", "XLA_FP4_KEEP_LAST": "0"},
                     "no blocks kept in high precision (the head still is)"),
    "naive": ({"XLA_FP4_RHT": "0", "XLA_FP4_STOCHASTIC_ROUNDING": "0", "XLA_FP4_2D_WEIGHTS": "0",
               "XLA_FP4_KEEP_FIRST": "0", "XLA_FP4_KEEP_LAST": "0", "XLA_FP4_KEEP_HEAD": "0"},
              "all of the above off, head in NVFP4 too"),
}

# Sized so that the 7 runs take about an hour on 2 CPU cores (measured baseline: see docs/convergence.md).
FULL_FLAGS = dict(steps=800, batch=16, seq=128, d_model=128, layers=4, heads=4, lr=3e-3, seed=0,
                  eval_every=50)
QUICK_FLAGS = dict(steps=12, batch=8, seq=32, d_model=32, layers=2, heads=2, lr=1e-2, seed=0,
                   eval_every=6, eval_batches=2)

BEGIN, END = "<!-- convergence:results:begin -->", "<!-- convergence:results:end -->"

DOC_TEMPLATE = f"""# Convergence: NVFP4 vs high precision

`benchmarks/convergence.py` trains `examples/train_lm.py` (a byte-level GPT on Shakespeare's complete
works) once in high precision and then with `XLA_FP4=1` under the full NVFP4 recipe and its ablations.
All runs share flags, seed and data; only the `XLA_FP4*` environment differs. Regenerate with
`python benchmarks/convergence.py` (the table below is rewritten; the rest of this file is kept).

{BEGIN}
_No results yet: run `python benchmarks/convergence.py`._
{END}

## Analysis

_To be written: what the gaps say about each part of the recipe at this scale, and what they do not._
"""


def env_line(env: dict[str, str] | None) -> str:
    if env is None:
        return "(none)"
    return " ".join(f"{k}={v}" for k, v in {"XLA_FP4": "1", **env}.items())


def results_markdown(rows: list[dict], train_flags: list[str], meta: dict) -> str:
    lines = [f"Flags: `python examples/train_lm.py {' '.join(train_flags)}`  ",
             f"Machine: {meta['machine']}; jax {meta['jax_version']}; {meta['date']}; "
             f"total {meta['wall_time_s'] / 60:.0f} min.", "",
             lm_runs.format_table(rows, markdown=True),
             "Train loss: mean of the last steps' training loss (see `final_train_loss_window` in the JSON); "
             "val loss: the held-out last 10% of the corpus, at the final step. The gap is relative to the "
             "baseline's; step time excludes the first (compiling) steps; the FLOP share counts the training "
             "step's dot FLOPs that the pass rewrote to NVFP4.", "",
             "| run | XLA_FP4 environment | what it tests |", "|---|---|---|"]
    lines += [f"| {name} | `{env_line(env)}` | {desc} |" for name, (env, desc) in RUNS.items()]
    lines += ["", "![validation and training loss](../benchmarks/results/convergence.png)"]
    return "\n".join(lines)


def write_doc(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else DOC_TEMPLATE
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has lost its {BEGIN} / {END} markers: put them back around the results table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke test; writes to out/convergence-quick/ only")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {','.join(RUNS)}")
    p.add_argument("--resume", action="store_true",
                   help="reuse a run's JSON from an earlier invocation when its flags match")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args, extra = p.parse_known_args(argv)
    names = list(RUNS) if args.only is None else args.only.split(",")
    if unknown := [n for n in names if n not in RUNS]:
        p.error(f"unknown run(s) {unknown}: choose from {list(RUNS)}")

    train_flags = lm_runs.flags(**(QUICK_FLAGS if args.quick else FULL_FLAGS)) + extra
    work = ROOT / "out" / ("convergence-quick" if args.quick else "convergence")
    results_dir = work if args.quick else ROOT / "benchmarks" / "results"

    t0 = time.perf_counter()
    runs, shares = {}, {}
    for name, (env, _) in RUNS.items():
        out_json, dump_dir = work / "runs" / f"{name}.json", work / "dumps" / name
        # Runs not selected with --only, and with --resume selected ones too, come from earlier
        # invocations when their flags match, so that the summary always covers every run there is.
        if (args.resume or name not in names) and out_json.exists():
            previous = json.loads(out_json.read_text())
            if previous["config"].get("train_flags") == train_flags:
                print(f"[{name}] reusing {out_json}")
                runs[name] = previous
        if name not in runs and name in names:
            runs[name] = lm_runs.run_train(name, train_flags, out_json, fp4_env=env,
                                           dump_dir=None if env is None else dump_dir,
                                           progress=not args.no_progress)
            runs[name]["config"]["train_flags"] = train_flags
            out_json.write_text(json.dumps(runs[name], indent=1))
        if name not in runs:
            continue
        shares[name], note = (0.0, "baseline") if env is None else lm_runs.nvfp4_flop_share(dump_dir)
        if shares[name] is None:
            print(f"[{name}] NVFP4 FLOP share n/a: {note}")
    wall = time.perf_counter() - t0

    import jax
    rows = lm_runs.summarize(runs, shares)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores ({platform.processor() or 'cpu'})",
            "jax_version": jax.__version__, "date": datetime.date.today().isoformat(), "wall_time_s": wall}
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "convergence.json").write_text(json.dumps(
        {"train_flags": train_flags, "meta": meta,
         "runs": {n: {"env": env_line(RUNS[n][0]), "description": RUNS[n][1], **runs[n]} for n in runs},
         "summary": rows}, indent=1))
    lm_runs.plot_runs(runs, results_dir / "convergence.png",
                      title=f"train_lm.py, {next(iter(runs.values()))['config']['steps']} steps: "
                            "NVFP4 recipe ablations")
    if not args.quick:
        write_doc(ROOT / "docs" / "convergence.md", results_markdown(rows, train_flags, meta))
    print()
    print(lm_runs.format_table(rows))
    print(f"{wall / 60:.1f} min; wrote {results_dir}/convergence.json, convergence.png"
          + ("" if args.quick else ", docs/convergence.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
