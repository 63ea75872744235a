"""A small zoo of training steps for the analysis tests: each builder returns (train_step_fn, args).

Shapes are tiny (contraction dims 32/64) and parameters and optimizer states are abstract (jax.eval_shape: eager
initialisation costs far more than lowering), so that lowering the whole matrix stays fast on 2 CPU cores. Every step is
loss -> jax.grad (-> an optax update where noted), the program shape the pass sees in real training.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

B, S, D, H, F, V = 4, 8, 32, 64, 64, 64  # batch, sequence, model dim, hidden (MLP), FFN dim, vocab
HEADS, HEAD_DIM = 2, 16


def _x(shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)


def _tokens():
  return jnp.asarray(np.random.default_rng(1).integers(0, V, (B, S)), jnp.int32)


def _grad_of(loss):
  """jax.grad(loss), with the loss attached (`.loss`) for the tests that train with it."""
  grad = jax.grad(loss)
  grad.loss = loss
  return grad


def _sgd_step(loss_fn):
  opt = optax.sgd(1e-2)

  def step(params, opt_state, *batch):
    grads = jax.grad(loss_fn)(params, *batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step, lambda params: jax.eval_shape(opt.init, params)


# ---------------------------------------------------------------------------------------------------------- linen


class LinenMLP(nn.Module):
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(H, dtype=self.dtype, name="fc1")(x))
    x = nn.relu(nn.Dense(H, dtype=self.dtype, name="fc2")(x))
    return nn.Dense(D, dtype=self.dtype, name="head")(x)


def linen_mlp(dtype=jnp.float32):
  model = LinenMLP(dtype=dtype)
  x = _x((B, D), dtype)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(p, x):
    return jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), x)


class LinenBlock(nn.Module):
  """Pre-norm transformer block: q/k/v/o projections, attention QK^T and scores.V, MLP fc1/fc2."""
  general: bool = False  # DenseGeneral projections (per-head kernels) instead of Dense

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln1")(x)
    if self.general:
      q, k, v = (nn.DenseGeneral((HEADS, HEAD_DIM), name=n)(h) for n in ("q", "k", "v"))
    else:
      q, k, v = (nn.Dense(HEADS * HEAD_DIM, name=n)(h).reshape(B, S, HEADS, HEAD_DIM) for n in ("q", "k", "v"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    if self.general:
      o = nn.DenseGeneral(D, axis=(-2, -1), name="o")(a)
    else:
      o = nn.Dense(D, name="o")(a.reshape(B, S, HEADS * HEAD_DIM))
    x = x + o
    h = nn.LayerNorm(name="ln2")(x)
    return x + nn.Dense(D, name="fc2")(nn.gelu(nn.Dense(F, name="fc1")(h)))


class LinenScanBlock(LinenBlock):

  @nn.compact
  def __call__(self, x, _):
    return super().__call__(x), None


class LinenTransformer(nn.Module):
  num_blocks: int = 3
  mode: str = "plain"  # plain | remat | scan
  general: bool = False
  tied: bool = False  # logits = x @ embedding.T (nn.Embed.attend) instead of a separate head

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(V, D, name="embed")
    x = embed(tokens)
    if self.mode == "scan":
      stack = nn.scan(nn.remat(LinenScanBlock), variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.num_blocks)
      x, _ = stack(general=self.general, name="blocks")(x, None)
    else:
      cls = nn.remat(LinenBlock) if self.mode == "remat" else LinenBlock
      for i in range(self.num_blocks):
        x = cls(general=self.general, name=f"block_{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    return embed.attend(x) if self.tied else nn.Dense(V, name="head")(x)


def _lm_step(apply, params):
  tokens = _tokens()

  def loss(p, tokens):
    logits = apply(p, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), tokens)


def linen_transformer(mode="plain", general=False, tied=False, num_blocks=3):
  model = LinenTransformer(num_blocks=num_blocks, mode=mode, general=general, tied=tied)
  params = jax.eval_shape(model.init, jax.random.key(0), _tokens())
  return _lm_step(model.apply, params)


# ------------------------------------------------------------------------------------------------------------ NNX


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.fc1 = nnx.Linear(D, H, rngs=rngs)
    self.fc2 = nnx.Linear(H, H, rngs=rngs)
    self.head = nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x):
    with jax.named_scope("trunk"):  # named scopes reach the locations (NNX module names do not)
      x = nnx.relu(self.fc2(nnx.relu(self.fc1(x))))
    return self.head(x)


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.q = nnx.Linear(D, HEADS * HEAD_DIM, rngs=rngs)
    self.k = nnx.Linear(D, HEADS * HEAD_DIM, rngs=rngs)
    self.v = nnx.Linear(D, HEADS * HEAD_DIM, rngs=rngs)
    self.o = nnx.Linear(HEADS * HEAD_DIM, D, rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x):
    h = self.ln1(x)
    q, k, v = (p(h).reshape(B, S, HEADS, HEAD_DIM) for p in (self.q, self.k, self.v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    x = x + self.o(a.reshape(B, S, HEADS * HEAD_DIM))
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class NnxTransformer(nnx.Module):

  def __init__(self, num_blocks, mode, rngs):
    self.mode = mode
    self.embed = nnx.Embed(V, D, rngs=rngs)
    if mode == "scan":  # the documented scan-over-layers pattern: nnx.vmap to create, nnx.scan to apply
      @nnx.split_rngs(splits=num_blocks)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return NnxBlock(rngs)

      self.layers = make(rngs)
    else:
      self.layers = nnx.List([NnxBlock(rngs) for _ in range(num_blocks)])
    self.ln_f = nnx.LayerNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    if self.mode == "scan":
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def body(x, layer):
        return layer(x)

      x = body(x, self.layers)
    else:
      for layer in self.layers:
        x = nnx.remat(lambda m, x: m(x))(layer, x) if self.mode == "remat" else layer(x)
    return self.head(self.ln_f(x))


def _nnx_step(model, loss):
  """The functional NNX training step (graphdef + state through jax.jit/jax.grad), with an optax update."""
  graphdef, state = nnx.split(model)
  opt = optax.sgd(1e-2)

  def step(state, opt_state, *batch):
    def l(state):
      return loss(nnx.merge(graphdef, state), *batch)
    grads = jax.grad(l)(state)
    updates, opt_state = opt.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state

  return step, (state, jax.eval_shape(opt.init, state))


def nnx_mlp():
  x = _x((B, D))
  step, args = _nnx_step(nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0))), lambda m, x: jnp.mean(m(x) ** 2))
  return step, args + (x,)


def nnx_transformer(mode="plain", num_blocks=3):
  def loss(m, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()
  step, args = _nnx_step(nnx.eval_shape(lambda: NnxTransformer(num_blocks, mode, nnx.Rngs(0))), loss)
  return step, args + (_tokens(),)


# ------------------------------------------------------------------------------------------------------ plain JAX


def _dense_params(sizes, dtype=jnp.float32):
  rng = np.random.default_rng(2)
  return {f"layer_{i}": {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), dtype),
                         "b": jnp.zeros((b,), dtype)}
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def jax_mlp(dtype=jnp.float32):
  params = _dense_params([D, H, H, D], dtype)
  x = _x((B, D), dtype)

  def loss(p, x):
    for i in range(3):
      x = x @ p[f"layer_{i}"]["w"] + p[f"layer_{i}"]["b"]
      x = jax.nn.relu(x) if i < 2 else x
    return jnp.mean(x.astype(jnp.float32) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), x)


def jax_scan_mlp(checkpoint=False, num_layers=4, batch=B):
  rng = np.random.default_rng(3)
  params = {"layers": {"w1": jnp.asarray(rng.standard_normal((num_layers, D, H)) / 8, jnp.float32),
                       "w2": jnp.asarray(rng.standard_normal((num_layers, H, D)) / 8, jnp.float32)}}
  x = _x((batch, D))

  def layer(x, w):
    return x + jax.nn.relu(x @ w["w1"]) @ w["w2"], None

  body = jax.checkpoint(layer) if checkpoint else layer

  def loss(p, x):
    x, _ = jax.lax.scan(body, x, p["layers"])
    return jnp.mean(x ** 2)

  return _grad_of(loss), (params, x)


def jax_nested_scan(groups=3, per_group=2):
  """A scan over groups of a scan over layers (weights stacked [groups, layers, ...])."""
  rng = np.random.default_rng(5)
  params = {"layers": {"w": jnp.asarray(rng.standard_normal((groups, per_group, D, D)) / 8, jnp.float32)}}
  x = _x((B, D))

  def inner(x, w):
    return jnp.tanh(x @ w["w"]), None

  def outer(x, w):
    return jax.lax.scan(inner, x, w)[0], None

  def loss(p, x):
    return jnp.mean(jax.lax.scan(outer, x, p["layers"])[0] ** 2)

  return jax.grad(loss), (params, x)


def jax_nested_jit():
  params = _dense_params([D, D, D])  # two layers of one shape: repeated subtrees, i.e. blocks
  x = _x((B, D))

  @jax.jit
  def dense(w, b, x):
    return x @ w + b

  def loss(p, x):
    x = jax.nn.relu(dense(p["layer_0"]["w"], p["layer_0"]["b"], x))
    return jnp.mean(dense(p["layer_1"]["w"], p["layer_1"]["b"], x) ** 2)

  return jax.jit(jax.grad(loss)), (params, x)


@jax.custom_vjp
def _custom_dense(x, w):
  return x @ w


def _custom_dense_fwd(x, w):
  return x @ w, (x, w)


def _custom_dense_bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g  # a hand-written backward


_custom_dense.defvjp(_custom_dense_fwd, _custom_dense_bwd)


def jax_custom_vjp():
  params = _dense_params([D, H, D])
  x = _x((B, D))

  def loss(p, x):
    x = jax.nn.relu(_custom_dense(x, p["layer_0"]["w"]))
    return jnp.mean(_custom_dense(x, p["layer_1"]["w"]) ** 2)

  return jax.grad(loss), (params, x)


def jax_einsum(experts=2):
  """einsum layers: per-head projections (several contracting dims) and per-expert weights (dot_general batch dims)."""
  rng = np.random.default_rng(4)
  params = {"wq": jnp.asarray(rng.standard_normal((D, HEADS, HEAD_DIM)) / 8, jnp.float32),
            "wo": jnp.asarray(rng.standard_normal((HEADS, HEAD_DIM, D)) / 8, jnp.float32),
            "experts": jnp.asarray(rng.standard_normal((experts, D, F)) / 8, jnp.float32)}
  x = _x((B, S, D))

  def loss(p, x):
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    y = jnp.einsum("bshk,hkd->bsd", jnp.tanh(q), p["wo"])
    e = jnp.einsum("etd,edf->etf", y.reshape(experts, B * S // experts, D), p["experts"])
    return jnp.mean(e ** 2)

  return _grad_of(loss), (params, x)


def jax_shard_map():
  """A data-parallel MLP under shard_map over all (forced host) devices; needs >= 2 devices to be meaningful."""
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("data",))
  params = _dense_params([D, D, D])  # two layers of one shape: repeated subtrees, i.e. blocks
  x = _x((len(jax.devices()) * B, D))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  def grads(p, x):
    def loss(p, x):
      return jnp.mean((jax.nn.relu(x @ p["layer_0"]["w"]) @ p["layer_1"]["w"]) ** 2)
    return jax.lax.pmean(jax.grad(loss)(p, x), "data")

  return grads, (params, x)


# ------------------------------------------------------------------ probes: names that mislead, structure that does not


class ProbeClassifier(nn.Module):
  """A ViT-like classifier whose layer names mislead: `patch_embed` and `multihead_<i>` are no heads, `mlp_h_0` is no
  block (one numbered module), and the real head is named `classifier`."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="patch_embed")(x)
    for i in range(2):
      h = nn.LayerNorm(name=f"ln_{i}")(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name=f"multihead_{i}")(h, h)
    x = x + nn.Dense(D, name="mlp_h_0")(nn.gelu(x))
    return nn.Dense(V, name="classifier")(x.mean(1))


