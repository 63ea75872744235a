"""The MaxText sweep (marker `sweep`: in neither test tier nor CI, `./dev test -m sweep tests`): every family of
examples/maxtext/run.py in every layout (one device, unscanned, FSDP over 8 host devices scanned and unscanned), both
backends. CI runs two of them (`.ci/run`); this runs all, about two hours on 2 cores, and builds
MaxText's venv the first time (run.py `setup`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.sweep
def test_every_family_in_every_layout(tmp_path):
  out = tmp_path / "families.json"
  r = subprocess.run([sys.executable, "examples/maxtext/run.py", "--families", "--steps", "2", "--native",
                      "--work", str(tmp_path / "work"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
  results = json.loads(out.read_text())["results"] if out.exists() else {}
  failed = {name: entry.get("policy_violations") or entry["nvfp4"].get("warnings") or entry["nvfp4"]["log"]
            for name, entry in results.items() if not entry["ok"]}
  assert r.returncode == 0 and not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
  sys.path.insert(0, str(ROOT / "examples" / "maxtext"))
  import run
  assert sorted(results) == sorted(run.FAMILY_CONFIGS)
