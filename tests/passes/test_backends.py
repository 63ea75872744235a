"""Which kernels and which GEMM the pass uses on each platform, and registration that cannot happen.

CUDA platforms are faked (a stand-in for the CUDA extension module, a faked FP4-GEMM probe): the choice is plain logic
over kernels.status() and kernels.fp4_gemm_supported(), so it is tested on CPU; benchmarks/gpu_check.py checks the
real thing on a GPU.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib import xla_client

import xla_fp4
from xla_fp4 import config, kernels, report, state
from xla_fp4.kernels import registry
from xla_fp4.passes import pipeline, policy, rewrite


@pytest.fixture
def fresh_registry():
  """A process state with empty registration bookkeeping, for the test only."""
  with state.use(dataclasses.replace(state.current(), registered=set(), refused={}, said=set())) as s:
    yield s


def _module():
  x = jnp.zeros((32, 64))
  return jax.jit(lambda x, w: x @ w).lower(x, jnp.zeros((64, 64))).compiler_ir("stablehlo")


def _choose(platform, **options):
  module = _module()
  with module.context:
    return pipeline.choose_backend(config.load(enabled=True, **options), platform, module)


def _fake_cuda(monkeypatch, fp4_gemm):
  """A stand-in for xla_fp4._xla_fp4_cuda: the CPU handlers under the CUDA names, and an FP4-GEMM probe answer."""
  ext = kernels.extension()
  fake = types.SimpleNamespace(registrations=ext.registrations, ffi_api_version=ext.ffi_api_version,
                               fp4_gemm_supported=lambda: fp4_gemm)
  monkeypatch.setattr(registry, "_load_cuda", lambda: (fake, ""))
  return fake


def test_cpu_uses_its_ffi_kernels_and_emulates_in_auto():
  xla_fp4.enable()
  try:
    backend = _choose("cpu")
  finally:
    xla_fp4.disable()
  assert isinstance(backend.kernel_set, rewrite.FfiKernels) and backend.kernels == "cpu FFI kernels"
  assert backend.gemm == "emulate" and "no FP4 tensor cores on cpu" in backend.gemm_reason


def test_unregistered_platform_gets_the_stablehlo_form_with_the_reason(fresh_registry):
  backend = _choose("cpu")
  assert isinstance(backend.kernel_set, rewrite.ReferenceKernels)
  assert backend.kernels.startswith("plain StableHLO form (") and "not registered" in backend.kernels
  with pytest.raises(RuntimeError, match="XLA_FP4_BACKEND=native needs the compiled kernels"):
    _choose("cpu", backend="native")
  rocm = _choose("rocm")
  assert "xla_fp4 has no kernels for platform 'rocm'" in rocm.kernels and rocm.gemm == "emulate"


def test_cuda_registers_at_plugin_time_and_waits_for_the_cuda_backend(fresh_registry, monkeypatch):
  """register_all() registers every platform built; CUDA targets wait in JAX's queue until the CUDA plugin starts
  (here it never does), so registering on a machine without a GPU is harmless."""
  _fake_cuda(monkeypatch, (False, "the FP4 GEMM needs compute capability 10.x; device 0 is 9.0"))
  monkeypatch.setattr(xla_client, "_custom_callback", {})
  status = kernels.register_all()
  assert status["CUDA"] == (True, "CUDA FFI kernels registered") and status["cpu"][0]
  if "CUDA" not in xla_client._custom_callback_handler:  # no CUDA backend in this jaxlib: queued
    queued = {name for name, *_ in xla_client._custom_callback["CUDA"]}
    assert queued == set(kernels.TARGETS)
  assert kernels.status("cuda")[0] and kernels.status("gpu")[0]


@pytest.mark.parametrize("fp4_gemm, gemm, reason", [
    ((True, ""), "native", "auto: cuBLASLt FP4 GEMM"),
    ((False, "the FP4 GEMM needs compute capability 10.x; device 0 is 9.0"), "emulate", "device 0 is 9.0"),
])
def test_auto_on_cuda_picks_the_fp4_gemm_where_it_runs(fresh_registry, monkeypatch, fp4_gemm, gemm, reason):
  _fake_cuda(monkeypatch, fp4_gemm)
  kernels.register_all()
  backend = _choose("cuda")
  assert isinstance(backend.kernel_set, rewrite.FfiKernels) and backend.kernels == "CUDA FFI kernels"
  assert backend.gemm == gemm and reason in backend.gemm_reason


def test_native_on_a_gpu_without_fp4_gemm_is_refused_at_compile_time(fresh_registry, monkeypatch):
  """cuBLASLt's FP4 GEMM would fail at run time on Hopper; the pass refuses (the hook then compiles the original)."""
  _fake_cuda(monkeypatch, (False, "the FP4 GEMM needs compute capability 10.x; device 0 is 9.0"))
  kernels.register_all()
  with pytest.raises(RuntimeError, match="device 0 is 9.0"):
    _choose("cuda", backend="native")