def probe_classifier():
  model = ProbeClassifier()
  x = _x((B, S, H))
  labels = jnp.asarray(np.random.default_rng(4).integers(0, V, (B,)), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(p, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), labels).mean()

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), x, labels)


class ProbeEncoderDecoder(nn.Module):
  """An encoder and a decoder of `n` blocks each (encoder/layers_<i>, decoder/layers_<i>): 2n blocks, the decoder's
  last the network's last."""
  n: int = 6

  @nn.compact
  def __call__(self, x):
    def stack(name, x):
      for i in range(self.n):
        x = x + nn.Dense(D, name=f"{name}/layers_{i}/fc2")(nn.gelu(nn.Dense(F, name=f"{name}/layers_{i}/fc1")(x)))
      return x
    return nn.Dense(V, name="out")(stack("decoder", stack("encoder", x)))


def probe_encoder_decoder():
  model = ProbeEncoderDecoder()
  x = _x((B, S, D))
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  labels = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, S)), jnp.int32)

  def loss(p, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), labels).mean()

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), x, labels)


def probe_shared_helper(layers=8):
  """One jitted `dense` applied to every layer: JAX emits one function with a call site per layer."""
  params = [jnp.asarray(np.random.default_rng(10 + i).standard_normal((D, D)) / 8, jnp.float32) for i in range(layers)]

  @jax.jit
  def dense(w, x):
    return x @ w

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(dense(w, x))
    return jnp.mean(x ** 2)

  return jax.jit(jax.grad(loss)), (params, _x((B * S, D)))


