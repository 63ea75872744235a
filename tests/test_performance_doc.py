"""docs/performance.md and the README's headline numbers are what benchmarks/report.py generates from
benchmarks/results/*.json, and the README links the page."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_performance_doc_is_generated_from_the_results():
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], cwd=ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_links_the_performance_doc():
  assert "](docs/performance.md" in (ROOT / "README.md").read_text()