def test_cuda_not_built_says_why(fresh_registry, monkeypatch):
  monkeypatch.setattr(registry, "_cuda_built", lambda: False)
  monkeypatch.setattr(registry, "_load_cuda", lambda: (None, "the xla_fp4 CUDA kernels were not built: no nvcc"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a CUDA build that does not exist is no reason to warn on a CPU machine
    assert kernels.register_all()["CUDA"] == (False, "the xla_fp4 CUDA kernels were not built: no nvcc")
  backend = _choose("cuda")
  assert isinstance(backend.kernel_set, rewrite.ReferenceKernels) and "no nvcc" in backend.kernels
  assert "no nvcc" in backend.gemm_reason


def test_the_build_says_whether_it_has_cuda():
  ext = kernels.extension()
  assert ext.cuda_build.startswith(("built for sm_", "not built: ")), ext.cuda_build
  # Whole sentences: `python -m xla_fp4 info` and every CUDA test's skip reason print it.
  assert ext.cuda_build.count("(") == ext.cuda_build.count(")") and not ext.cuda_build.endswith(" "), ext.cuda_build
  module, why = registry._load_cuda()
  assert (module is not None) == ext.cuda_build.startswith("built") or "do not load" in why


@pytest.mark.parametrize("built, running, refused", [((0, 3), (0, 3), False), ((0, 3), (0, 5), False),
                                                     ((0, 5), (0, 3), True), ((1, 0), (0, 9), True)])
def test_ffi_api_compatibility(monkeypatch, built, running, refused):
  monkeypatch.setattr(registry, "runtime_ffi_api", lambda: running)
  why = registry._ffi_mismatch(types.SimpleNamespace(ffi_api_version=built))
  assert (why is not None) == refused
  if refused:
    assert f"built against XLA FFI API {built[0]}.{built[1]}" in why and "--no-build-isolation" in why


def test_the_running_jaxlib_api_is_read_and_the_build_is_accepted():
  running = kernels.runtime_ffi_api()
  assert running is not None and len(running) == 2
  assert registry._ffi_mismatch(kernels.extension()) is None, (kernels.extension().ffi_api_version, running)


def test_native_needs_k_a_multiple_of_32_on_cuda_only():
  site = lambda k, batch=((), ()): types.SimpleNamespace(  # noqa: E731
      gemm=types.SimpleNamespace(k=k, batch=batch, n=64, dtype="bf16"))
  assert policy.native_ineligible(site(48), cuda=False) is None
  assert "K a multiple of 32, K=48" in policy.native_ineligible(site(48), cuda=True)
  assert policy.native_ineligible(site(64), cuda=True) is None
  assert "no batch dims" in policy.native_ineligible(site(64, ((0,), (0,))), cuda=False)


@pytest.mark.parametrize("n,dtype,refused", [(100, "bf16", True), (100, "f16", True), (100, "f32", False),
                                             (104, "bf16", False), (102, "f32", True), (96, "f32", False)])
def test_native_on_cuda_refuses_an_output_whose_rows_cuBLASLt_cannot_align(n, dtype, refused):
  """cuBLASLt's block-scaled GEMM needs 16-byte output rows: a layer with N = 100 in bf16 would find no algorithm at
  run time on Blackwell and fail the step; the policy keeps its emulated GEMM, with the rule as its reason."""
  site = types.SimpleNamespace(gemm=types.SimpleNamespace(k=64, batch=((), ()), n=n, dtype=dtype))
  why = policy.native_ineligible(site, cuda=True)
  assert (why is not None) == refused, why
  if refused:
    assert f"N a multiple of {16 // (4 if dtype == 'f32' else 2)} for {dtype}, N={n}" in why
  assert policy.native_ineligible(site, cuda=False) is None  # the C++ reference GEMM takes any N


def test_report_shows_the_backend():
  text = report.table([], title="m", backend={"kernels": "CUDA FFI kernels", "gemm": "emulate",
                                              "gemm_reason": "auto: device 0 is 9.0"})
  assert "kernels: CUDA FFI kernels; GEMM: emulate (auto: device 0 is 9.0)" in text


def test_a_registration_that_xla_would_refuse_leaves_a_running_program(tmp_path):
  """Kernels built against a newer XLA FFI API than the running jaxlib's would kill JAX's CPU backend at start-up.
  The plugin checks first: one warning, no registration, and the pass emits the plain StableHLO form; the program
  runs, computes the same numbers as with the kernels, and the dump says why."""
  script = textwrap.dedent("""
      import json, sys, warnings
      warnings.simplefilter("always")
      from xla_fp4.kernels import registry
      if sys.argv[1] == "refuse":
        registry.runtime_ffi_api = lambda: (0, 0)  # as if this jaxlib were older than the kernels' headers
      import jax, jax.numpy as jnp
      with warnings.catch_warnings(record=True) as caught:
        w = jax.random.normal(jax.random.key(0), (64, 64))
        x = jax.random.normal(jax.random.key(1), (32, 64))
        g = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)))(w)
      print(json.dumps({"grad": g.ravel()[:8].tolist(), "warnings": [str(c.message) for c in caught]}))
  """)
  out = {}
  for mode in ("refuse", "accept"):
    env = dict(os.environ, XLA_FP4="1", XLA_FP4_DUMP_DIR=str(tmp_path / mode), XLA_FP4_STOCHASTIC_ROUNDING="0")
    proc = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    out[mode]["backend"] = report.load(tmp_path / mode)[0][1]["backend"]
  refused = [w for w in out["refuse"]["warnings"] if "XLA FFI API" in w]
  assert len(refused) == 1 and "plain StableHLO form" in refused[0], out["refuse"]["warnings"]
  assert out["refuse"]["backend"]["kernels"].startswith("plain StableHLO form (the xla_fp4 kernels were built")
  assert out["accept"]["backend"]["kernels"] == "cpu FFI kernels"
  assert out["refuse"]["grad"] == out["accept"]["grad"]


@pytest.mark.benchmark  # runs benchmarks/gpu_check.py
def test_gpu_check_runs_with_the_cpu_standing_in(tmp_path):
  """benchmarks/gpu_check.py end to end (the GPU check's logic, its JSON), with the CPU as the device."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "gpu_check.json"
  proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu_check.py"), "--platform", "cpu",
                         "--small", "--repeats", "1", "--out", str(out)], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["ok"] and set(result["checks"]) == {"device runs the xla_fp4 targets", "device == CPU emulation",
                                                    "expert layer on the device == grouped reference",
                                                    "telemetry on the device == CPU, outputs unchanged"}
  telemetry = result["checks"]["telemetry on the device == CPU, outputs unchanged"]
  assert telemetry["outputs_unchanged"] and telemetry["records"] > 0
  experts = result["checks"]["expert layer on the device == grouped reference"]
  assert max(experts["rel_l2"].values()) <= experts["tolerance"] < min(experts["rel_l2_unquantized"].values())
  assert "xla_fp4_qdq_with_scale" in result["checks"]["device runs the xla_fp4 targets"]["targets"]
  assert result["step_seconds"]["ratio_emulate"] > 0 and result["kernels"]["cpu registration"]
  bandwidth = result["kernel_bandwidth"]["kernels"]
  assert set(bandwidth) == {"float32", "bfloat16"}
  assert all(r["of_copy"] > 0 for rows in bandwidth.values() for name, r in rows.items() if name != "copy_gb_s")


def _twin_calls(module, n_twins):
  """Call kernel_twins.decode_scale on a 32x4 constant through `n_twins` Twins of `module`; -> the twins' functions."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import hlo
  from xla_fp4.numerics import kernel_twins
  with module.context, ir.Location.unknown():
    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    f32 = ir.F32Type.get()
    with ir.InsertionPoint.at_block_begin(main.regions[0].blocks[0]):
      blocks = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([32, 4], f32),
                                                             ir.FloatAttr.get(f32, 1.0))).result
      for twins in [rewrite.Twins(module) for _ in range(n_twins)]:
        twins.call(kernel_twins.decode_scale, [blocks], [ir.RankedTensorType.get([], f32)])
    assert module.operation.verify()
    return [ir.StringAttr(op.attributes["sym_name"]).value for op in module.body.operations
            if ir.StringAttr(op.attributes["sym_name"]).value.startswith("xla_fp4_twin_")]


