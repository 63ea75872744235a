"""MaxText, unmodified, with and without XLA_FP4=1: loss gap, step time, FLOP share, and the pass's decisions.

    python examples/maxtext/run.py                    # every configuration of the default model, 8 steps each way
    python examples/maxtext/run.py --configs default fsdp8 --steps 4 --out /tmp/mt.json    # the CI smoke test
    python examples/maxtext/run.py --families --steps 3 --native   # MaxText's newer families, every layout

Builds (once) a Python 3.12 venv with `maxtext[tpu]==0.2.4` (jax >= 0.10.2: pip takes the newest) outside the checkout
(MAXTEXT_VENV, default ~/.cache/xla_fp4/maxtext-venv), installs this checkout into it the way a user would
(`pip install .`, pip's isolated build), then runs MaxText's own trainer on CPU with synthetic data, a small
decoder, for each configuration: once as is, once with XLA_FP4=1 and a dump dir. From MaxText's log it takes each
step's loss and time; from the dumps the pass's decisions, checked against the paper's policy (arXiv 2509.25149 §4):
the logits head and the attention products kept, about 16% of the decoder layers (weighted to the end) kept, every
other decoder linear layer's fprop, dgrad and wgrad in NVFP4 (an MoE's router, with fewer than 16 experts, is kept:
too small for the kernels), the last decoder layer among the kept ones (a block is a decoder layer, however the
family scans them), an MoE's expert GEMMs with one decode scale per expert and group of tokens in all three roles,
and no warning of the pass (a fallback is a failure). The
sharded configurations (8 host devices) are also checked against issue 8: per-device dot FLOPs and collective bytes
from the dumped HLO, and the step-0 loss against a one-device run of the same global batch with the pass. Writes one
JSON file and exits non-zero when a run fails, a decision breaks the policy or a sharded configuration misses those
checks.
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = Path.home() / ".cache" / "xla_fp4" / "maxtext-venv"
VENV = Path(os.environ.get("MAXTEXT_VENV", DEFAULT_VENV))
MAXTEXT = os.environ.get("MAXTEXT_SPEC", "maxtext[tpu]==0.2.4")  # MAXTEXT_SPEC='maxtext[tpu]==0.2.5': jax 0.12
SMALL = ["base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=512",
         "base_num_decoder_layers=4", "max_target_length=128", "vocab_size=256",
         "per_device_batch_size=1", "dataset_type=synthetic", "enable_checkpointing=false"]
# name -> extra MaxText overrides. default: MaxText's own defaults (bf16 activations, scanned decoder layers, remat
# policy full, the llama2 decoder block): remat_full and llama2 restate them, and must give the default's numbers.
_MIXTRAL = ["model_name=mixtral-8x7b", "override_model_config=true", "base_moe_mlp_dim=512", "head_dim=64"]
CONFIGS = {
    "default": [],
    "f32": ["dtype=float32", "weight_dtype=float32"],
    "unscanned": ["scan_layers=false"],
    "remat_full": ["remat_policy=full"],
    "remat_minimal": ["remat_policy=minimal"],
    "llama2": ["model_name=llama2-7b", "override_model_config=true"],
    "gemma": ["model_name=gemma-2b", "override_model_config=true"],  # logits through the tied embedding
    "gpt3": ["model_name=gpt3-52k", "override_model_config=true"],
    # Sharded over 8 host devices (SHARDED): FSDP over all of them, and FSDP x tensor parallelism.
    "fsdp8": ["ici_fsdp_parallelism=8"],
    "fsdp4_tp2": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    # Mixture of experts (mixtral's decoder: 8 experts, top-2), its expert GEMMs as ragged dots (sparse_matmul, with
    # jax.lax.ragged_dot where megablox is off), and dense (every token meets every expert: the up projections
    # `BSM,EMH->BSEH` hold the expert as a free dim of the weight, found from its flow into the down projection).
    "moe_sparse": [*_MIXTRAL, "sparse_matmul=true", "megablox=false"],
    "moe_dense": [*_MIXTRAL, "sparse_matmul=false"],
}
# MaxText's newer families (issue 40), tiny: 8 experts top-2 (Llama 4 routes top-1 only), expert MLP 512, head_dim 64,
# sparse_matmul on jax.lax.ragged_dot. Each runs on one device and FSDP over 8 host devices, scanned and unscanned
# (FAMILY_LAYOUTS). What one scan iteration holds: DeepSeek-V3 one layer in two stacks (1 dense, then MoE layers);
# Qwen3-MoE one; Llama 4 4; gpt-oss 2; Qwen3-Next 4 (3 gated delta net, 1 attention); Gemma 3 a pattern of 6 and an
# unscanned remainder (8 layers: 6 scanned, 2 after). Gemma 3 is dense.
_MOE = ["override_model_config=true", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=512", "head_dim=64",
        "sparse_matmul=true", "megablox=false"]
FAMILIES = {
    "deepseek3": ["model_name=deepseek3-671b", *_MOE, "first_num_dense_layers=1", "shared_experts=1",
                  "q_lora_rank=64", "kv_lora_rank=64", "qk_nope_head_dim=32", "qk_rope_head_dim=32", "v_head_dim=64"],
    "qwen3_moe": ["model_name=qwen3-30b-a3b", *_MOE],
    "llama4": ["model_name=llama4-17b-16e", *_MOE, "num_experts_per_tok=1", "shared_experts=1"],
    "gemma3": ["model_name=gemma3-4b", "override_model_config=true", "head_dim=64", "sliding_window_size=64",
               "base_num_decoder_layers=8"],
    "gpt_oss": ["model_name=gpt-oss-20b", *_MOE, "sliding_window_size=64"],
    "qwen3_next": ["model_name=qwen3-next-80b-a3b", *_MOE, "gdn_num_key_heads=2", "gdn_num_value_heads=4",
                   "gdn_key_head_dim=64", "gdn_value_head_dim=64"],
}
FAMILY_LAYOUTS = {"": [], "_unscanned": ["scan_layers=false"], "_fsdp8": ["ici_fsdp_parallelism=8"],
                  "_fsdp8_unscanned": ["ici_fsdp_parallelism=8", "scan_layers=false"]}
# No expert-parallel layout: MaxText 0.2.4's does not run on CPU, with or without the pass. Its dispatch under
# ici_expert_parallelism is a ragged-all-to-all, which XLA:CPU cannot compile ("HLO opcode `ragged-all-to-all` is not
# supported by XLA:CPU"), and its ring of experts (use_ring_of_experts=true) fails in MaxText's own tracing with
# jax.lax.ragged_dot ("expected rhs group dimension size to be 8, got 4"). Expert parallelism is tested on programs of
# this project's: tests/sharding/test_shard_map_scales.py (a shard_map body over experts x FSDP) and
# benchmarks/experts.py's expert_parallel layouts.
FAMILY_CONFIGS = {family + layout: overrides + extra for family, overrides in FAMILIES.items()
                  for layout, extra in FAMILY_LAYOUTS.items()}
CONFIGS.update(FAMILY_CONFIGS)
# Configurations that run on 8 host devices. For these the optimized HLO of both runs' train step is dumped, and the
# per-device dot FLOPs and collective bytes (xla_fp4.sharding.cost) must stay within issue 8's targets.
SHARDED = {"fsdp8", "fsdp4_tp2"} | {name for name in FAMILY_CONFIGS if "fsdp" in name}
HOST_DEVICES = 8
STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+),.* loss: ([0-9.]+)")


def _python312():
  for cand in [os.environ.get("PYTHON312", ""), shutil.which("python3.12") or "",
               *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))]:
    if cand and subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                               capture_output=True).returncode == 0:
      return cand
  sys.exit("examples/maxtext/run.py needs a Python 3.12 interpreter (MaxText 0.2.4 supports 3.12); set PYTHON312")


def setup():
  """The venv (built once) with MaxText and this checkout installed; returns its python."""
  python = VENV / "bin" / "python"
  if not (VENV / ".maxtext_ok").exists():
    print(f"== building {VENV} with {MAXTEXT} (first time: several minutes)", flush=True)
    subprocess.run([_python312(), "-m", "venv", str(VENV)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", MAXTEXT], check=True)
    (VENV / ".maxtext_ok").write_text(MAXTEXT + "\n")
  # Installed again only when what the wheel is built from changed (a reinstall relinks the module and compiles its
  # bindings, about half a minute, where the kernels are built already).
  stamp, want = VENV / ".xla_fp4_checkout", _checkout_digest()
  if stamp.exists() and stamp.read_text() == want:
    print(f"== this checkout is installed in {VENV} already", flush=True)
    return python
  print(f"== installing this checkout into {VENV} (pip install ., isolated build)", flush=True)
  # pyproject.toml's build folder, build/cp312-abi3-linux_x86_64, which a Python 3.13 dev venv shares: whichever builds
  # second compiles the extension's bindings only, not the kernels (not two builds at once: one folder, no lock).
  subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)], check=True)
  stamp.write_text(want)
  return python


def _checkout_digest():
  """A digest of every file the wheel is built from (its sources, Python and C++, and the build's own files)."""
  files = [ROOT / "pyproject.toml", ROOT / "CMakeLists.txt",
           *(f for folder in ("cmake", "xla_fp4", "python") for f in (ROOT / folder).rglob("*")
             if f.is_file() and "__pycache__" not in f.parts)]
  digest = hashlib.sha256()
  for f in sorted(files):
    digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
  return digest.hexdigest()


def train(python, name, overrides, steps, fp4, dump_dir, log, sharded=False, small=SMALL, telemetry=None,
          backend=None, nearest=False, exact=False, fmt=None, xla_flags=""):
  config = _base_config(python)
  env = {}  # the run's own variables, on top of this process's environment less any of theirs (_own_variable)
  if fp4:
    env.update(XLA_FP4="1", XLA_FP4_DUMP_DIR=str(dump_dir))
  if telemetry:
    env["XLA_FP4_TELEMETRY"] = str(telemetry)
  if backend:
    env["XLA_FP4_BACKEND"] = backend
  if fmt:
    env["XLA_FP4_FORMAT"] = fmt
  if nearest:
    env["XLA_FP4_STOCHASTIC_ROUNDING"] = "0"
  if sharded:
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={HOST_DEVICES} --xla_dump_hlo_as_proto "
                        f"--xla_dump_to={hlo_dir(dump_dir, fp4)} --xla_dump_hlo_module_re=.*train_step.*")
  if exact:  # one_device_check: bf16 values rounded to bf16 wherever XLA fuses
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
  if xla_flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
  # An override given twice (a family's layer count) takes its last value.
  argv = ["maxtext.trainers.pre_train.train", config, f"run_name={name}",
          f"base_output_directory={dump_dir.parent / 'maxtext_out'}", f"steps={steps}",
          *_last_wins([*small, *overrides])]
  start = time.time()
  returncode = _trainer(python).run(argv, env, dump_dir.parent, log)
  text = Path(log).read_text()
  steps_seen = [(int(s), float(t), float(l)) for s, t, l in STEP_RE.findall(text)]
  said = sorted(set(re.findall(r"xla_fp4: [^\n]*", text)))
  # The pass says once that it is on (and where its report goes): a notice, not a warning; telemetry alerts are
  # what telemetry is for.
  warnings = [w for w in said if not w.startswith("xla_fp4 is on") and "telemetry alert" not in w]
  return dict(returncode=returncode, wall_s=round(time.time() - start, 1), warnings=warnings,
              notices=[w for w in said if w not in warnings],
              log=str(Path(log).relative_to(Path(log).parents[1])),  # under --work
              losses=[l for _, _, l in steps_seen],
              # Step 0 compiles; the median of the others is the step time.
              step_s=statistics.median([t for s, t, _ in steps_seen if s > 0]) if len(steps_seen) > 1 else None)


