"""examples/train_lm.py at a tiny size: baseline in-process, and XLA_FP4=1 in a subprocess (the
plugin reads its environment once per process)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # noqa: E402

# 2 blocks of d_model 32 (every GEMM dimension a multiple of 16, so NVFP4 applies), 12 steps.
TINY = ["--steps", "12", "--batch", "8", "--seq", "32", "--d-model", "32", "--layers", "2", "--heads", "2",
        "--lr", "1e-2", "--eval-every", "6", "--eval-batches", "2", "--no-progress"]


def check_learns(result: dict) -> None:
    losses = result["train_loss"]
    assert result["completed_steps"] == 12
    assert all(math.isfinite(x) for x in losses), losses
    # From ~ln(256) = 5.55 (uniform over bytes) it drops fast once the byte frequencies are learnt.
    assert losses[0] > 5.0
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    vals = [v["loss"] for v in result["val_loss"]]
    assert [v["step"] for v in result["val_loss"]] == [6, 12]
    assert all(math.isfinite(v) for v in vals) and vals[-1] < 5.0, vals
    assert result["mean_step_time_s"] > 0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "baseline.json"
    train_lm.main(TINY + ["--out", str(out)])
    return json.loads(out.read_text())


def test_baseline_learns(baseline):
    check_learns(baseline)
    assert baseline["config"]["n_params"] > 0
    assert baseline["config"]["val_bytes"] * 9 == pytest.approx(baseline["config"]["train_bytes"], rel=1e-3)


def test_deterministic(baseline, tmp_path):
    out = tmp_path / "again.json"
    train_lm.main(TINY + ["--steps", "3", "--eval-every", "3", "--out", str(out)])
    assert json.loads(out.read_text())["train_loss"] == baseline["train_loss"][:3]


def test_module_names():
    """The pass finds layers by these names in the JAX name stack."""
    import jax
    import jax.numpy as jnp

    args = train_lm.parse_args(TINY)
    cfg = train_lm.ModelConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                               d_ff=args.d_ff)
    params = jax.eval_shape(train_lm.GPT(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))
    params = params["params"]
    assert set(params) == {"embed", "pos_embed", "block_0", "block_1", "ln_f", "head"}
    assert set(params["block_0"]) == {"ln1", "attn", "ln2", "mlp"}
    assert set(params["block_0"]["attn"]) == {"qkv", "out"}
    assert set(params["block_0"]["mlp"]) == {"fc1", "fc2"}
    tied = train_lm.GPT(cfg.__class__(**{**cfg.__dict__, "tied_head": True}))
    assert "head" not in jax.eval_shape(tied.init, jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))["params"]


def test_nvfp4_learns(baseline, tmp_path):
    dump_dir, out = tmp_path / "dumps", tmp_path / "nvfp4.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
    env.update(XLA_FP4="1", XLA_FP4_DUMP_DIR=str(dump_dir), XLA_FP4_STRICT="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_lm.py"), *TINY, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    check_learns(result)

    from xla_fp4 import report

    rows = [r for r in report.load_decisions(str(dump_dir)) if "train_step" in r["module"]]
    fc1_roles = {r["role"] for r in rows
                 if r["decision"] == "nvfp4" and (r["layer"] or "").endswith("block_0/mlp/fc1")}
    # Every GEMM of an MLP layer in the first block runs in NVFP4 (2 blocks: none is kept by default).
    assert fc1_roles == {"fprop", "dgrad", "wgrad"}, [(r["layer"], r["role"], r["decision"]) for r in rows]
    assert 0 < report.nvfp4_flop_share(str(dump_dir), module_filter="train_step") < 1
    # NVFP4 numerics change the losses, but only a little at this size.
    assert result["train_loss"] != baseline["train_loss"]
    assert abs(result["final_val_loss"] - baseline["final_val_loss"]) < 0.25 * baseline["final_val_loss"]
