"""benchmarks/kernels.py end to end on a small tensor: every quantizing CPU kernel measured against a copy, in both
dtypes, each C++ kernel with its target (issue 46), the JAX forms for scale."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"qdq", "qdq_with_scale", "packed", "packed_stats", "packed_pair", "block_amax", "mx_qdq", "mx_packed",
           "grouped", "jax", "packed_two"}
FOR_SCALE = ("jax", "grouped", "packed_two")  # measured beside the C++ kernels, no target of their own


@pytest.mark.benchmark  # runs benchmarks/kernels.py
def test_kernels_benchmark_measures_every_quantizer_against_a_copy(tmp_path):
  out = tmp_path / "kernels.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--size", "512", "--repeats",
                         "1", "--out", str(out)], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  rows = json.loads(out.read_text())["results"]
  for dtype in ("float32", "bfloat16"):
    mine = [r for r in rows if r["dtype"] == dtype]
    assert {r["kernel"] for r in mine} == KERNELS, dtype
    for r in mine:
      assert r["seconds"] > 0 and r["copy_seconds"] > 0 and r["fraction_of_copy_bandwidth"] > 0, r
      judged = r["kernel"] not in FOR_SCALE
      assert ("target" in r) == judged, r
      if judged:
        want = 0.75 if ("stochastic" in r["variant"] or "rht" in r["variant"]) else 0.9
        assert r["target"] == want and r["meets_target"] == (r["fraction_of_copy_bandwidth"] >= want), r
    # the pair quantizer beside the two quantizers it replaces, in the same variants
    assert ({r["variant"] for r in mine if r["kernel"] == "packed_pair"}
            == {r["variant"] for r in mine if r["kernel"] == "packed_two"} != set()), dtype
