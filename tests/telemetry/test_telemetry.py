"""Telemetry (the `telemetry` option): the statistics the probes record, bound to a recomputation from
xla_fp4.numerics; what they change (nothing); steps, blocks, shards, alerts, strict mode and the command line."""

import collections
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_fp4
from nvfp4_testing import assert_same_bits, extension_or_skip, run_on_cpu
from xla_fp4 import config
from xla_fp4 import numerics as nv
from xla_fp4 import state
from xla_fp4 import telemetry
from xla_fp4.numerics import rht as rht_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _fresh():
  extension_or_skip()
  with state.use(state.State()):
    yield
  xla_fp4.disable()


def _linear_step(scale=1.0):
  """grad of sum(tanh(x @ w) * t) * scale over (w, x): one linear layer's fprop, dgrad and wgrad."""
  def loss(w, x, t):
    return jnp.sum(jnp.tanh(x @ w) * t) * scale
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _data(m=64, k=128, n=64, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(keys[0], (k, n)) * 0.05, jax.random.normal(keys[1], (m, k)),
          jax.random.normal(keys[2], (m, n)))


def _run(tmp_path, fn, args, steps=1, **options):
  """fn(*args) `steps` times with telemetry into tmp_path (a single linear layer is the output head: not kept here)."""
  xla_fp4.enable(telemetry=str(tmp_path), **{"keep_head": False, **options})
  out = None
  for _ in range(steps):
    out = jax.block_until_ready(fn(*args))
  telemetry.flush()
  return out, telemetry.load(str(tmp_path))


def _expected(x, axis, block_2d, rht=False):
  """The statistics recomputed from xla_fp4.numerics (quantize, dequantize) and numpy."""
  x = np.asarray(x, np.float32)
  if rht:
    x = np.asarray(rht_mod.random_hadamard_transform(jnp.asarray(x), axis=axis, seed=0))
  d = np.asarray(nv.dequantize(nv.quantize(jnp.asarray(x), axis=axis, block_2d=block_2d)))
  nonzero = x != 0
  return dict(amax=np.abs(x).max(), underflow=(nonzero & (d == 0)).sum() / nonzero.sum(),
              snr_db=10 * math.log10((x.astype(np.float64) ** 2).sum() / ((x - d).astype(np.float64) ** 2).sum()))


def _one(records, role, operand, **match):
  found = [r for r in records if r["role"] == role and r["operand"] == operand
           and all(r[k] == v for k, v in match.items())]
  assert len(found) == 1, (role, operand, found)
  return found[0]


def test_statistics_equal_a_recomputation_from_numerics(tmp_path):
  w, x, t = _data()
  _, records = _run(tmp_path, _linear_step(), (w, x, t))
  assert {(r["role"], r["operand"]) for r in records} == {
      ("fprop", "activation"), ("fprop", "weight"), ("dgrad", "gradient"), ("dgrad", "weight"),
      ("wgrad", "activation"), ("wgrad", "gradient")}
  checks = [(("fprop", "activation"), _expected(x, 1, False)),
            (("fprop", "weight"), _expected(w, 0, True)),
            (("dgrad", "weight"), _expected(w, 0, True)),  # the fprop's 16x16 tiles, read along N
            (("wgrad", "activation"), _expected(x, 0, False, rht=True))]  # RHT along the tokens, nearest
  for (role, operand), want in checks:
    got = _one(records, role, operand)
    assert got["amax"] == pytest.approx(float(want["amax"]), rel=1e-6), (role, operand)
    assert got["underflow"] == pytest.approx(float(want["underflow"]), abs=1e-9), (role, operand)
    assert got["snr_db"] == pytest.approx(want["snr_db"], rel=1e-4), (role, operand)
    assert got["s_dec"] == pytest.approx(float(want["amax"]) / 2688, rel=1e-6)
    assert not got["all_zero"] and got["scale_underflow"] == 0 and got["scale_saturated"] == 0
  for r in records:
    assert r["step"] == 0 and r["block"] is None and r["elements"] in (64 * 128, 128 * 64, 64 * 64)
    assert r["module"] == "jit_loss"
    assert (r["output_zeros"] is not None) == (r["role"] == "wgrad")
  assert 0 <= _one(records, "wgrad", "activation")["output_zeros"] < 0.01


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4+4/6"])
def test_every_format_is_recorded_with_fields_that_mean_something_for_it(tmp_path, fmt):
  """MX and Four Over Six dots are probed too, each record naming its format. MX: s_dec 1 (no tensor scale), the
  element fields against mx.qdq, and scale_underflow the live 1x32 blocks whose E8M0 scale is 2^-127 (they decode to
  zeros: one planted block of 1.5e-38s out of 256); Four Over Six: its s_dec is amax / 1536, the elements exact."""
  from xla_fp4.numerics import mx
  w, x, t = _data()
  x = x.at[0, :32].set(1.5e-38)  # normal, but below what an E8M0 scale of 2^-126 reaches: the block is lost
  options = dict(four_over_six=True) if fmt == "nvfp4+4/6" else dict(format=fmt)
  out, records = _run(tmp_path, _linear_step(), (w, x, t), **options)
  assert {(r["role"], r["operand"]) for r in records} == {
      ("fprop", "activation"), ("fprop", "weight"), ("dgrad", "gradient"), ("dgrad", "weight"),
      ("wgrad", "activation"), ("wgrad", "gradient")}
  assert {r["format"] for r in records} == {fmt}
  got = _one(records, "fprop", "activation")
  x32 = np.asarray(x, np.float32)
  if fmt == "nvfp4+4/6":
    assert got["s_dec"] == pytest.approx(float(np.abs(x32).max()) / 1536, rel=1e-6)
    d = np.asarray(nv.qdq(jnp.asarray(x), axis=1))  # differs from 4/6's: the element fields are the quantizer's
    assert got["snr_db"] > 10 * math.log10((x32.astype(np.float64) ** 2).sum() / ((x32 - d) ** 2).sum()) - 1.0
    return
  d = np.asarray(mx.qdq(jnp.asarray(x), fmt, axis=1))
  nonzero = x32 != 0
  assert got["s_dec"] == 1 and got["amax"] == pytest.approx(float(np.abs(x32).max()), rel=1e-6)
  assert got["underflow"] == pytest.approx((nonzero & (d == 0)).sum() / nonzero.sum(), abs=1e-9)
  want_snr = 10 * math.log10((x32.astype(np.float64) ** 2).sum() / ((x32 - d).astype(np.float64) ** 2).sum())
  assert got["snr_db"] == pytest.approx(want_snr, rel=1e-4)
  assert got["scale_underflow"] == pytest.approx(1 / (64 * 128 / 32)) and got["scale_saturated"] == 0
  # along the tokens, row 0's tiny values share their blocks with other rows' normal ones: no block is lost
  assert _one(records, "wgrad", "activation")["scale_underflow"] == 0