def probe_activation_product():
  """One jitted `mm` for a linear layer (x @ w, h @ w) and for a product of two activations (h @ h.T)."""
  @jax.jit
  def mm(a, b):
    return a @ b

  def loss(w, x):
    h = jnp.tanh(mm(x, w))
    return jnp.mean(mm(h, h.T) ** 2) + jnp.mean(mm(h, w) ** 2)

  w = jnp.asarray(np.random.default_rng(20).standard_normal((D, D)) / 8, jnp.float32)
  return jax.jit(jax.grad(loss)), (w, _x((B * S, D)))


def probe_gradient_penalty():
  """A loss with a gradient in it (d f / d x, as in WGAN-GP): higher-order differentiation."""
  def f(w1, w2, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))

  def loss(p, x):
    gx = jax.grad(f, argnums=2)(p[0], p[1], x)
    return f(p[0], p[1], x) + jnp.mean(gx ** 2)

  r = np.random.default_rng(30)
  p = tuple(jnp.asarray(r.standard_normal((D, D)) / 8, jnp.float32) for _ in range(2))
  return jax.jit(jax.grad(loss)), (p, _x((B * S, D)))


# ------------------------------------------------------------------------ third party: layers that ship in Equinox


def equinox_attention_mlp():
  """Equinox's own MultiheadAttention and MLP (eqx.nn, a PyPI package no one here wrote), the first layer fed the raw
  input, the weight on the left (W @ x under vmap), parameters as an eqx.partition pytree."""
  import equinox as eqx
  key = jax.random.key(0)
  model = (eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=D, key=key),
           eqx.nn.MLP(in_size=D, out_size=D, width_size=D, depth=4, activation=jax.nn.gelu, key=key))
  params, static = eqx.partition(model, eqx.is_array)

  def loss(p, x):
    attn, mlp = eqx.combine(p, static)
    return jnp.mean(jax.vmap(mlp)(x + attn(x, x, x)) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), _x((S * 2, D)))


