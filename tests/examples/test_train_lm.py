"""examples/train_lm.py at a tiny size: baseline in-process, and XLA_FP4=1 in a subprocess (the
plugin reads its environment once per process)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # noqa: E402

# Its module fixture takes a while (a measurement or a compile): every test of this file runs on one worker (./dev
# passes --dist loadgroup), so the fixture runs once, not once per worker.
pytestmark = pytest.mark.xdist_group(__name__)

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


def test_data_is_deterministic():
    data = train_lm.load_corpus("shakespeare")
    train, val = train_lm.split_corpus(data)
    assert len(train) + len(val) == len(data) and len(val) == int(0.1 * len(data))
    draw = lambda: train_lm.sample_batch(train, np.random.default_rng(3), 4, 32)
    assert (draw() == draw()).all()
    assert draw().shape == (4, 33)
    a, b = train_lm.eval_batches(val, 2, 4, 32), train_lm.eval_batches(val, 2, 4, 32)
    assert all((x == y).all() for x, y in zip(a, b))


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


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nvfp4")
    dump_dir, out = tmp / "dumps", tmp / "nvfp4.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
    env.update(XLA_FP4="1", XLA_FP4_DUMP_DIR=str(dump_dir), XLA_FP4_STRICT="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_lm.py"), *TINY, "--out", str(out)],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from xla_fp4 import report

    rows = [r for r in report.load_decisions(str(dump_dir)) if "train_step" in r["module"]]
    return json.loads(out.read_text()), rows, dump_dir


def _nvfp4_roles(rows, layer_suffix):
    return {r["role"] for r in rows if r["decision"] == "nvfp4" and (r["layer"] or "").endswith(layer_suffix)}


def test_nvfp4_learns(baseline, nvfp4):
    result, rows, dump_dir = nvfp4
    check_learns(result)
    from xla_fp4 import report

    assert {"fprop", "dgrad"} <= _nvfp4_roles(rows, "block_0/mlp/fc1"), rows
    assert 0 < report.nvfp4_flop_share(str(dump_dir), module_filter="train_step") < 1
    # NVFP4 numerics change the losses, but only a little at this size.
    assert result["train_loss"] != baseline["train_loss"]
    assert abs(result["final_val_loss"] - baseline["final_val_loss"]) < 0.25 * baseline["final_val_loss"]


def test_nvfp4_covers_wgrad(nvfp4):
    """Every GEMM of an MLP layer of the first block runs in NVFP4 (2 blocks: none is kept by default)."""
    _, rows, _ = nvfp4
    assert _nvfp4_roles(rows, "block_0/mlp/fc1") == {"fprop", "dgrad", "wgrad"}