def test_outputs_are_unchanged_bit_for_bit(tmp_path):
  w, x, t = _data()
  xla_fp4.enable(keep_head=False)
  plain = jax.block_until_ready(_linear_step()(w, x, t))
  probed, records = _run(tmp_path, _linear_step(), (w, x, t))
  assert records
  for a, b in zip(plain, probed):
    assert_same_bits(b, a)


def test_every_n_steps(tmp_path):
  w, x, t = _data()
  _, records = _run(tmp_path, _linear_step(), (w, x, t), steps=5, telemetry_every=2)
  assert sorted({r["step"] for r in records}) == [0, 2, 4]
  assert len(records) == 3 * 6


def test_a_step_compiled_again_goes_on_counting(tmp_path):
  """jax compiles a step function again when its inputs' shardings change (flax.nnx's nnx.jit step after its first
  call): the new compilation of the same program continues the step count (0, 1, then 2, 3), where counting from 0
  again would record two step 0s; a run into another directory counts from 0."""
  w, x, t = _data()
  _run(tmp_path, _linear_step(), (w, x, t), steps=2)
  _, records = _run(tmp_path, _linear_step(), (w, x, t), steps=2)  # a new jax.jit: compiled again
  steps = collections.Counter(r["step"] for r in records)
  assert steps == {0: 6, 1: 6, 2: 6, 3: 6}, steps
  _, records = _run(tmp_path / "other", _linear_step(scale=2.0), (w, x, t))  # another directory: another run
  assert {r["step"] for r in records} == {0}


def test_planted_outlier_underflows_exactly_that_operand(tmp_path):
  """One huge outlier per row of the activation: every other block's scale underflows to zero."""
  w, x, t = _data()
  x = x.at[:, 0].set(1e8)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, records = _run(tmp_path, _linear_step(), (w, x, t), telemetry_underflow=0.5)
  hit = _one(records, "fprop", "activation")
  assert hit["underflow"] > 0.99 and hit["scale_underflow"] == pytest.approx(7 / 8)  # 8 blocks per row, 1 kept
  assert hit["alerts"] == ["underflow"]
  flagged = {(r["role"], r["operand"]) for r in records if "underflow" in r["alerts"]}
  # The wgrad reads the same activation (along the tokens, where the outliers fill one column of blocks).
  assert flagged == {("fprop", "activation"), ("wgrad", "activation")}, flagged
  messages = [str(c.message) for c in caught if "telemetry alert" in str(c.message)]
  lines = [line for m in messages for line in m.splitlines() if "fprop activation" in line]
  assert len(lines) == 1 and "quantize to zero at step 0" in lines[0], messages
  alerts = [json.loads(line) for line in open(tmp_path / telemetry.ALERTS)]
  assert [a["alert"] for a in alerts if "fprop activation" in a["message"]] == ["underflow"]