# ----------------------------------------------------------------------------- programs that are not training steps


def linen_mlp_eval(dtype=jnp.float32):
  """The MLP's eval step: a forward pass to the logits, no gradient."""
  model = LinenMLP(dtype=dtype)
  x = _x((B, D), dtype)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return (lambda p, x: model.apply(p, x)), (params, x)


def matmul():
  """What an eager `a @ b` (or jax.jit(jnp.matmul)) compiles: one dot of two arguments."""
  return jnp.matmul, (_x((D, H)), _x((H, D)))


# ------------------------------------------------------------------------------------------------------------ MoE


def ragged_moe(group_sizes=(16, 8, 24, 16)):
  """A top-1 MoE layer written with jax.lax.ragged_dot (tokens sorted by expert, one group per expert), trained: on
  CPU JAX expands each ragged dot into masked dot_generals (analysis/ragged.py)."""
  experts, tokens = len(group_sizes), sum(group_sizes)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  params = {"router": jax.ShapeDtypeStruct((D, experts), jnp.float32),
            "w_in": jax.ShapeDtypeStruct((experts, D, H), jnp.float32),
            "w_out": jax.ShapeDtypeStruct((experts, H, D), jnp.float32)}

  def loss(p, x):
    gate = jax.nn.sigmoid(jnp.max(x @ p["router"], axis=-1, keepdims=True))
    h = jax.nn.gelu(jax.lax.ragged_dot(x, p["w_in"], sizes))
    return jnp.mean((gate * jax.lax.ragged_dot(h, p["w_out"], sizes)) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), _x((tokens, D)))


