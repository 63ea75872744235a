"""Command line: `python -m xla_fp4 report DIR` prints the decision tables of a dump dir; `telemetry DIR` the GEMMs
that lose most to 4 bits (and writes heatmaps; `--json`: the records); `info` what was built and what the pass would
use on each platform; `options` the option table."""

import argparse
import json
import os
import sys

from xla_fp4 import config, report


TELEMETRY_COLUMNS = """columns of the tables (one row per GEMM operand: layer[block] role operand):
  worst         the highest underflow (fraction of its nonzero elements that quantize to zero) or the lowest
                quantization SNR in dB (signal over quantization error) over the recorded steps
  at step       the step of that worst value
  alerts since  the first step at which the operand crossed an alert threshold (XLA_FP4_TELEMETRY_UNDERFLOW,
                XLA_FP4_TELEMETRY_SNR_DB, or all elements quantized to zero); - if never
  steps         how many steps recorded it (XLA_FP4_TELEMETRY_EVERY)"""


def main(argv=None):
  try:
    return _main(argv)
  except BrokenPipeError:  # `... | head`: the reader left; say nothing more (and not at exit either)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


def _main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m xla_fp4")
  sub = parser.add_subparsers(dest="command", required=True)
  rep = sub.add_parser("report", help="print the decision tables written to XLA_FP4_DUMP_DIR")
  rep.add_argument("dump_dir")
  tel = sub.add_parser("telemetry", help="print the worst GEMMs recorded in XLA_FP4_TELEMETRY=DIR and write PNG "
                                           "heatmaps (DIR/telemetry_underflow.png, DIR/telemetry_snr.png)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=TELEMETRY_COLUMNS)
  tel.add_argument("directory")
  tel.add_argument("--json", action="store_true", help="print every record as one JSON list instead")
  tel.add_argument("--top", type=int, default=10, help="GEMM operands per table (default 10)")
  tel.add_argument("--no-plots", action="store_true", help="do not write the PNG heatmaps")
  sub.add_parser("options", help="print the option table (markdown)")
  sub.add_parser("info", help="print which kernels were built and registered, per platform, and why")
  args = parser.parse_args(argv)
  if args.command == "report":
    try:
      report.print_report(args.dump_dir)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  elif args.command == "telemetry":
    from xla_fp4 import telemetry
    try:
      records = telemetry.load(args.directory)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    if args.json:
      print(json.dumps([telemetry.jsonable(r) for r in records]))
      return 0
    telemetry.print_worst(records, args.top)
    if not args.no_plots and records:
      try:
        import matplotlib  # noqa: F401
      except ImportError:
        print("\n(no heatmaps: they need matplotlib: pip install matplotlib)")
        return 0
      for path in telemetry.plot(records, args.directory):
        print(f"wrote {path}")
  elif args.command == "info":
    from xla_fp4 import kernels
    from xla_fp4.passes import backend
    for key, value in kernels.info().items():
      print(f"{key}: {value}")
    cfg = config.load(enabled=True)
    for platform in ("cpu", "CUDA"):
      print(f"{platform} backend (XLA_FP4_BACKEND={cfg.backend}): {backend.summary(cfg, platform)}")
  else:
    print(config.markdown_table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