def test_all_zero_gradient_warns_and_fails_in_strict_mode(tmp_path):
  """A gradient so small that its decode scale (amax / 2688) flushes to zero quantizes to all zeros, as in
  Transformer Engine #3281."""
  w, x, t = _data()
  step = _linear_step(scale=1e-36)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, records = _run(tmp_path / "warn", step, (w, x, t))
  zero = [r for r in records if r["all_zero"]]
  assert {(r["role"], r["operand"]) for r in zero} == {("dgrad", "gradient"), ("wgrad", "gradient")}
  assert all(r["operand"] == "gradient" and "all_zero" in r["alerts"] for r in zero)
  assert any("quantized to all zeros" in str(c.message) for c in caught)
  xla_fp4.enable(telemetry=str(tmp_path / "strict"), strict=True, keep_head=False)
  with pytest.raises(Exception, match="quantized to all zeros"):
    jax.block_until_ready(_linear_step(scale=1e-36)(w, x, t))


def test_scanned_stack_reports_per_block(tmp_path):
  layers, d = 6, 64
  ws = jax.random.normal(jax.random.PRNGKey(1), (layers, d, d)) * 0.1 * (1 + jnp.arange(layers))[:, None, None]
  x = jax.random.normal(jax.random.PRNGKey(2), (32, d))

  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(h ** 2)

  _, records = _run(tmp_path, jax.jit(jax.grad(loss)), (ws, x), keep_first=0, keep_last=0)
  for role in ("fprop", "dgrad", "wgrad"):
    blocks = sorted(r["block"] for r in records if r["role"] == role and r["operand"] != "gradient"
                    and r["operand"] != "activation" or (r["role"] == role and role == "wgrad"
                                                         and r["operand"] == "activation"))
    assert blocks == list(range(layers)), (role, blocks)
  # Each iteration's weight is measured on its own: the weights grow with the block.
  amax = {r["block"]: r["amax"] for r in records if r["role"] == "fprop" and r["operand"] == "weight"}
  for b in range(layers):
    assert amax[b] == pytest.approx(float(jnp.abs(ws[b]).max()), rel=1e-6)


def test_remat_scanned_stack_records_every_block_and_changes_nothing(tmp_path):
  """jax.checkpoint around each layer of a scanned stack: the backward pass recomputes the forward (its GEMMs are
  probed too, as fprops of the same layers); records per block, results bit for bit those without telemetry."""
  layers, d = 4, 64
  ws = jax.random.normal(jax.random.PRNGKey(1), (layers, d, d)) * 0.1
  x = jax.random.normal(jax.random.PRNGKey(2), (32, d))

  def loss(ws, x):
    body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
    h, _ = jax.lax.scan(body, x, ws)
    return jnp.mean(h ** 2)

  options = dict(keep_first=0, keep_last=0, stochastic_rounding=False)
  xla_fp4.enable(**options)
  plain = jax.block_until_ready(jax.jit(jax.grad(loss))(ws, x))
  probed, records = _run(tmp_path, jax.jit(jax.grad(loss)), (ws, x), steps=2, **options)
  assert_same_bits(probed, plain)
  for role in ("fprop", "dgrad", "wgrad"):
    for step in (0, 1):
      blocks = {r["block"] for r in records if r["role"] == role and r["step"] == step}
      assert blocks == set(range(layers)), (role, step, blocks)


def test_kept_blocks_record_nothing(tmp_path):
  layers, d = 6, 64
  ws = jax.random.normal(jax.random.PRNGKey(1), (layers, d, d)) * 0.1
  x = jax.random.normal(jax.random.PRNGKey(2), (32, d))

  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(h ** 2)

  _, records = _run(tmp_path, jax.jit(jax.grad(loss)), (ws, x), keep_first=1, keep_last=1)
  assert sorted({r["block"] for r in records}) == [1, 2, 3, 4]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_native_backend_records_the_same_statistics(tmp_path, fmt):
  """The packed forms measure what the emulated forms do: NVFP4's packed quantizer from its own pass, the MX
  formats' from the quantizer's twin in recorded steps (the packed MX quantizer has no measuring form)."""
  w, x, t = _data()
  options = dict(stochastic_rounding=False, format=fmt)
  _, emulated = _run(tmp_path / "emulate", _linear_step(), (w, x, t), backend="emulate", **options)
  _, native = _run(tmp_path / "native", _linear_step(), (w, x, t), backend="native", **options)
  key = lambda r: (r["role"], r["operand"])  # noqa: E731
  assert sorted(map(key, native)) == sorted(map(key, emulated)) and len(native) == 6
  assert {r["format"] for r in native} == {fmt}
  for a in native:
    b = next(r for r in emulated if key(r) == key(a))
    for field in ("amax", "s_dec", "underflow", "scale_underflow"):
      assert a[field] == b[field], (key(a), field)
    assert a["snr_db"] == pytest.approx(b["snr_db"], rel=1e-5)


_MEASURING = {"xla_fp4_qdq_with_scale": "xla_fp4_qdq_with_scale_stats", "xla_fp4_qdq": "xla_fp4_qdq_and_stats",
              "xla_fp4_quantize_packed": "xla_fp4_quantize_packed_stats"}  # each quantizer's telemetry form