def ragged_glu_moe(group_sizes=(16, 8, 24, 16)):
  """A gated MoE layer as MaxText's sparse path writes it: one helper runs every expert GEMM (`gmm`), called for the
  gate and up projections with weights of one shape, and for the down projection, behind a dense input layer (so
  the experts' inputs take a gradient: every expert GEMM has its dgrad). On CPU JAX lowers the helper's ragged dot
  once per signature and reuses it with the first call's source frames (analysis/roles.py)."""
  experts, tokens = len(group_sizes), sum(group_sizes)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  params = {"embed": jax.ShapeDtypeStruct((D, D), jnp.float32),
            "wi_0": jax.ShapeDtypeStruct((experts, D, H), jnp.float32),
            "wi_1": jax.ShapeDtypeStruct((experts, D, H), jnp.float32),
            "wo": jax.ShapeDtypeStruct((experts, H, D), jnp.float32),
            "head": jax.ShapeDtypeStruct((D, D), jnp.float32)}

  def gmm(x, w):
    return jax.lax.ragged_dot(x, w, sizes)

  def loss(p, x):
    x = jnp.tanh(x @ p["embed"])
    h = jax.nn.silu(gmm(x, p["wi_0"])) * gmm(x, p["wi_1"])
    return jnp.mean((gmm(h, p["wo"]) @ p["head"]) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), _x((tokens, D)))


def dense_moe(experts=4):
  """A gated MoE layer as MaxText's dense path writes it (`sparse_matmul=false`): every token meets every expert, the
  up projections `BSM,EMH->BSEH` have the expert as a free dim of their weights, the down projection `BSEH,EHM->BSEM`
  as a batch dim, and the router's weights combine the experts' outputs; behind a dense input layer, so that every
  expert GEMM has its dgrad."""
  b, s = 2, 16
  params = {"embed": jax.ShapeDtypeStruct((D, D), jnp.float32),
            "router": jax.ShapeDtypeStruct((D, experts), jnp.float32),
            "wi_0": jax.ShapeDtypeStruct((experts, D, H), jnp.float32),
            "wi_1": jax.ShapeDtypeStruct((experts, D, H), jnp.float32),
            "wo": jax.ShapeDtypeStruct((experts, H, D), jnp.float32),
            "head": jax.ShapeDtypeStruct((D, D), jnp.float32)}

  def loss(p, x):
    x = jnp.tanh(x @ p["embed"])
    weights = jax.nn.softmax(jnp.einsum("BSM,ME->BSE", x, p["router"]), axis=-1)
    h = jax.nn.silu(jnp.einsum("BSM,EMH->BSEH", x, p["wi_0"])) * jnp.einsum("BSM,EMH->BSEH", x, p["wi_1"])
    y = jnp.einsum("BSEM,BSE->BSM", jnp.einsum("BSEH,EHM->BSEM", h, p["wo"]), weights)
    return jnp.mean((y @ p["head"]) ** 2)

  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), _x((b, s, D)))


# ------------------------------------------------------------------ parameters without names, name scopes of Haiku


