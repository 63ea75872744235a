"""The partitioner's pieces, without devices: block alignment, replicating a dim, shard indices, Shardy rules."""

import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir

from nvfp4_testing import kernel_calls_row_major
from xla_fp4 import kernels
from xla_fp4.sharding import partition as p
from xla_fp4.sharding import shards


def test_blocks_stay_whole_on_every_shard():
  one_d = p.Blocking.of(2, 1, block_2d=False)
  assert one_d.split_blocks([64, 128], [4, 8]) == set()  # 128 / 8 = 16: whole blocks; rows split freely
  assert one_d.split_blocks([64, 96], [1, 8]) == {1}  # 96 / 8 = 12 splits blocks
  two_d = p.Blocking.of(2, 0, block_2d=True)  # K = dim 0, tiles pair it with dim 1
  assert two_d.split_blocks([64, 48], [4, 3]) == set()
  assert two_d.split_blocks([64, 48], [1, 4]) == {1}  # 48 / 4 = 12 splits the tiles' second side
  # A 3-D partner group (dims 1, 2 flattened): splitting dim 1 keeps runs of (extent x 8) positions whole.
  three_d = p.Blocking.of(3, 0, block_2d=True)
  assert three_d.split_blocks([32, 4, 8], [1, 2, 1]) == set()  # runs of 2 * 8 = 16
  assert three_d.split_blocks([32, 4, 4], [1, 2, 1]) == {1}  # runs of 2 * 4 = 8


def test_mx_blocks_and_tiles_stay_whole_on_every_shard():
  """The MX formats' 32-blocks and 32x32 tiles (xla_fp4_mx_qdq's partitioner): a shard keeps whole ones, or the dim is
  replicated."""
  one_d = p.Blocking.of(2, 1, block_2d=False, block=32)
  assert one_d.split_blocks([64, 256], [4, 8]) == set()  # 256 / 8 = 32
  assert one_d.split_blocks([64, 128], [1, 8]) == {1}  # 128 / 8 = 16: NVFP4's block, half an MX one
  two_d = p.Blocking.of(2, 0, block_2d=True, block=32)
  assert two_d.split_blocks([64, 64], [2, 2]) == set()
  assert two_d.split_blocks([64, 64], [1, 4]) == {1}  # 64 / 4 = 16 splits the tiles' second side
  with mlir.make_ir_context(), ir.Location.unknown():
    f32, u32 = ir.F32Type.get(), ir.IntegerType.get_unsigned(32)
    x = ir.RankedTensorType.get([32, 128], f32)
    rule = p.sharding_rule(kernels.targets.MX_QDQ.name, [x, ir.RankedTensorType.get([], u32)], [x],
                           {"axis": 1, "block_2d": False})
    assert str(rule) == "#sdy.op_sharding_rule<([i, jk], [])->([i, jk]) {i=32, j=4, k=32} need_replication={k}, custom>"


def _groups(sharding, rank):
  """shard index -> the set of devices holding it."""
  table = shards.shard_index_table(sharding, rank, 8)
  out = {}
  for device, shard in enumerate(table):
    out.setdefault(int(shard), set()).add(device)
  return out


def test_replicating_a_dim_keeps_the_other_split():
  sharding = xc.HloSharding.iota_tile([2, 4])  # (data=2, model=4) over 8 devices
  assert _groups(sharding, 2) == {i: {i} for i in range(8)}
  rows = shards.replicate_dims(sharding, 2, {1})
  assert shards.tiles_and_devices(rows, 2)[0] == [2, 1]
  assert _groups(rows, 2) == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}  # replicas of a row shard share its index
  assert shards.replicate_dims(sharding, 2, {0, 1}).is_replicated()
  assert shards.replicate_dims(sharding, 2, set()) is sharding


def test_shard_salts_leave_shard_zero_unchanged_and_differ():
  salts = shards.shard_salts(list(range(8)))
  assert salts[0] == 0 and len(set(int(s) for s in salts)) == 8