class _Trainer:
  """MaxText's trainer in the venv's python with its imports done once (preloaded_trainer.py): each run a forked
  child of it, the same run as `python -m maxtext.trainers.pre_train.train` (its docstring says why), without the
  20-25 s of imports each (half of a small configuration's run here)."""

  def __init__(self, python):
    self.cmd = [str(python), str(Path(__file__).with_name("preloaded_trainer.py"))]
    # MaxText is imported without the variables each run sets (train): a run's child sets its own.
    self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, env={k: v for k, v in os.environ.items() if not _own_variable(k)})

  def run(self, argv, env, cwd, log, timeout=1800):
    """The training's exit status (-9: killed past `timeout` seconds); its output in `log`."""
    self.proc.stdin.write(json.dumps(dict(argv=argv, env=env, cwd=str(cwd), log=str(log), timeout=timeout)) + "\n")
    self.proc.stdin.flush()
    reply = self.proc.stdout.readline()
    if not reply:
      raise SystemExit(f"MaxText's preloaded trainer ended before answering (exit {self.proc.wait()}); "
                       f"`{' '.join(self.cmd)}` shows its error")
    return json.loads(reply)["returncode"]


@functools.lru_cache(maxsize=None)
def _trainer(python):
  return _Trainer(python)


@functools.lru_cache(maxsize=None)
def _base_config(python):
  """MaxText's configs/base.yml in the venv of `python` (found once, not once per run)."""
  return subprocess.run([python, "-c", "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "
                         "'configs', 'base.yml'))"], capture_output=True, text=True, check=True).stdout.strip()


