"""Golden modules → rewritten text, checked with FileCheck directives (the PyPI `filecheck`), one per decision kind."""

import glob
import os
import subprocess
import sys

import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from nvfp4_testing import kernel_calls_row_major
from xla_fp4 import config
from xla_fp4.passes import pipeline, rewrite

GOLDEN = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "golden", "*.mlir")))
FILECHECK = os.path.join(os.path.dirname(sys.executable), "filecheck")


def _options(text):
  line = next(l for l in text.splitlines() if l.startswith("// CONFIG:"))
  pairs = [p for p in line[len("// CONFIG:"):].split() if p]
  return dict(p.split("=", 1) for p in pairs)


def _decisions(text):
  """The `// DECISIONS:` line: role:rule of every dot in program order (which rule decided, not only the IR)."""
  line = next(l for l in text.splitlines() if l.startswith("// DECISIONS:"))
  return " ".join(line[len("// DECISIONS:"):].split())


def test_goldens_hold_no_absolute_paths():
  for path in GOLDEN:
    text = open(path).read()
    assert '"/' not in text, f"{path} names a path of the machine that generated it; rerun regenerate.py"


def test_there_is_a_golden_file_per_decision_kind():
  names = {os.path.basename(p)[:-5] for p in GOLDEN}
  assert {"fprop_nvfp4", "fprop_partitioned", "backward_dgrad_wgrad", "keep_not_linear", "keep_odd_contraction",
          "keep_excluded_scope", "keep_excluded_regex", "keep_head", "scan_per_iteration_select",
          "keep_forward_only"} <= names


@pytest.mark.parametrize("path", GOLDEN, ids=[os.path.basename(p) for p in GOLDEN])
def test_golden(path, tmp_path):
  text = open(path).read()
  cfg = config.load(environ={}, enabled=True, **_options(text))
  with mlir.make_ir_context():
    module = ir.Module.parse(text)
    result = pipeline.transform(module, cfg, 
                                kernels=lambda m: rewrite.FfiKernels(partitioned=pipeline.num_partitions(m) > 1))
    assert result.module.operation.verify()  # the pass verifies in strict mode only (rewrite.apply)
    out = tmp_path / "after.mlir"
    out.write_text(result.module.operation.get_asm())
    kernel_calls_row_major(result.module)
  decided = " ".join(f"{r['role']}:{r['rule']}" for r in result.rows)
  assert decided == _decisions(text), f"decisions {decided!r}, the golden says {_decisions(text)!r}"
  check = subprocess.run([FILECHECK, path, "--input-file", str(out)], capture_output=True, text=True)
  assert check.returncode == 0, check.stdout + check.stderr + "\n--- rewritten module:\n" + out.read_text()[:6000]