def _kernel_calls(text):
  """The xla_fp4 calls of a compiled step, a pair quantizer counted as the two packed quantizers it stands for (the
  measuring forms have no pair: with telemetry each copy is quantized, and measured, by its own call)."""
  calls = collections.Counter(re.findall(r'custom_call_target="(xla_fp4_\w+)"', text))
  pairs = calls.pop("xla_fp4_quantize_packed_pair", 0)
  return calls + collections.Counter({"xla_fp4_quantize_packed": 2 * pairs})


def _projection_step():
  """An attention projection's train step (MaxText's query: x[b, d] · w[d, heads, head_dim]): the dgrad contracts the
  weight's merged (heads, head_dim), reusing the fprop's 16x16 tiles through a reshape."""
  def loss(w, x, t):
    return jnp.sum(jnp.tanh(jnp.einsum("bd,dhk->bhk", x, w)) * t)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _projection_data():
  w, x, t = _data()
  return w.reshape(128, 4, 16), x, t.reshape(64, 4, 16)


@pytest.mark.parametrize("program", ["linear", "projection"])
@pytest.mark.parametrize("backend", ["emulate", "native"])
def test_quantizers_measure_in_their_own_pass(tmp_path, backend, program):
  """With telemetry every operand is quantized by the same calls as without, each in its measuring form, and nothing
  else reads it (issue 23: statistics in the kernels, never a second pass over x): the compiled step's kernel calls
  are those of the step without telemetry, renamed, plus the step, the records and the wgrad outputs' zeros. A
  reused quantization brings its statistics along, reshaped or not (strict: a pass failure raises)."""
  step, args = (_linear_step(), _data()) if program == "linear" else (_projection_step(), _projection_data())
  xla_fp4.enable(keep_head=False, backend=backend, strict=True)
  plain = _kernel_calls(step.lower(*args).compile().as_text())
  xla_fp4.enable(keep_head=False, backend=backend, strict=True, telemetry=str(tmp_path))
  probed = _kernel_calls(step.lower(*args).compile().as_text())
  renamed = collections.Counter({_MEASURING.get(target, target): n for target, n in plain.items()})
  added = probed - renamed
  assert probed - added == renamed  # every call of the plain step, its quantizers in their measuring form
  assert set(added) == {"xla_fp4_telemetry_step", "xla_fp4_telemetry_record", "xla_fp4_output_stats"}, added
  quantizer = "xla_fp4_qdq_with_scale_stats" if backend == "emulate" else "xla_fp4_quantize_packed_stats"
  assert probed[quantizer] > 0 and added["xla_fp4_output_stats"] == 1  # one wgrad


