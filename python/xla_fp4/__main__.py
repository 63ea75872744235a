"""Command line: `python -m xla_fp4 report DIR` prints the decision tables of a dump dir; `info` what was built and
what the pass would use on each platform; `options` the option table."""

import argparse
import sys

from xla_fp4 import config, report


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m xla_fp4")
  sub = parser.add_subparsers(dest="command", required=True)
  rep = sub.add_parser("report", help="print the decision tables written to XLA_FP4_DUMP_DIR")
  rep.add_argument("dump_dir")
  sub.add_parser("options", help="print the option table (markdown)")
  sub.add_parser("info", help="print which kernels were built and registered, per platform, and why")
  args = parser.parse_args(argv)
  if args.command == "report":
    try:
      report.print_report(args.dump_dir)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  elif args.command == "info":
    from xla_fp4 import kernels
    for key, value in kernels.info().items():
      print(f"{key}: {value}")
  else:
    print(config.markdown_table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