def nnx_transformer_nnx_jit(num_blocks=3, mode="plain"):
  """The NNX transformer trained as Flax's documentation teaches: nnx.jit over the model and an nnx.Optimizer. nnx.jit
  passes the graph state as flat lists of leaves (`model.states[0][23]`): the parameter paths name no modules."""
  model = NnxTransformer(num_blocks, mode, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()
    grads = nnx.grad(loss)(model)
    optimizer.update(model, grads)

  return step, (model, optimizer, _tokens())


def flat_jax_transformer(num_blocks=3):
  """A plain-JAX transformer whose parameters reach the jit as one flat tuple (jax.tree.leaves): no names at all."""
  def block_params(k):
    keys = jax.random.split(k, 6)
    shapes = [(D, D), (D, D), (D, D), (D, D), (D, F), (F, D)]
    return [jax.random.normal(kk, s) * 0.1 for kk, s in zip(keys, shapes)]
  blocks = [block_params(k) for k in jax.random.split(jax.random.key(0), num_blocks)]
  leaves = tuple(w for b in blocks for w in b) + (jax.random.normal(jax.random.key(1), (D, V)) * 0.1,)

  def loss(leaves, x):
    for b in range(num_blocks):
      q, k, v, o, fc1, fc2 = leaves[6 * b:6 * b + 6]
      s = jax.nn.softmax((x @ q) @ (x @ k).T / np.sqrt(D), axis=-1)
      x = x + (s @ (x @ v)) @ o
      x = x + jax.nn.gelu(x @ fc1) @ fc2
    return jnp.mean((x @ leaves[-1]) ** 2)

  return jax.grad(loss), (leaves, _x((S * 2, D)))


def _haiku_step(net):
  """(an SGD step of mean(net(x)²), its args) for a Haiku network function `net`."""
  import haiku as hk
  f = hk.without_apply_rng(hk.transform(net))
  x = _x((S * 2, D))
  params = jax.eval_shape(f.init, jax.random.key(0), x)
  step, opt_init = _sgd_step(lambda p, x: jnp.mean(f.apply(p, x) ** 2))
  return step, (params, opt_init(params), x)


def haiku_name_scopes(num_blocks=3):
  """Haiku modules under hk.experimental.name_scope: the scope is in the parameter path (`block_1/query`), not in
  the name stack."""
  import haiku as hk

  def net(x):
    for i in range(num_blocks):
      with hk.experimental.name_scope(f"block_{i}"):
        h = jax.nn.relu(hk.Linear(H, name="fc1")(x))
        x = x + hk.Linear(D, name="fc2")(h)
    return hk.Linear(V, name="head")(x)

  return _haiku_step(net)


def haiku_mlp_blocks(num_blocks=3):
  """Haiku's own hk.nets.MLP inside named blocks: its layers are `block_1/mlp/~/linear_0` in the parameters, but the
  name stack says `mlp/linear_0` in every block."""
  import haiku as hk

  def net(x):
    for i in range(num_blocks):
      with hk.experimental.name_scope(f"block_{i}"):
        x = x + hk.nets.MLP([H, D], name="mlp")(hk.Linear(D, name="attn")(x))
    return hk.Linear(V, name="head")(x)

  return _haiku_step(net)


def linen_checkpointed_blocks(num_blocks=3):
  """One linen block applied under jax.checkpoint to each of params['blocks'][i]: the name stack says `Block/fc1` in
  every block; only the parameter path numbers it."""
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(D, name="fc2")(jax.nn.relu(nn.Dense(H, name="fc1")(x)))

  block, head = Block(), nn.Dense(V)
  x = _x((S * 2, D))
  params = {"blocks": [jax.eval_shape(block.init, jax.random.key(i), x) for i in range(num_blocks)],
            "head": jax.eval_shape(head.init, jax.random.key(9), x)}

  def loss(p, x):
    for i in range(num_blocks):
      x = jax.checkpoint(block.apply)(p["blocks"][i], x)
    return jnp.mean(head.apply(p["head"], x) ** 2)
  step, opt_init = _sgd_step(loss)
  return step, (params, opt_init(params), x)


def equinox_blocks(num_blocks=3):
  """Equinox modules of blocks (Linear D->H, H->D) and a head, trained under eqx.filter_jit: the parameters reach the
  program as leaves (`first/4`), biases between the weights."""
  import equinox as eqx

  class Block(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.fc1, self.fc2 = eqx.nn.Linear(D, H, key=k1), eqx.nn.Linear(H, D, key=k2)

    def __call__(self, x):
      return x + self.fc2(jax.nn.relu(self.fc1(x)))

  class Net(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, num_blocks + 1)
      self.blocks = [Block(k) for k in keys[:-1]]
      self.head = eqx.nn.Linear(D, V, key=keys[-1])

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return self.head(x)

  step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)))
  return step, (Net(jax.random.key(0)), _x((S * 2, D)))


def penzai_llamalike(num_blocks=5):
  """penzai's llama-like transformer with its parameters unbound to one flat tuple (pz.unbind_params), as penzai's
  training recipes pass them: leaf positions for names, and name stacks that number leaves too."""
  from penzai import pz
  from penzai.models.transformer.variants import llamalike_common
  cfg = llamalike_common.LlamalikeTransformerConfig(
      num_kv_heads=2, query_head_multiplier=1, embedding_dim=D, projection_dim=HEAD_DIM, mlp_hidden_dim=F,
      num_decoder_blocks=num_blocks, vocab_size=V, mlp_variant="swiglu", tie_embedder_and_logits=False)
  model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
  unbound, params = pz.unbind_params(model)
  values = tuple(p.value for p in params)

  def loss(values, tokens):
    bound = pz.bind_variables(unbound, tuple(pz.Parameter(value=v, label=p.label) for p, v in zip(params, values)))
    return jnp.mean(bound(tokens).unwrap("batch", "seq", "vocabulary") ** 2)

  return jax.grad(loss), (values, pz.nx.wrap(_tokens()).tag("batch", "seq"))