def test_command_line(tmp_path):
  w, x, t = _data()
  _run(tmp_path, _linear_step(), (w, x, t), steps=2)
  run = lambda *a: subprocess.run([sys.executable, "-m", "xla_fp4", "telemetry", str(tmp_path), *a],  # noqa: E731
                                  capture_output=True, text=True, cwd=ROOT)
  r = run("--json")
  assert r.returncode == 0, r.stderr
  listed = json.loads(r.stdout)
  assert len(listed) == 12 and {"step", "layer", "role", "operand", "format", "block", "amax", "underflow",
                                "snr_db"} <= set(listed[0])
  assert {r["format"] for r in listed} == {"nvfp4"}
  r = run()
  assert r.returncode == 0, r.stderr
  assert "most underflow" in r.stdout and "lowest quantization SNR" in r.stdout and "wgrad gradient" in r.stdout
  for name in ("telemetry_underflow.png", "telemetry_snr.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
  missing = subprocess.run([sys.executable, "-m", "xla_fp4", "telemetry", str(tmp_path / "none")],
                           capture_output=True, text=True, cwd=ROOT)
  assert missing.returncode == 2 and "XLA_FP4_TELEMETRY" in missing.stderr


def test_command_line_without_matplotlib_piped_and_explained(tmp_path):
  """No matplotlib: the tables and one line on how to get the plots. A reader that leaves early (`| head`): no
  traceback. `--help` explains every column."""
  w, x, t = _data()
  _run(tmp_path, _linear_step(), (w, x, t), steps=2)
  no_plots = ("import sys; sys.modules['matplotlib'] = None; from xla_fp4.__main__ import main; "
              f"sys.exit(main(['telemetry', {str(tmp_path)!r}]))")
  r = subprocess.run([sys.executable, "-c", no_plots], capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0 and r.stderr == "", r.stderr
  assert "lowest quantization SNR" in r.stdout and r.stdout.rstrip().endswith("pip install matplotlib)"), r.stdout
  piped = subprocess.Popen([sys.executable, "-m", "xla_fp4", "telemetry", str(tmp_path), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, bufsize=0)
  piped.stdout.close()  # the reader leaves before the first line, as `| head -0` does
  assert "Traceback" not in piped.stderr.read().decode() and piped.wait() in (0, 1)
  helped = subprocess.run([sys.executable, "-m", "xla_fp4", "telemetry", "--help"], capture_output=True, text=True,
                          cwd=ROOT).stdout
  assert all(column in helped for column in ("worst", "at step", "alerts since", "steps"))


def test_heatmap_rows_run_in_network_order():
  def record(layer, block, dot, role="fprop"):
    return dict(layer=layer, block=block, dot=dot, role=role)
  order = telemetry.network_order([
      record("head", None, 9), record("blocks/mlp", 1, 3), record("blocks/attn", 0, 2), record("blocks/mlp", 0, 3),
      record("blocks/attn", 1, 2), record("embed", None, 0), record("blocks/attn", 0, 12, role="dgrad")])
  assert sorted(order, key=order.get) == [("embed", None), ("blocks/attn", 0), ("blocks/mlp", 0), ("blocks/attn", 1),
                                          ("blocks/mlp", 1), ("head", None)]


_SHARDED = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    from xla_fp4 import telemetry
    out, layout = sys.argv[1], sys.argv[2]
    xla_fp4.enable(telemetry=out, stochastic_rounding=False, keep_head=False,
                   backend="native" if layout.endswith("native") else "emulate")
    mesh = jax.make_mesh((8,), ("d",))
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    w1 = jax.random.normal(keys[0], (128, 256)) * 0.05
    w2 = jax.random.normal(keys[1], (256, 128)) * 0.05
    x = jax.random.normal(keys[2], (64, 128)).at[:, 0].set(0)  # a zero feature: a zero row of w1's gradient
    def loss(p, x):
      return jnp.mean(jnp.tanh(jnp.tanh(x @ p[0]) @ p[1]) ** 2)
    if layout.startswith("fsdp"):  # weights sharded, batch sharded
      put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
      w1, w2, x = put(w1, P("d", None)), put(w2, P("d", None)), put(x, P("d", None))
    g = jax.block_until_ready(jax.jit(jax.grad(loss))((w1, w2), x))
    telemetry.flush()
""")


@pytest.mark.parametrize("sharded", ["fsdp", "fsdp_native"])
def test_sharded_statistics_equal_one_devices(tmp_path, sharded):
  """Under FSDP on 8 devices each statistic is the whole tensor's (each device measures its shard in the quantizer's
  pass, the packed one in the native forms; the record sums the devices), as on one device."""
  clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4") and k != "XLA_FLAGS"}
  runs = {}
  for layout in ("one", sharded):
    out = tmp_path / layout
    r = subprocess.run([sys.executable, "-c", _SHARDED, str(out), layout], env=clean, capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    runs[layout] = telemetry.load(str(out))
  key = lambda r: (r["layer"], r["role"], r["operand"])  # noqa: E731
  one = {key(r): r for r in runs["one"]}
  assert len(runs[sharded]) == len(one) == 10  # one device's records only, not one per device
  for r in runs[sharded]:
    o = one[key(r)]
    assert r["elements"] == o["elements"] and r["amax"] == o["amax"], key(r)
    assert r["underflow"] == pytest.approx(o["underflow"], abs=2e-3), key(r)
    assert r["snr_db"] == pytest.approx(o["snr_db"], abs=0.05), key(r)
    assert r["output_zeros"] == o["output_zeros"], key(r)  # a wgrad output's zeros: summed, not the largest shard's
  assert max(r["output_zeros"] or 0 for r in runs[sharded]) >= 256 / (128 * 256)  # w1's gradient's zero row


_COLLECTIVES = textwrap.dedent(r"""
    import os, re, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    mesh = jax.make_mesh((8,), ("d",))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("d", None)))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = put(jax.random.normal(keys[0], (128, 256)) * 0.1)
    w2 = put(jax.random.normal(keys[1], (256, 128)) * 0.1)
    x = put(jax.random.normal(keys[2], (256, 128)))
    def loss(p, x):  # a residual MLP, as benchmarks/telemetry.py's
      for _ in range(2):
        x = x + jax.nn.gelu(x @ p[0]) @ p[1]
      return jnp.mean(x ** 2)
    for backend, telemetry in [(b, t) for b in ("emulate", "native") for t in ("", sys.argv[1])]:
      xla_fp4.enable(telemetry=telemetry, stochastic_rounding=False, keep_head=False, backend=backend)
      text = jax.jit(jax.grad(loss)).lower((w1, w2), x).compile().as_text()
      entry = text[text.index("ENTRY"):]
      entry = entry[:entry.index("\n}")]
      ops = re.findall(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                       entry)
      arrays = sorted(f"{op} {a}" for shape, op in ops for a in re.findall(r"\w+\[[\d,]*\]", shape))
      plain = "xla_fp4_qdq" if backend == "emulate" else "xla_fp4_quantize_packed"
      calls = lambda target: text.count(f'custom_call_target="{target}"')
      plains = calls(plain) + 2 * calls("xla_fp4_quantize_packed_pair")  # a pair: two packed quantizers in one
      print(";".join(arrays), f"{plains},{calls(plain + ('_and_stats' if backend == 'emulate' else '_stats'))}",
            text.count("conditional("))
