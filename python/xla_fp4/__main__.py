"""Command line: `python -m xla_fp4 report DIR` prints the decision tables of a dump dir."""

import argparse
import sys

from xla_fp4 import config, report


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m xla_fp4")
  sub = parser.add_subparsers(dest="command", required=True)
  rep = sub.add_parser("report", help="print the decision tables written to XLA_FP4_DUMP_DIR")
  rep.add_argument("dump_dir")
  sub.add_parser("options", help="print the option table (markdown)")
  args = parser.parse_args(argv)
  if args.command == "report":
    try:
      report.print_report(args.dump_dir)
    except FileNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  else:
    print(config.markdown_table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