def _own_variable(name):
  """Whether each run sets the environment variable `name` itself (the trainer imports MaxText without it)."""
  return name.startswith("XLA_FP4") or name == "XLA_FLAGS"


def _last_wins(overrides):
  keys = [o.split("=", 1)[0] for o in overrides]
  return [o for i, o in enumerate(overrides) if keys[i] not in keys[i + 1:]]


def telemetry_run(python, name, nvfp4, work, steps, sharded):
  """The NVFP4 run again with XLA_FP4_TELEMETRY: (summary, violations). Its losses must equal the run's without
  telemetry, and every GEMM the pass rewrote must have records, in every step."""
  directory, dump = work / "telemetry", work / "dump_telemetry"
  dump.mkdir(parents=True, exist_ok=True)
  run = train(python, f"{name}_fp4_telemetry", CONFIGS[name], steps, True, dump, work / "fp4_telemetry.log", sharded,
              telemetry=directory)
  bad = [] if run["returncode"] == 0 else [f"the telemetry run failed: {run['log']}"]
  if run["losses"] != nvfp4["losses"]:
    bad.append(f"losses with telemetry {run['losses']} differ from {nvfp4['losses']}")
  from xla_fp4 import telemetry
  records = telemetry.load(str(directory)) if (directory / telemetry.FILE).exists() else []
  rewritten = set()
  for path in dump.glob("*.decisions.json"):
    rows = json.loads(path.read_text())["decisions"]
    # A chlo.ragged_dot's quantized values stay inside its twin: not measured (docs/design.md §7).
    rewritten |= {(r["layer"], r["role"]) for r in rows if r["decision"] == "nvfp4"
                  and r.get("groups") not in ("ragged_rows", "ragged_contracting")}
  seen = {(r["layer"], r["role"]) for r in records}
  if rewritten - seen:
    bad.append(f"no telemetry for {sorted(rewritten - seen)[:4]}")
  stepped = sorted({r["step"] for r in records})
  if stepped != list(range(len(stepped))) or len(stepped) < steps - 1:
    bad.append(f"telemetry steps {stepped}")
  by_underflow, by_snr = telemetry.worst(records, 3) if records else ([], [])
  return dict(records=len(records), gemm_operands=len({(r["layer"], r["role"], r["operand"], r["block"])
                                                       for r in records}),
              steps=stepped, same_losses=run["losses"] == nvfp4["losses"], step_s=run["step_s"],
              worst_underflow=by_underflow, lowest_snr_db=by_snr, log=run["log"]), bad