""")


def test_sharded_steps_add_no_collective(tmp_path):
  """Under FSDP on 8 host devices (one process) the quantizers measure their shards in the same pass
  (xla_fp4_qdq_and_stats; in the native forms the packed quantizer, xla_fp4_quantize_packed_stats), each
  device records its own rows and the sink adds them: the step has the collectives it has without telemetry (each
  costs ~1 ms among host devices); on CPU each GEMM's record sits in a conditional on the step."""
  clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4") and k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, "-c", _COLLECTIVES, str(tmp_path)], env=clean, capture_output=True, text=True,
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-4000:]
  lines = [line.rsplit(" ", 2) for line in r.stdout.splitlines()[:4]]
  for (off, off_calls, off_cases), (on, on_calls, on_cases) in (lines[0:2], lines[2:4]):  # emulate, native
    # the quantizers of the step without telemetry, each in its measuring form: no other pass over the shards
    (off_plain, off_stats), (on_plain, on_stats) = [map(int, calls.split(",")) for calls in (off_calls, on_calls)]
    assert off_plain > 0 and off_stats == 0 and on_plain == 0 and on_stats == off_plain
    assert on == off and "all-gather" in off  # the same collectives of the same arrays (XLA may combine them
    # otherwise): FSDP's weight gathers (packed in the native form), the amax reductions, the gradients' reductions
    assert int(on_cases) >= int(off_cases) + 5


