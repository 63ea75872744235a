"""SHA-256 of the rewritten module (with debug info) of many programs in many configurations: the evidence that a
change of the pass's code changes none of its output (issue 41 showed it so). Run it on the old tree and on the new
one (a git worktree of the old commit, with the built extension copied into its python/xla_fp4/) and compare the JSON.

  python benchmarks/module_hashes.py ROOT OUT.json      # ROOT: the tree whose benchmarks/ and tests/ programs to lower

Run one copy of this script (from outside both trees) for both: the modules' debug locations name its frames, so
two copies at different paths hash differently.

Programs: the 12-block GPT step of pass_overhead.py; the test zoo's MoE, scan, linen, nnx, shard_map and Equinox
programs (MoE lowered for CPU and for CUDA too); every layout of sharding.py and every program x layout of experts.py
on 8 host devices. Configurations: default, native, telemetry (and with native), nearest rounding, kept blocks.
"""
import os, sys, json, hashlib, tempfile
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
root = sys.argv[1]
sys.path[:0] = [root + "/benchmarks", root + "/tests/passes", root + "/tests"]
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding
import xla_fp4
from xla_fp4 import config
from xla_fp4.passes import pipeline
from xla_fp4.passes.rewrite import FfiKernels
from xla_fp4.kernels import registry
import pass_overhead, sharding as shb, experts as exb, models

xla_fp4.enable(); xla_fp4.disable()  # registers the kernels: the rewrite emits FFI calls, not twins
registry.fp4_gemm_supported = lambda: (True, "")  # the CUDA lowerings build the native forms' IR without a GPU
tele = tempfile.mkdtemp()
CONFIGS = {"default": {}, "native": dict(backend="native"), "tele": dict(telemetry=tele),
           "tele_native": dict(backend="native", telemetry=tele), "nearest": dict(stochastic_rounding=False),
           "keep": dict(keep_first=1, keep_last=1)}
out = {}
def record(name, module, platform="cpu", configs=CONFIGS):
  for cname, opts in configs.items():
    try:
      r = pipeline.transform(module, config.load(environ={}, enabled=True, **opts), platform=platform,
                             kernels=(lambda m: FfiKernels()) if platform == "cuda" else None)
      text = r.module.operation.get_asm(enable_debug_info=True)
      out[f"{name}/{cname}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    except Exception as e:
      out[f"{name}/{cname}"] = f"error {type(e).__name__}: {str(e)[:100]}"
    print(name, cname, out[f"{name}/{cname}"], flush=True)

step, args = pass_overhead.make_step(d=256, layers=12, batch=2, seq=64)
record("gpt12", jax.jit(step).lower(*args).compiler_ir("stablehlo"))
for mname in ["ragged_moe", "ragged_glu_moe", "dense_moe", "jax_einsum", "jax_scan_mlp", "linen_transformer",
              "nnx_transformer", "jax_shard_map", "jax_nested_scan", "equinox_attention_mlp", "probe_shared_helper"]:
  fn, a = getattr(models, mname)()
  try:
    lowered = jax.jit(fn).trace(*a)
  except Exception as e:
    print("skip", mname, e); continue
  record(mname, lowered.lower().compiler_ir("stablehlo"))
  if "moe" in mname:
    record(mname + "_cuda", lowered.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo"), "cuda",
           {k: CONFIGS[k] for k in ("default", "native", "tele_native")})
for layout in shb.LAYOUTS:
  spec = shb.LAYOUTS[layout]
  mesh = jax.make_mesh(spec.mesh, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params, x = shb.make(2, 128, 256, 8, 32, jnp.float32, spec.scanned)
  residual = NamedSharding(mesh, spec.x) if spec.constrained else None
  p, xx = shb.place(mesh, params, x, layout)
  record("sharding_" + layout, shb.step_fn(spec.scanned, residual).lower(p, xx).compiler_ir("stablehlo"))
for program in exb.PROGRAMS:
  for layout in exb.LAYOUTS:
    params, x = exb.make(2, 8, 64, 128, 256, jnp.float32)
    a, dispatched = exb.place(params, x, layout)
    f = jax.jit(jax.grad(lambda p, x: exb.loss(p, x, program, dispatched)))
    record(f"experts_{program}_{layout}", f.lower(*a).compiler_ir("stablehlo"),
           configs={k: CONFIGS[k] for k in ("default", "native", "tele")})
json.dump(out, open(sys.argv[2], "w"), indent=1)