# |loss, native - emulate|, both with nearest rounding. Step 0 (a forward pass: the same quantized operands, the FP4
# GEMM's f32 sums in another order than XLA's dot): measured 0.000 on one device and sharded. Later steps: one device
# 0.000 (bit for bit, MaxText's default model); sharded (fsdp8, fsdp4_tp2) 0.006 and 0.011 after 4 steps, growing step
# by step (0.005, 0.002, 0.011), as a split contraction's partial sums, added in another order, flip FP4 roundings
# downstream that training then carries on. (With stochastic rounding the backends draw differently, since the packed
# form quantizes K-major copies of the operands: one device's runs drifted 0.025 apart in 4 steps.) What the gradients
# are is bound in CI by tests/sharding/test_layouts.py (relative L2 to the emulate backend's, 8e-5).
# Where later steps differ by more, the cause can be XLA's own dots: DeepSeek-V3 (one device, scanned, NVFP4, 3 steps)
# read native [6.151, 5.983, 5.927] against emulate [6.151, 6.004, 5.970]. With XLA CPU's dots summed by Eigen instead
# of YNNPACK (SUMMATION_ORDER_FLAGS; 91% of a dot's float32 outputs then differ in a last bit or so) both backends read
# [6.151, 6.009, 5.911], bit for bit the same losses: the emulated GEMMs' YNNPACK sums had flipped FP4 roundings
# downstream, 0.059 at step 2 between the two emulate runs. So a later-step gap above NATIVE_TOLERANCE trains both
# backends again with those flags, and there they must agree.
NATIVE_STEP0_TOLERANCE = 0.002
NATIVE_TOLERANCE = 0.02
SUMMATION_ORDER_FLAGS = "--xla_cpu_experimental_ynn_fusion_type="