def test_sharding_rules():
  with mlir.make_ir_context(), ir.Location.unknown():
    f32 = ir.F32Type.get()
    x = ir.RankedTensorType.get([32, 64], f32)
    scalar = ir.RankedTensorType.get([], f32)
    qdq = p.sharding_rule(kernels.QDQ_TARGET, [x, scalar, scalar], [x], {"axis": 1, "block_2d": False})
    assert str(qdq) == ("#sdy.op_sharding_rule<([i, jk], [], [])->([i, jk]) {i=32, j=4, k=16} "
                        "need_replication={k}, custom>")
    # An activation's K in a fprop: the result's K is its own compound, so the dot (its weight) decides how K is
    # sharded and XLA reshards x before the kernel (docs/design.md §5).
    follows = p.sharding_rule(kernels.QDQ_TARGET, [x, scalar, scalar], [x], {"axis": 1, "block_2d": False},
                              k_follows_dot=True)
    assert str(follows) == ("#sdy.op_sharding_rule<([i, jk], [], [])->([i, lm]) {i=32, j=4, k=16, l=4, m=16} "
                            "need_replication={k, m}, custom>")
    with pytest.raises(ValueError, match="1x16 blocks"):  # a 2D-tiled weight's tiles span both dims: it leads
      p.sharding_rule(kernels.QDQ_TARGET, [x, scalar, scalar], [x], {"axis": 1, "block_2d": True}, k_follows_dot=True)
    blocks = ir.RankedTensorType.get([32, 4], f32)
    amax = p.sharding_rule(kernels.BLOCK_AMAX_TARGET, [x], [blocks], {"axis": 1})
    assert str(amax) == "#sdy.op_sharding_rule<([i, jk])->([i, j]) {i=32, j=4, k=16} need_replication={k}, custom>"
    one_block = ir.RankedTensorType.get([32, 16], f32)
    amax1 = p.sharding_rule(kernels.BLOCK_AMAX_TARGET, [one_block], [ir.RankedTensorType.get([32, 1], f32)],
                            {"axis": 1})
    assert str(amax1) == "#sdy.op_sharding_rule<([i, j])->([i, k]) {i=32, j=16, k=1} need_replication={j}, custom>"


def test_per_shard_module_fixes_row_major_layouts():
  """The per-shard kernel call fixes its layouts like the pass's calls do (docs/design.md §5)."""
  shape = xc.Shape.array_shape(np.dtype(np.float32), (8, 32, 32))
  scalar, key = xc.Shape.array_shape(np.dtype(np.float32), ()), xc.Shape.array_shape(np.dtype(np.uint32), ())
  attrs = dict(axis=2, block_2d=False, stochastic=True, rht=False, rht_seed=0, apply_global_scale=False,
               four_over_six=False)
  bytecode = shards.kernel_module(kernels.QDQ_TARGET, attrs, [shape, scalar, key], shape, np.arange(8, dtype=np.uint32))
  with mlir.make_ir_context():
    assert len(kernel_calls_row_major(ir.Module.parse(bytecode))) == 1


def test_packed_gemm_rules_read_k_and_n_where_b_holds_them():
  """The FP4 GEMM's rule: a dot's (K a reduction factor, in pairs of blocks). With b_transposed b is Bᵀ (K, N/2):
  K's pairs split its rows and N's 16x16 tiles its columns, so a dgrad reading its forward's packed weight shares
  that value's sharding (sharding/packed.py)."""
  from xla_fp4.sharding import packed
  with mlir.make_ir_context(), ir.Location.unknown():
    u8, f32 = ir.IntegerType.get_unsigned(8), ir.F32Type.get()
    t = lambda *shape, e=u8: ir.RankedTensorType.get(list(shape), e)  # noqa: E731
    a, out = [t(64, 64), t(64, 8)], [t(64, 96, e=f32)]
    plain = packed.sharding_rule("xla_fp4_gemm_packed", a + [t(96, 64), t(96, 8), t(e=f32)], out,
                                 {"emulate": False, "b_transposed": False})
    assert str(plain) == ("#sdy.op_sharding_rule<([i, kl], [i, km], [j, kl], [j, km], [])->([i, j]) "
                          "{i=64, j=96, k=4, l=16, m=2} reduction={k} need_replication={l, m}, custom>")
    transposed = packed.sharding_rule("xla_fp4_gemm_packed", a + [t(128, 48), t(128, 6), t(e=f32)], out,
                                      {"emulate": False, "b_transposed": True})
    assert str(transposed) == ("#sdy.op_sharding_rule<([i, jl], [i, jm], [jk, np], [jk, n], [])->([i, no]) "
                               "{i=64, j=4, k=32, l=16, m=2, n=6, o=16, p=8} reduction={j} "
                               "need_replication={k, l, m, o, p}, custom>")