@pytest.mark.benchmark  # runs benchmarks/telemetry.py --small (a minute)
def test_overhead_benchmark_runs_and_records(tmp_path):
  out = tmp_path / "telemetry.json"
  clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4")}
  r = subprocess.run([sys.executable, "benchmarks/telemetry.py", "--small", "--out", str(out)], env=clean,
                     capture_output=True, text=True, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [(row["layout"], row["dtype"]) for row in rows] == [
      (layout, dtype) for layout in ("one_device", "fsdp", "fsdp_cores") for dtype in ("float32", "bfloat16")]
  steps = 1 + result["rounds"] * result["steps_per_round"]  # the warm-up step, then the timed ones
  for row in rows:  # the same GEMMs recorded in every step, or in steps 0, 10, 20, ...
    per_step = row["records"]["every_1"] // steps
    assert row["records"]["off"] == 0 and per_step > 0 and row["records"]["every_1"] == per_step * steps
    assert row["records"]["every_10"] == per_step * len(range(0, steps, 10))
    assert all(t > 0 for t in row["step_s"].values())


STATS_CASES = [((64, 128), 1, False, False, False, jnp.float32), ((128, 64), 0, True, False, False, jnp.bfloat16),
               ((96, 48), 0, False, True, True, jnp.float32), ((3, 32, 40), 1, True, True, False, jnp.bfloat16),
               ((40, 32), 1, True, False, True, jnp.float16)]


@pytest.mark.parametrize("shape,axis,block_2d,stochastic,rht,dtype", STATS_CASES)
def test_kernels_measure_as_their_twins(shape, axis, block_2d, stochastic, rht, dtype):
  """The quantizers' telemetry forms (xla_fp4_qdq_with_scale_stats, xla_fp4_qdq_and_stats, xla_fp4_quantize_packed_stats)
  against numerics.telemetry (partial tiles, 2D tiles, the RHT, stochastic rounding, a zero column): their quantized
  values bit for bit as the plain quantizers', the counts exactly, energies to float rounding; zeros in unrecorded
  steps."""
  from xla_fp4 import kernels
  from xla_fp4.kernels import targets
  from xla_fp4.numerics import telemetry as st
  assert extension_or_skip().TELEMETRY_FIELDS == len(st.FIELDS)  # telemetry_fields.h; the order: the rows below
  x = (jax.random.normal(jax.random.PRNGKey(1), shape) * 3).astype(dtype).at[..., 0].set(0)
  recipe = dict(axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=3)
  want_q, want_s, want = jax.jit(lambda x: st.qdq_with_scale_stats(x, jnp.int32(4), jnp.uint32(77), **recipe))(x)
  q, s_dec, row = kernels._call(targets.QDQ_WITH_SCALE_STATS, [x, jnp.int32(4)], salt=77, four_over_six=False,
                                **recipe)
  assert_same_bits(q, want_q)
  assert_same_bits(s_dec, want_s)
  counts = [i for i, f in enumerate(st.FIELDS) if f not in ("energy", "error_energy")]
  np.testing.assert_array_equal(np.asarray(row)[counts], np.asarray(want)[counts])
  np.testing.assert_allclose(np.asarray(row), np.asarray(want), rtol=1e-5)
  _, _, skipped = kernels._call(targets.QDQ_WITH_SCALE_STATS, [x, jnp.int32(-1)], salt=77, four_over_six=False,
                                **recipe)
  assert not np.asarray(skipped).any()
  # the partitioned quantizer's form: the decode scale and key as operands, q and the row from one pass
  key = jnp.uint32(0x1234)
  q2, row2 = kernels.qdq_and_stats(x, s_dec, key, step=4, **recipe)
  want_q2, want2 = jax.jit(lambda x: st.qdq_and_stats(x, s_dec, key, jnp.int32(4), **recipe))(x)
  assert_same_bits(q2, want_q2)
  np.testing.assert_array_equal(np.asarray(row2)[counts], np.asarray(want2)[counts])
  np.testing.assert_allclose(np.asarray(row2), np.asarray(want2), rtol=1e-5)
  q3, skipped = kernels.qdq_and_stats(x, s_dec, key, step=-1, **recipe)
  assert_same_bits(q3, want_q2)
  assert not np.asarray(skipped).any()
  if x.ndim == 2:  # the native forms' quantizer: the packed codes and scales, and the same row from the same pass
    data, scales, row3 = kernels.quantize_packed_stats(x, s_dec, key, step=4, **recipe)
    for got, want_packed in zip((data, scales), kernels.quantize_packed(x, s_dec, key, **recipe)):
      assert_same_bits(got, want_packed)
    np.testing.assert_array_equal(np.asarray(row3), np.asarray(row2))
    data, _, skipped = kernels.quantize_packed_stats(x, s_dec, key, step=-1, **recipe)
    assert_same_bits(data, kernels.quantize_packed(x, s_dec, key, **recipe)[0])
    assert not np.asarray(skipped).any()
  y = x.at[:2].set(0)
  np.testing.assert_array_equal(np.asarray(kernels.output_stats(y, 0)), np.asarray(st.output_stats(y, 0)))
  assert np.asarray(kernels.output_stats(y, 0))[0] >= 2 * np.prod(shape[1:])
  assert not np.asarray(kernels.output_stats(y, -1)).any()


_SIZES = (20, 0, 9, 40, 11)  # an empty group, groups off the 16-row blocks, 16 rows after the last group


def _expert_layer(w, x, ct, sizes):
  """An expert layer (a ragged dot over groups of token rows) and its two gradients."""
  y, vjp = jax.vjp(lambda w, x: jax.lax.ragged_dot(x, w, sizes), w, x)
  return (y,) + vjp(ct)


def _expert_inputs():
  k = jax.random.split(jax.random.PRNGKey(3), 3)
  w = jax.random.normal(k[0], (len(_SIZES), 32, 48)) * jnp.array([1.0, 3.0, 0.01, 1.0, 100.0])[:, None, None]
  x = jax.random.normal(k[1], (96, 32)) * jnp.linspace(0.1, 10, 96)[:, None]
  return w, x, jax.random.normal(k[2], (96, 48)), jnp.asarray(_SIZES, jnp.int32)


def test_ragged_dot_statistics_are_the_cpu_expansions(tmp_path):
  """A chlo.ragged_dot (an expert GEMM lowered for GPU) is measured by twins of the grouped quantizers it runs
  (numerics/telemetry.py ragged_rows_stats, ragged_contracting_stats). On CPU JAX expands the same layer into masked
  dot_generals, each group a slice with its own scale, whose telemetry the pass records: the twins' rows, computed
  here on the same tensors, are those records (the same groups, blocks and scales), in all three roles."""
  from xla_fp4.numerics import telemetry as st
  w, x, ct, sizes = _expert_inputs()
  _, records = _run(tmp_path, jax.jit(_expert_layer), (w, x, ct, sizes), stochastic_rounding=False, min_dim=1, seed=5)
  salt = jnp.uint32(0)  # nearest rounding: the salts are not read
  recipe = lambda block_2d=False, rht=False: (block_2d, False, rht)  # noqa: E731
  rows = dict(fprop=st.ragged_rows_stats(x, w, sizes, salt, salt, lhs_contracting=1, rhs_contracting=1, rhs_group=0,
                                         lhs_recipe=recipe(), rhs_recipe=recipe(True), rht_seed=5, dtype="float32"),
              dgrad=st.ragged_rows_stats(ct, w, sizes, salt, salt, lhs_contracting=1, rhs_contracting=2,
                                         rhs_group=0, lhs_recipe=recipe(), rhs_recipe=recipe(True), rht_seed=5,
                                         dtype="float32"),
              wgrad=st.ragged_contracting_stats(x, ct, sizes, salt, salt, lhs_recipe=recipe(rht=True),
                                                rhs_recipe=recipe(rht=True), rht_seed=5, dtype="float32"))
  operands = dict(fprop=("activation", "weight"), dgrad=("gradient", "weight"), wgrad=("activation", "gradient"))
  for role, pair in rows.items():
    for operand, row in zip(operands[role], np.asarray(pair)):
      got, want = st.summary(row), _one(records, role, operand)
      assert got["amax"] == pytest.approx(want["amax"], rel=1e-6), (role, operand)
      for field in ("underflow", "scale_underflow", "scale_saturated"):
        assert got[field] == pytest.approx(want[field], abs=1e-9), (role, operand, field)
      assert got["snr_db"] == pytest.approx(want["snr_db"], abs=1e-3), (role, operand)
  assert _one(records, "wgrad", "gradient")["output_zeros"] >= 32 * 48 / (len(_SIZES) * 32 * 48)  # the empty group


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ragged_dots_lowered_for_gpu_are_recorded(tmp_path, fmt):
  """Lowered for CUDA the layer keeps three chlo.ragged_dot ops; with telemetry each gets a step, its statistics twin
  inside a case on the step (recorded steps only) and a record: every expert GEMM is measured on GPU too, in either
  format (the MX formats' twins: numerics/telemetry.py mx_ragged_rows_stats, mx_ragged_contracting_stats)."""
  from xla_fp4.passes import pipeline
  from xla_fp4.passes.rewrite import FfiKernels
  w, x, ct, sizes = _expert_inputs()
  if fmt != "nvfp4":  # the dgrad contracts N: a multiple of 32
    w, ct = jnp.concatenate([w, w[..., :16]], -1), jnp.concatenate([ct, ct[:, :16]], -1)
  lowered = jax.jit(_expert_layer).trace(w, x, ct, sizes).lower(lowering_platforms=("cuda",))
  options = dict(stochastic_rounding=False, keep_head=False, min_dim=1, telemetry=str(tmp_path), format=fmt)
  result = pipeline.transform(lowered.compiler_ir("stablehlo"), config.load(environ={}, enabled=True, **options),
                              platform="cuda", kernels=lambda m: FfiKernels())
  text = str(result.module)
  assert text.count('"chlo.ragged_dot"(') == 3
  assert text.count("@xla_fp4_telemetry_record") == 3 and text.count("@xla_fp4_telemetry_step") == 3
  calls = lambda twin: len(re.findall(rf"call @xla_fp4_twin_{twin}_[0-9a-f]{{12}}\(", text))  # noqa: E731
  prefix = "" if fmt == "nvfp4" else "mx_"
  assert calls(prefix + "ragged_rows_stats") == 2 and calls(prefix + "ragged_contracting_stats") == 1
  assert text.count("stablehlo.case") >= 3


def _einsum_experts(w, x, ct):
  """A dense mixture of experts' expert GEMM (an einsum with the expert dim on both operands: per-slice quantization)
  and its two gradients."""
  y, vjp = jax.vjp(lambda w, x: jnp.einsum("ecd,edf->ecf", x, w), w, x)
  return (y,) + vjp(ct)


def test_expert_statistics_lowered_for_gpu_equal_the_cpus(tmp_path):
  """An expert einsum (per-slice operands) lowered for CUDA and rewritten with telemetry, compiled here for the CPU,
  computes the CPU program's outputs bit for bit and records in every role the statistics that the CPU's program
  records: the GPU's probes measure what the CPU's do."""
  from xla_fp4.passes import pipeline
  from xla_fp4.passes.rewrite import FfiKernels
  k = jax.random.split(jax.random.PRNGKey(4), 3)
  scales = jnp.array([1.0, 50.0, 0.02, 1.0])[:, None, None]
  x = jax.random.normal(k[1], (4, 32, 64)).at[2, :, 0].set(1e7)  # expert 2's tokens: an outlier per row
  args = (jax.random.normal(k[0], (4, 64, 48)) * scales, x, jax.random.normal(k[2], (4, 32, 48)))
  options = dict(stochastic_rounding=False, keep_head=False, min_dim=1, seed=5)
  want_out, want = _run(tmp_path / "cpu", jax.jit(_einsum_experts), args, **options)
  xla_fp4.disable()
  lowered = jax.jit(_einsum_experts).trace(*args).lower(lowering_platforms=("cuda",))
  result = pipeline.transform(lowered.compiler_ir("stablehlo"),
                              config.load(environ={}, enabled=True, telemetry=str(tmp_path / "gpu"), **options),
                              platform="cuda", kernels=lambda m: FfiKernels())
  text = str(result.module)
  assert text.count("@xla_fp4_telemetry_record") == 3
  for a, b in zip(run_on_cpu(result.module, args), want_out):
    assert_same_bits(a, b)
  telemetry.flush()
  got = telemetry.load(str(tmp_path / "gpu"))
  assert sorted((r["role"], r["operand"]) for r in got) == sorted((r["role"], r["operand"]) for r in want) and got
  for r in want:
    g = _one(got, r["role"], r["operand"])
    for field in ("amax", "underflow", "scale_underflow", "scale_saturated", "snr_db", "output_zeros"):
      want_value = r.get(field)  # None: the field does not apply (a wgrad's output zeros elsewhere)
      assert g.get(field) == (want_value if want_value is None else pytest.approx(want_value, rel=1e-6)), (
          r["role"], r["operand"], field)
  assert _one(want, "fprop", "activation")["scale_underflow"] > 0.1  # expert 2's blocks: values that can differ