def native_run(python, name, work, steps, sharded, fmt=None):
  """The quantized run (NVFP4, or XLA_FP4_FORMAT `fmt`) with XLA_FP4_BACKEND=native beside the emulate backend's, both
  with nearest rounding: (summary, violations). Their losses must match; sharded, the native train step must run
  packed GEMMs (the FP4 GEMM, or the MX formats') and keep issue 8's targets."""
  runs, failed = both_backends(python, name, work, steps, sharded, fmt, "nearest")
  if failed:
    return dict(log=runs[failed]["log"]), [f"the {failed} run with nearest rounding failed: {runs[failed]['log']}"]
  run, emulate = runs["native"], runs["emulate"]
  gap = round(max(abs(a - b) for a, b in zip(run["losses"], emulate["losses"])), 4)
  gap0 = round(abs(run["losses"][0] - emulate["losses"][0]), 4)
  out = dict(losses=run["losses"], emulate_losses=emulate["losses"], step_s=run["step_s"],
             emulate_step_s=emulate["step_s"], step0_loss_gap_to_emulate=gap0, max_loss_gap_to_emulate=gap,
             log=run["log"], warnings=run["warnings"])
  bad = [f"native step-0 loss {run['losses'][0]} differs from emulate's {emulate['losses'][0]} by {gap0} (nearest "
         f"rounding)"] if gap0 > NATIVE_STEP0_TOLERANCE else []
  if not bad and gap > NATIVE_TOLERANCE:
    out["eigen_dots"], bad = eigen_dots_check(python, name, work, steps, sharded, fmt)
  bad += [f"{backend} run warned: {w}" for backend, r in runs.items() for w in r["warnings"]]
  if sharded:
    out["per_device_cost"], more = sharded_cost(python, work / "dump_native_nearest", base_dump_dir=work / "dump")
    bad += more
    if out["per_device_cost"] and not out["per_device_cost"]["packed_gemms"]:
      bad.append("the sharded native train step runs no packed GEMM")
  return out, bad


def both_backends(python, name, work, steps, sharded, fmt, tag, xla_flags=""):
  """The quantized run with the emulate and the native backend, nearest rounding, dumps and logs named by `tag`:
  ({backend: train's summary}, the backend whose run failed or None)."""
  runs = {}
  for backend in ("emulate", "native"):
    dump = work / f"dump_{backend}_{tag}"
    dump.mkdir(parents=True, exist_ok=True)
    runs[backend] = train(python, f"{name}_fp4_{backend}_{tag}", CONFIGS[name], steps, True, dump,
                          work / f"fp4_{backend}_{tag}.log", sharded, backend=backend, nearest=True, fmt=fmt,
                          xla_flags=xla_flags)
    if runs[backend]["returncode"] != 0 or len(runs[backend]["losses"]) != steps:
      return runs, backend
  return runs, None


def eigen_dots_check(python, name, work, steps, sharded, fmt):
  """Both backends trained again with XLA's dots summed by Eigen (SUMMATION_ORDER_FLAGS), nearest rounding: ({losses,
  emulate_losses, max_loss_gap}, [violations]). Their losses must agree within NATIVE_TOLERANCE."""
  runs, failed = both_backends(python, name, work, steps, sharded, fmt, "eigen_dots", SUMMATION_ORDER_FLAGS)
  if failed:
    return {}, [f"the {failed} run with Eigen's dots failed: {runs[failed]['log']}"]
  native, emulate = runs["native"]["losses"], runs["emulate"]["losses"]
  gap = round(max(abs(a - b) for a, b in zip(native, emulate)), 4)
  out = dict(losses=native, emulate_losses=emulate, max_loss_gap=gap)
  return out, [f"native losses {native} differ from emulate's {emulate} by {gap} with XLA's dots summed by Eigen as "
               f"well"] if gap > NATIVE_TOLERANCE else []


def hlo_dir(dump_dir, fp4):
  return dump_dir.parent / f"hlo_{dump_dir.name}_{'fp4' if fp4 else 'base'}"


@functools.lru_cache(maxsize=None)
def _proto_reader(python):
  """A Python with XLA's protos (tensorflow's): MaxText 0.2.4's venv has them; 0.2.5's (no tensorflow) borrows the
  0.2.4 venv's where it exists."""
  for candidate in (python, DEFAULT_VENV / "bin" / "python"):
    if Path(candidate).exists() and subprocess.run(
        [candidate, "-c", "from tensorflow.compiler.xla.service import hlo_pb2"], capture_output=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).returncode == 0:
      return candidate
  raise SystemExit(f"reading the dumped HLO needs tensorflow's XLA protos, in neither {python} nor {DEFAULT_VENV}: "
                   f"build MaxText 0.2.4's venv (run.py with MAXTEXT_VENV unset) or pip install tensorflow-cpu there")