def test_twins_define_each_function_once_and_lower_each_signature_once_per_process():
  with state.use(dataclasses.replace(state.current(), lowered_twins={})) as s:
    funcs = _twin_calls(_module(), 2)  # two Twins of one module (the emitter's and ReferenceKernels') share it
    assert len(funcs) == 1 and funcs[0].startswith("xla_fp4_twin_decode_scale_")
    assert len(s.lowered_twins) == 1
    assert _twin_calls(_module(), 1) == funcs and len(s.lowered_twins) == 1  # the next module reuses the text


def test_twins_are_lowered_outside_the_users_mesh():
  """The pass runs inside the user's jit, often under jax.set_mesh: the twins must not name that mesh."""
  module = _module()
  with state.use(dataclasses.replace(state.current(), lowered_twins={})), \
      jax.set_mesh(jax.make_mesh((1,), ("data",))):
    _twin_calls(module, 1)
  assert "@mesh" not in str(module) and "sdy.sharding" not in str(module)


def test_native_grouped_gemms_on_cuda_refuse_unaligned_output_rows():
  """The grouped row path offsets each group's output by begin * N elements: the same 16-byte rule; the per-expert
  GEMMs write f32 products (N a multiple of 4)."""
  from xla_fp4.passes.analysis.records import Grouping
  gemm = lambda n, dtype: types.SimpleNamespace(lhs_shape=(256, 64), rhs_shape=(8, 64, n), contracting=((1,), (1,)),  # noqa: E731
                                                batch=((), ()), n=n, dtype=dtype)
  ragged = lambda n, dtype: types.SimpleNamespace(  # noqa: E731
      gemm=gemm(n, dtype), groups=types.SimpleNamespace(kind=Grouping.RAGGED_ROWS, k=64, free=(), lhs=(0,), rhs=(0,)))
  assert "N a multiple of 8 for bf16, N=100" in policy.native_grouped_ineligible(ragged(100, "bf16"), cuda=True)
  assert policy.native_grouped_ineligible(ragged(104, "bf16"), cuda=True) is None
  assert policy.native_grouped_ineligible(ragged(100, "bf16"), cuda=False) is None


@pytest.mark.benchmark  # runs benchmarks/formats.py
def test_formats_benchmark_runs_every_format_side_by_side(tmp_path):
  """benchmarks/formats.py --small end to end: a row per format (NVFP4, NVFP4 with Four Over Six, MXFP4, MXFP8), each
  measured; the one-GEMM errors against float64 in the order the formats' precision says (MXFP8's 8-bit elements
  far below the 4-bit ones; Four Over Six not above plain NVFP4 on these Gaussian operands)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "formats.json"
  proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "formats.py"), "--small", "--out", str(out)],
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {"nvfp4", "nvfp4+4/6", "mxfp4", "mxfp8"}
  for r in rows.values():
    assert r["quantize_vs_copy"] > 0 and r["packed_quantize_vs_copy"] > 0 and r["step_time_ratio"] > 0, r
    assert 0 < r["rel_l2_vs_high_precision"] < 0.5 and r["fsdp_packed_weight_gathers_ratio"] > 0, r
  errors = {name: r["gemm_rel_error"] for name, r in rows.items()}
  assert errors["mxfp8"] < 0.5 * min(errors["nvfp4"], errors["mxfp4"]), errors
  assert errors["nvfp4+4/6"] <= errors["nvfp4"], errors
