"""The packed path in sharded programs (sharding/packed.py): the native backend's FP4 GEMM runs on shards, the emulate
backend can move packed operands (XLA_FP4_PACKED_GATHERS), and both keep one device's numbers, their work and their
parallelism; FSDP gathers its weights packed.

One subprocess (8 host devices): a residual MLP train step (float32, d_model 256, d_ff 1024, 1024 tokens), every
layer in NVFP4 with nearest rounding, per layout and backend, costs read from the compiled HLO side by side; and the
same in the packed MX formats (MXFP4, MXFP8: xla_fp4_mx_quantize_packed, xla_fp4_mx_gemm_packed).
"""

import json
import textwrap

import pytest

from tests.sharding.test_layouts import run_python

# Its module fixture takes a while (a measurement or a compile): every test of this file runs on one worker (./dev
# passes --dist loadgroup), so the fixture runs once, not once per worker.
pytestmark = pytest.mark.xdist_group(__name__)

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    from xla_fp4.sharding.cost import cost
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    k = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k[0], (256, 1024)) * 0.06
    w2 = jax.random.normal(k[1], (1024, 256)) * 0.03
    x = jax.random.normal(k[2], (16, 64, 256))
    def loss(p, x):
      w1, w2 = p
      return jnp.mean((x + jax.nn.gelu(x @ w1) @ w2) ** 2)
    step = jax.jit(jax.grad(loss))
    layouts = {"data_parallel": (P(), P(), P("d")), "fsdp": (P("d", None), P("d", None), P("d")),
               "tensor_parallel": (P(None, "d"), P("d", None), P())}
    rows = []
    for layout, (s1, s2, sx) in layouts.items():
      args = ((put(w1, s1), put(w2, s2)), put(x, sx))
      out = {}
      for name, options in (("none", None), ("native", dict(backend="native")),
                            ("emulate_packed", dict(backend="emulate", packed_gathers=True)),
                            *((f"{b}_{f}", dict(backend=b.split("_")[0], packed_gathers=True, format=f))
                              for b in ("native", "emulate_packed") for f in ("mxfp4", "mxfp8"))):
        if options is None:
          xla_fp4.disable()
        else:
          xla_fp4.enable(strict=True, keep_head=False, keep_first=0, keep_last=0, stochastic_rounding=False, **options)
        compiled = step.lower(*args).compile()
        c, text = cost(compiled, is_data=lambda number, dtype, dims: number == 2), compiled.as_text()  # x
        grads = compiled(*args)
        single = step((w1, w2), x)
        diff = float(np.sqrt(sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                                 for a, b in zip(grads, single)) / sum(np.sum(np.asarray(b, np.float64) ** 2)
                                                                      for b in single)))
        wide_gathers = sum(1 for line in text.splitlines()
                           if " all-gather(" in line and line.split("=", 1)[1].split()[0].startswith("f32["))
        gemms = sum(text.count(f'custom_call_target="xla_fp4_{t}gemm_packed"') for t in ("", "mx_"))
        out[name] = dict(flops=c.dot_flops, bytes=c.large_collective_bytes, gemms=gemms,
                         weight_gathers=c.collective_bytes_by_kind["weight_gathers"],
                         quantize_packed=sum(text.count(f'custom_call_target="xla_fp4_{t}"')
                                             for t in ("quantize_packed", "quantize_packed_pair",
                                                       "mx_quantize_packed")),
                         wide_gathers=wide_gathers, temp=compiled.memory_analysis().temp_size_in_bytes,
                         rel_l2_sharded_minus_single=diff)
      rows.append(dict(layout=layout, **out))
    xla_fp4.disable()
    print(json.dumps(rows))
