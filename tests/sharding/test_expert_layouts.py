"""Mixtures of experts keep their parallelism under the pass (benchmarks/experts.py at small sizes, 8 host devices):
expert parallelism (experts over the mesh, an all-to-all dispatch) and FSDP of expert weights, for an einsum MoE, a
ragged-dot MoE and a dense MoE (every token through every expert), with every expert GEMM in NVFP4."""

import json

import pytest

from tests.sharding.test_layouts import run_python

# Its module fixture takes a while (a measurement or a compile): every test of this file runs on one worker (./dev
# passes --dist loadgroup), so the fixture runs once, not once per worker.
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp("experts") / "experts.json"
  run_python(["benchmarks/experts.py", "--small", "--repeats", "1", "--out", str(out)])
  return json.loads(out.read_text())["rows"]


@pytest.mark.benchmark  # the module fixture runs benchmarks/experts.py (a minute or two)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("program", ["einsum", "ragged", "dense"])
@pytest.mark.parametrize("layout", ["expert_parallel", "fsdp"])
def test_expert_layers_keep_their_parallelism(rows, program, layout, dtype):
  row = next(r for r in rows if (r["program"], r["layout"], r["dtype"]) == (program, layout, dtype))
  assert row["dot_flops"]["ratio"] <= 1.05, row["dot_flops"]
  assert row["collective_bytes"]["ratio_excluding_scalar"] <= 1.10, row["collective_bytes"]
  if program == "einsum" and layout == "expert_parallel":
    assert row["collective_bytes"]["collectives_pass"].get("kAllToAll", 0) > 0  # the dispatch stays an all-to-all
  # Nearest rounding: the sharded step quantizes what one device does, f32 partial sums of split contractions aside
  # (in bfloat16 their last bits can flip FP4 roundings downstream: the dense MoE, whose every token meets all 8
  # experts, measured 2.2e-2 against 7e-4 without the pass); a per-shard scale would be off by ~1e-1
  limit = 1e-5 if dtype == "float32" else 1e-2 if program != "dense" else 5e-2
  assert row["rel_l2_sharded_minus_single"]["pass_nearest"] <= limit, row["rel_l2_sharded_minus_single"]


@pytest.mark.benchmark
def test_one_device_work_is_the_programs(rows):
  """On one device the pass adds no GEMM work: every expert GEMM runs as one GEMM over the groups, as the program's."""
  for row in rows:
    if row["layout"] == "single":
      assert row["dot_flops"]["ratio"] <= 1.05, row