def hlo_module_protos(python, paths):
  """The HloModuleProto inside each xla.HloProto that XLA dumps as *.hlo.pb, read with the XLA protos that ship in the
  MaxText venv (tensorflow's: `_proto_reader`), all in one process (tensorflow's import takes 10-20 s here); each
  kept beside its dump as *.module, which a later read of the same dump takes."""
  outs = [path.with_suffix(".module") for path in paths]
  todo = [str(f) for path, out in zip(paths, outs)
          if not (out.exists() and out.stat().st_mtime >= path.stat().st_mtime) for f in (path, out)]
  if todo:
    subprocess.run([_proto_reader(python), "-c", "import sys; from tensorflow.compiler.xla.service import hlo_pb2\n"
                    "for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):\n"
                    "  open(dst, 'wb').write(hlo_pb2.HloProto.FromString(open(src, 'rb').read())"
                    ".hlo_module.SerializeToString())", *todo],
                   check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  return [out.read_bytes() for out in outs]


def is_tokens(number, dtype, dims):
  """The train step's data inputs: MaxText's batch arrays (token ids, positions, segments) are int32 (batch, seq)."""
  return dtype == "s32" and len(dims) == 2


def sharded_cost(python, dump_dir, base_dump_dir=None):
  """Per-device dot FLOPs and collective bytes of the optimized train step, with the pass and without, and the
  targets' violations (issue 8: dot FLOPs <= 1.05x, collective bytes <= 1.10x apart from scalar all-reduces).
  `base_dump_dir`: where the run without the pass dumped, when not in `dump_dir`."""
  sys.path.insert(0, str(ROOT / "python"))
  from xla_fp4.sharding.cost import hlo_proto_cost
  dumps = []
  for fp4 in (False, True):
    where = hlo_dir(dump_dir if fp4 or base_dump_dir is None else base_dump_dir, fp4)
    paths = sorted(glob.glob(str(where / "*train_step*after_optimizations.hlo.pb")))
    if not paths:
      return None, [f"no optimized train step HLO dumped under {where}"]
    dumps.append(Path(paths[-1]))
  none, new = (hlo_proto_cost(proto, is_tokens) for proto in hlo_module_protos(python, dumps))
  by_kind = {k: dict(none=none.collective_bytes_by_kind[k], pass_=new.collective_bytes_by_kind[k],
                     ratio=round(new.collective_bytes_by_kind[k] / max(none.collective_bytes_by_kind[k], 1), 4))
             for k in new.collective_bytes_by_kind}
  out = dict(dot_flops_ratio=round(new.dot_flops / none.dot_flops, 4),
             collective_bytes_ratio=round(new.large_collective_bytes / max(none.large_collective_bytes, 1), 4),
             collective_bytes_by_kind=by_kind, packed_gemms=new.packed_gemms,
             collective_bytes=dict(none=none.collective_bytes, pass_=new.collective_bytes),
             scalar_collective_bytes_pass=new.scalar_collective_bytes,
             collectives=dict(none=none.collectives, pass_=new.collectives))
  bad = [f"{k} {out[k]} > {limit}" for k, limit in (("dot_flops_ratio", 1.05), ("collective_bytes_ratio", 1.10))
         if out[k] > limit]
  return out, bad


# |step-0 loss, sharded - one device| allowed with the pass. The step-0 loss is a forward pass (stochastic rounding
# only touches gradients), so the quantization is the same. Both runs turn off XLA's excess precision (bf16 values
# kept in f32 inside a fusion, on by default): where XLA fuses differs between one device and 8, and FP4 rounding turns
# those last-bit differences into flipped roundings. With it on, Gemma 3 (fsdp8) measured 0.016 (6.233 sharded, 6.217
# one device), and 0.000 with it off (6.220 both); without the pass both read 6.240. Measured with it off: gpt-oss
# and DeepSeek-V3 unscanned 0.000 and 0.001, whose experts run in a shard_map body (0.014 each with per-device
# scales there, before analysis/peers.py). Kernel calls whose layouts XLA was free to change gave 0.076 (fsdp8).
ONE_DEVICE_TOLERANCE = 0.01


def one_device_check(python, name, work):
  """Issue 8: a sharded step computes what one device does. The same global batch (HOST_DEVICES x MaxText's
  per-device batch) sharded and on one device, with the pass, one step each, without excess precision; ({losses},
  [violations])."""
  small = [f"per_device_batch_size={HOST_DEVICES}" if o == "per_device_batch_size=1" else o for o in SMALL]
  assert small != SMALL, "SMALL's per_device_batch_size changed: update one_device_check"
  runs = {}
  for layout, overrides in (("sharded", CONFIGS[name]), ("one_device", [o for o in CONFIGS[name]
                                                                         if not o.startswith("ici_")])):
    (work / f"dump_{layout}").mkdir()
    sharded = layout == "sharded"
    runs[layout] = train(python, f"{name}_{layout}", overrides, 1, True, work / f"dump_{layout}",
                         work / f"{layout}_exact.log", sharded=sharded, small=SMALL if sharded else small, exact=True)
    if runs[layout]["returncode"] != 0 or not runs[layout]["losses"]:
      return runs[layout], [f"the {layout} run without excess precision failed (see {runs[layout]['log']})"]
  sharded, one = runs["sharded"]["losses"][0], runs["one_device"]["losses"][0]
  gap = round(abs(sharded - one), 4)
  out = dict(step0_loss_sharded=sharded, step0_loss_one_device=one, gap=gap)
  return out, [f"step-0 loss sharded {sharded} vs one device {one}: gap {gap} > {ONE_DEVICE_TOLERANCE}"] \
      if gap > ONE_DEVICE_TOLERANCE else []


# Layer paths: a decoder layer (decoder/layers/..., layers_3, dense_layers_0, moe_layers, layers_remainder) and, in
# it, the experts of an MoE block (MaxText's names per family) and their router.
DECODER_LAYER = re.compile(r"decoder/\w*layers")
EXPERTS = re.compile(r"(^|/)(MoeBlock_\d+|moe_block|GptOssMlp|routed_experts)/")  # not DeepSeek's shared_experts
ROUTER = re.compile(r"/gate$")


def check_policy(dump_dir, fmt="nvfp4"):
  """The pass's decisions over every dumped train step, against the paper's policy in the format `fmt` (XLA_FP4_FORMAT);
  (summary, [violations])."""
  rows, num_blocks, found = [], set(), set()
  for path in sorted(glob.glob(str(dump_dir / "*.decisions.json"))):  # the format of xla_fp4/report.py
    payload = json.loads(Path(path).read_text())
    if "train_step" in payload["module"]:
      rows += [dict(r, module=payload["module"]) for r in payload["decisions"]]
      num_blocks.add(payload.get("num_blocks"))
      found.update(payload.get("blocks", ()))
  bad = []
  for r in rows:
    layer = r["layer"] or ""
    what = f"{r['module']} #{r['index']} {layer} {r['role']}: {r['decision']} ({r['reason']})"
    if "logits_dense" in layer and r["decision"] != "keep":
      bad.append("the logits head must stay in high precision: " + what)
    if r["role"] == "other" and r["decision"] != "keep":
      bad.append("attention products stay in high precision: " + what)
    # kept blocks, and GEMMs the kernels cannot take (an MoE router: one column per expert, fewer than 16)
    if DECODER_LAYER.search(layer) and r["role"] != "other" and r["decision"] == "keep" and \
        r["rule"] not in ("high_precision_block", "tiny", "contraction_not_16"):
      bad.append("decoder linear layers run in NVFP4: " + what)
    if EXPERTS.search(layer) and not ROUTER.search(layer) and r["decision"] == fmt and not r.get("groups"):
      bad.append("expert GEMMs take one decode scale per expert: " + what)
  if not any(r["rule"] == "head" for r in rows):
    bad.append("no dot kept as the output head (logits_dense, or the embedding where logits_via_embedding)")
  scanned = [r for r in rows if r["block"] == "scan" and r["decision"] == fmt]
  kept_blocks = sorted({r["block_offset"] + i * r["block_stride"] for r in scanned for i in r["keep_blocks"]} |
                       {r["block"] for r in rows if r["rule"] == "high_precision_block"})
  if len(num_blocks) != 1:
    bad.append(f"the train steps found different numbers of decoder layers: {sorted(num_blocks, key=str)}")
  elif not kept_blocks or max(num_blocks) - 1 not in kept_blocks:
    bad.append(f"the last of {max(num_blocks)} decoder layers is not kept in high precision (the paper keeps ~16%, "
               f"weighted to the end): kept {kept_blocks}; {sorted(found)}")
  total = sum(r["flops"] for r in rows)
  # A scanned dot's FLOPs cover every layer of the stack; its kept layers run the high-precision dot.
  fp4 = sum(r["flops"] * (1 - len(r["keep_blocks"]) / (r.get("num_stacked") or 1)) for r in rows
            if r["decision"] == fmt)
  experts = [r for r in rows if r.get("groups")]
  if experts and {r["role"] for r in experts if r["decision"] == fmt} != {"fprop", "dgrad", "wgrad"}:
    bad.append("expert GEMMs run in NVFP4 in all three roles: " + str(sorted({(r["layer"], r["role"], r["decision"])
                                                                            for r in experts})))
  summary = dict(dots=len(rows), nvfp4_dots=sum(r["decision"] == fmt for r in rows),
                 expert_dots=len(experts), expert_nvfp4_dots=sum(r["decision"] == fmt for r in experts),
                 nvfp4_flop_share=round(fp4 / total, 4) if total else 0.0, kept_blocks=kept_blocks,
                 num_blocks=max(num_blocks) if len(num_blocks) == 1 else sorted(num_blocks, key=str),
                 blocks_found=sorted(found),
                 head=sorted({f"{r['layer']} {r['role']}" for r in rows if r["rule"] == "head"}))
  return summary, bad


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS),
                 help="default: every configuration of MaxText's default model (not the families)")
  p.add_argument("--families", action="store_true",
                 help="every family of FAMILIES in every layout of FAMILY_LAYOUTS (24 configurations; the benchmark "
                      "tier's sweep, about an hour with --native)")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--work", type=Path, default=Path("/tmp/xla_fp4_maxtext"), help="logs, dumps, MaxText's output")
  p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "maxtext.json")
  p.add_argument("--native", action="store_true",
                 help="train the NVFP4 run with XLA_FP4_BACKEND=native (on CPU the C++ reference FP4 GEMM) and "
                      "with the emulate backend, both with nearest rounding: their losses must match (later steps "
                      "that differ, trained again with XLA's dots summed by Eigen), and sharded, the native step's "
                      "GEMMs run packed")
  p.add_argument("--format", default=None, choices=("nvfp4", "mxfp4", "mxfp8"),
                 help="train the quantized run with XLA_FP4_FORMAT (and check the policy's decisions in it)")
  p.add_argument("--setup-only", action="store_true",
                 help="build MaxText's venv and install this checkout into it, then exit (CI does this first, then runs "
                      "its two MaxText sections side by side)")
  p.add_argument("--telemetry", action="store_true",
                 help="train the NVFP4 run once more with XLA_FP4_TELEMETRY: same losses, records of every GEMM")
  args = p.parse_args(argv)
  if args.configs is None:
    args.configs = [c for c in CONFIGS if c not in FAMILY_CONFIGS] if not args.families else []
  if args.families:
    args.configs += [c for c in FAMILY_CONFIGS if c not in args.configs]
  python = setup()
  if args.setup_only:
    return 0
  results, failed = {}, []
  for name in args.configs:
    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    (work / "dump").mkdir(parents=True)
    sharded = name in SHARDED
    base = train(python, f"{name}_base", CONFIGS[name], args.steps, False, work / "dump", work / "base.log", sharded)
    nvfp4 = train(python, f"{name}_fp4", CONFIGS[name], args.steps, True, work / "dump", work / "fp4.log", sharded,
                  fmt=args.format)
    entry = dict(overrides=CONFIGS[name], baseline=base, nvfp4=nvfp4)
    ok = base["returncode"] == 0 and nvfp4["returncode"] == 0 and len(nvfp4["losses"]) == args.steps
    if ok:
      entry["decisions"], entry["policy_violations"] = check_policy(work / "dump", args.format or "nvfp4")
      if sharded:
        entry["per_device_cost"], bad = sharded_cost(python, work / "dump")
        entry["policy_violations"] += bad
        entry["one_device"], bad = one_device_check(python, name, work)
        entry["policy_violations"] += bad
      if args.native:
        entry["native"], bad = native_run(python, name, work, args.steps, sharded, args.format)
        entry["policy_violations"] += bad
      if args.telemetry:
        entry["telemetry"], bad = telemetry_run(python, name, nvfp4, work, args.steps, sharded)
        entry["policy_violations"] += bad
      entry["loss_gap_last"] = round(nvfp4["losses"][-1] - base["losses"][-1], 4)
      entry["step_time_ratio"] = round(nvfp4["step_s"] / base["step_s"], 3) if base["step_s"] else None
      ok = not entry["policy_violations"] and not nvfp4["warnings"]
    entry["ok"] = ok
    results[name] = entry
    if not ok:
      failed.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}: loss {base['losses'][-1:]} -> {nvfp4['losses'][-1:]}, "
          f"step {base['step_s']} -> {nvfp4['step_s']} s, {entry.get('decisions')}, "
          f"violations {entry.get('policy_violations', [])[:3]}, warnings {nvfp4['warnings'][:2]}", flush=True)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  summary = dict(maxtext=MAXTEXT, steps=args.steps, small=SMALL, format=args.format or "nvfp4", results=results)
  args.out.write_text(json.dumps(summary, indent=1) + "\n")
  print(f"wrote {args.out}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