""")


@pytest.fixture(scope="module")
def rows():
  return {r["layout"]: r for r in json.loads(run_python(["-c", SCRIPT]).strip().splitlines()[-1])}


MX = [f"{b}_{f}" for b in ("native", "emulate_packed") for f in ("mxfp4", "mxfp8")]


@pytest.mark.parametrize("native", ["native", "native_mxfp4", "native_mxfp8"])
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp", "tensor_parallel"])
def test_native_runs_every_gemm_packed_on_shards(rows, layout, native):
  row = rows[layout]
  # fprop x2, the dgrad into layer 1, wgrad x2: every GEMM of the step is the FP4 (or MX) GEMM, none an XLA dot
  assert row[native]["gemms"] == 5, row
  assert row[native]["flops"] <= 1.05 * row["none"]["flops"], row
  assert row[native.replace("native", "emulate_packed")]["flops"] <= 1.05 * row["none"]["flops"], row


@pytest.mark.parametrize("backend", ["native", "emulate_packed"] + MX)
@pytest.mark.parametrize("layout", ["data_parallel", "fsdp", "tensor_parallel"])
def test_sharded_packed_step_equals_one_device(rows, layout, backend):
  """Nearest rounding: shards quantize what one device does; a split K (the wgrad over tokens, the row-parallel layer)
  only adds f32 partial sums in another order."""
  row = rows[layout]
  # The emulate backend packs where a weight is gathered: with weights whole on every device (data parallelism) its
  # dots keep the emulated form.
  packs = backend.startswith("native") or layout != "data_parallel"
  assert (row[backend]["quantize_packed"] > 0) == packs, row
  assert row[backend]["rel_l2_sharded_minus_single"] <= 1e-5, row


@pytest.mark.parametrize("backend", ["native", "emulate_packed"])
def test_fsdp_gathers_weights_packed(rows, backend):
  row = rows["fsdp"]
  assert row["none"]["wide_gathers"] == 2, row  # the baseline gathers each f32 weight once
  assert row[backend]["wide_gathers"] == 0, row  # the pass gathers their packed codes and scales instead
  # Weight gathers shrink to 0.14x; the gradients' reductions keep their width (about half the baseline's bytes).
  assert row[backend]["bytes"] <= 0.6 * row["none"]["bytes"], row
  # Told apart from dataflow (sharding/cost.py): the gathers that depend on no data input are the weights'. Each
  # weight gathered once, packed (4.5 bits of 32 per element: 0.14x), where the baseline gathers it once: the dgrad
  # reads the fprop's packed copy (xla_fp4_gemm_packed's b_transposed), as Megatron's FP4 parameter gather does.
  assert row["none"]["weight_gathers"] > 0, row
  assert row[backend]["weight_gathers"] <= 0.15 * row["none"]["weight_gathers"], row


@pytest.mark.parametrize("backend", MX)
def test_fsdp_gathers_mx_weights_packed(rows, backend):
  """An MX weight moves at its format's bits: MXFP4 4.25 of 32 (0.13x, gathered once: the dgrad reads the fprop's
  32x32-tiled copy), MXFP8 8.25 (0.26x) per copy; MXFP8's weights take 1x32 blocks (the format record), so the fprop
  and the dgrad each gather their own copy (0.52x), still half the float32 gather."""
  row = rows["fsdp"]
  assert row[backend]["wide_gathers"] == 0, row
  bound = 0.14 if backend.endswith("mxfp4") else 2 * 0.26
  assert row[backend]["weight_gathers"] <= bound * row["none"]["weight_gathers"], row


@pytest.mark.parametrize("backend", ["native", "emulate_packed"] + MX)
@pytest.mark.parametrize("layout", ["data_parallel", "tensor_parallel"])
def test_data_and_tensor_parallel_move_no_more(rows, layout, backend):
  row = rows[layout]
  assert row[backend]["bytes"] <= 1.0 * row["none"]["bytes"] + 64, row


GSPMD_SCRIPT = SCRIPT.replace("import xla_fp4\n",
                              "import xla_fp4\njax.config.update('jax_use_shardy_partitioner', False)\n")


PAIRS_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import xla_fp4
    from xla_fp4.passes.rewrite import pairs
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    k = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k[0], (256, 512), jnp.bfloat16) * 0.06
    w2 = jax.random.normal(k[1], (512, 256), jnp.bfloat16) * 0.03
    x = jax.random.normal(k[2], (16, 64, 256), jnp.bfloat16)
    def loss(p, x):
      w1, w2 = p
      return jnp.mean(((x + jax.nn.gelu(x @ w1) @ w2) ** 2).astype(jnp.float32))
    layouts = {"data_parallel": (P(), P(), P("d")), "fsdp": (P("d", None), P("d", None), P("d")),
               "tensor_parallel": (P(None, "d"), P("d", None), P())}
    fuse = pairs.fuse
    rows = []
    for layout, (s1, s2, sx) in layouts.items():
      args = ((put(w1, s1), put(w2, s2)), put(x, sx))
      for backend in ("native", "emulate"):
        out = {}
        for name, f in (("paired", fuse), ("apart", lambda kernels, packings: 0)):
          pairs.fuse = f
          xla_fp4.enable(strict=True, keep_head=False, keep_first=0, keep_last=0, backend=backend,
                         packed_gathers=True)
          step = jax.jit(jax.grad(loss, argnums=(0, 1)))
          compiled = step.lower(*args).compile()
          out[name] = (compiled.as_text().count('custom_call_target="xla_fp4_quantize_packed_pair"'),
                       [np.asarray(g, np.float32) for g in jax.tree.leaves(compiled(*args))])
          xla_fp4.disable()
        rows.append(dict(layout=layout, backend=backend, pairs=out["paired"][0], apart_pairs=out["apart"][0],
                         equal=all(np.array_equal(a, b) for a, b in zip(out["paired"][1], out["apart"][1]))))
    print(json.dumps(rows))
""")


def test_pairs_run_on_shards_and_change_no_number():
  """Stochastic rounding, bfloat16, 8 host devices: the pair quantizer (one read for a value's row-wise and
  column-wise packed copies) partitions in every layout (its Shardy rule and partitioner: both dims in units of 32,
  both keys mixed with the shard's index) and its step equals the step with the two quantizers apart bit for bit."""
  rows = json.loads(run_python(["-c", PAIRS_SCRIPT]).strip().splitlines()[-1])
  assert len(rows) == 6, rows
  for row in rows:
    # the emulate backend packs where a weight is gathered: not with weights whole on every device
    packs = row["backend"] == "native" or row["layout"] != "data_parallel"
    assert (row["pairs"] > 0) == packs and row["apart_pairs"] == 0 and row["equal"], row


def test_the_packed_path_partitions_under_gspmd_too():
  """With XLA's older partitioner (jax_use_shardy_partitioner=False: the custom-call partitioners' GSPMD callbacks in
  sharding/packed.py), both packed backends run every GEMM on shards as with Shardy, equal one device's step, and
  FSDP gathers no float32 weight."""
  assert GSPMD_SCRIPT != SCRIPT
  rows = {r["layout"]: r for r in json.loads(run_python(["-c", GSPMD_SCRIPT]).strip().splitlines()[-1])}
  for layout, row in rows.items():
    assert row["native"]["gemms"] == 5, (layout, row)
    for backend in ("native", "emulate_packed"):
      assert (row[backend]["quantize_packed"] > 0) == (backend == "native" or layout != "data_parallel"), (layout, row)
      assert row[backend]["rel_l2_sharded_minus_single"] <= 1e-5, (layout, backend, row)
  assert rows["fsdp"]["none"]["wide_gathers"] == 2, rows["fsdp"]
  assert rows["fsdp"]["native"]["wide_gathers"] == rows["fsdp"]["emulate_packed"]["wide_gathers"] == 0, rows["fsdp"]
