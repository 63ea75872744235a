"""Regenerate the golden input modules: `python tests/passes/golden/regenerate.py`.

Each case is a tiny JAX program lowered to StableHLO (with locations: the pass reads name stacks), written to
`<name>.mlir` under a header of `// CONFIG:` options, the `// DECISIONS:` the policy must make (role:rule per dot, in
program order) and FileCheck directives that test_golden.py runs against the rewritten module. Edit the checks here, not in the .mlir files.
"""

import os

import jax
import jax.numpy as jnp

import xla_fp4

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def fprop(x, w):
  with jax.named_scope("fc1"):
    return x @ w


def train_linear(x, w):
  def loss(w, x):
    with jax.named_scope("fc1"):
      return jnp.sum(jnp.tanh(x @ w))
  return jax.grad(loss, argnums=(0, 1))(w, x)


def not_linear(x):
  return jnp.tanh(x) @ jnp.sin(x).T


def odd_contraction(x, w):
  return x @ w


def excluded(x, w):
  with xla_fp4.exclude():
    return x @ w


def head(x, w):
  """A gradient step of one layer, named for nothing: its output reaches the loss directly, so it is the head."""
  def loss(w, x):
    with jax.named_scope("classifier"):
      return jnp.sum(jnp.tanh(x @ w))
  return jax.grad(loss)(w, x)


def scanned(ws, x):
  def layer(h, w):
    return jnp.tanh(h @ w), None
  return jax.lax.scan(layer, x, ws)[0]


X, W = jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
CASES = {
    "fprop_nvfp4": (fprop, (X, W), "forward_only=1 keep_head=0", """
// One device: each operand is one kernel call that measures it (amax, s_dec) and returns q·scale and s_dec.
// DECISIONS: fprop:nvfp4
// CHECK-LABEL: func.func public @main(%arg0: tensor<32x64xf32>, %arg1: tensor<64x64xbf16>)
// CHECK-NOT: stablehlo.reduce
// CHECK: %[[X:[0-9]+]] = stablehlo.convert %arg0
// CHECK: %[[W:[0-9]+]] = stablehlo.convert %arg1
// CHECK: %[[QX:[0-9]+]]:2 = stablehlo.custom_call @xla_fp4_qdq_with_scale(%[[X]])
// CHECK-SAME: axis = 1 : i64, block_2d = false, four_over_six = false, rht = false
// CHECK-SAME: stochastic = false
// CHECK: %[[QW:[0-9]+]]:2 = stablehlo.custom_call @xla_fp4_qdq_with_scale(%[[W]])
// CHECK-SAME: axis = 0 : i64, block_2d = true
// CHECK-SAME: -> (tensor<64x64xf32>, tensor<f32>)
// The GEMM on q·scale, then both global decode scales folded into its f32 output (cuBLASLt's alpha).
// CHECK: %[[ACC:[0-9]+]] = stablehlo.dot_general %[[QX]]#0, %[[QW]]#0, contracting_dims = [1] x [0]
// CHECK-SAME: -> tensor<32x64xf32>
// CHECK: %[[ALPHA:[0-9]+]] = stablehlo.multiply %[[QX]]#1, %[[QW]]#1
// CHECK: %[[BALPHA:[0-9]+]] = stablehlo.broadcast_in_dim %[[ALPHA]]
// CHECK: %[[Y:[0-9]+]] = stablehlo.multiply %[[ACC]], %[[BALPHA]]
// CHECK-NOT: stablehlo.dot_general
// CHECK-NOT: stablehlo.reduce
// CHECK: return %[[Y]]"""),
    "fprop_partitioned": (fprop, (X, W), "forward_only=1 keep_head=0", """
// A partitioned program: per-block maxima, then amax as a plain reduce (XLA makes it a cross-device all-reduce) fed
// to xla_fp4_qdq. Each call carries its Shardy rule: K = 64 is the compound (4 blocks, 16) whose 16 is never split.
// The reduce and the decode scale are the twin kernel_twins.decode_scale, lowered into a private function.
// DECISIONS: fprop:nvfp4
// CHECK-LABEL: func.func public @main
// CHECK: %[[XB:[0-9]+]] = stablehlo.custom_call @xla_fp4_block_amax(%[[X:[0-9]+]])
// CHECK-SAME: axis = 1 : i64, digest = false, rht = false
// CHECK-SAME: sdy.sharding_rule = #sdy.op_sharding_rule<([i, jk])->([i, j]) {i=32, j=4, k=16} need_replication={k}, custom>
// CHECK-SAME: -> tensor<32x4xf32>
// CHECK: %[[SX:[0-9]+]] = call @[[SCALE:xla_fp4_twin_decode_scale_[0-9a-f]+]](%[[XB]])
// CHECK: %[[QX:[0-9]+]] = stablehlo.custom_call @xla_fp4_qdq(%[[X]], %[[SX]], %{{[a-z0-9_]+}})
// CHECK-SAME: apply_global_scale = false, axis = 1 : i64, block_2d = false
// CHECK-SAME: stochastic = false
// CHECK-SAME: sdy.sharding_rule = #sdy.op_sharding_rule<([i, jk], [], [])->([i, jk]) {i=32, j=4, k=16} need_replication={k}, custom>
// CHECK: %[[QW:[0-9]+]] = stablehlo.custom_call @xla_fp4_qdq(
// CHECK-SAME: axis = 0 : i64, block_2d = true
// CHECK-SAME: sdy.sharding_rule = #sdy.op_sharding_rule<([ij, kl], [], [])->([ij, kl]) {i=4, j=16, k=4, l=16} need_replication={j, l}, custom>
// CHECK: stablehlo.dot_general %[[QX]], %[[QW]]
// CHECK-SAME: -> tensor<32x64xf32>
// CHECK-NOT: stablehlo.dot_general
// CHECK: return
// CHECK: func.func private @[[SCALE]](%[[B:.+]]: tensor<32x4xf32>) -> tensor<f32>
// CHECK: %[[AMAX:[0-9]+]] = stablehlo.reduce(%[[B]] init: %{{.*}}) applies stablehlo.maximum
// CHECK: %[[S:[0-9]+]] = stablehlo.multiply %[[AMAX]]
// CHECK: %[[SX2:[0-9]+]] = stablehlo.optimization_barrier %[[S]]
// CHECK: return %[[SX2]]""", 2),
    "backward_dgrad_wgrad": (train_linear, (jax.ShapeDtypeStruct((32, 64), jnp.float32),
                                             jax.ShapeDtypeStruct((64, 64), jnp.float32)), "keep_head=0", """
// (The one layer is the output head: keep_head=0 puts it in NVFP4.)
// DECISIONS: fprop:nvfp4 wgrad:nvfp4 dgrad:nvfp4
// CHECK-LABEL: func.func public @main
// wgrad: both operands get the random Hadamard transform along the token dim; the gradient rounds stochastically
// (its key mixes in a wrapping sum of its bits, computed by the kernel)
// CHECK-DAG: @xla_fp4_qdq_with_scale(%[[DY:[0-9]+]]) {{.*}}axis = 0 : i64, block_2d = false, four_over_six = false, rht = true{{.*}}stochastic = true
// CHECK-DAG: @xla_fp4_qdq_with_scale(%arg0) {{.*}}axis = 0 : i64, block_2d = false, four_over_six = false, rht = true{{.*}}stochastic = false
// dgrad: the gradient rounds stochastically along the output dim, the weight's fprop quantization is reused
// CHECK-DAG: @xla_fp4_qdq_with_scale(%[[DY]]) {{.*}}axis = 1 : i64, block_2d = false, four_over_six = false, rht = false{{.*}}stochastic = true
// CHECK-DAG: %[[W:[0-9]+]]:2 = stablehlo.custom_call @xla_fp4_qdq_with_scale(%arg1) {{.*}}axis = 0 : i64, block_2d = true
// CHECK-DAG: stablehlo.dot_general %{{[0-9]+}}#0, %[[W]]#0, contracting_dims = [1] x [1]
// CHECK: return"""),
    "keep_not_linear": (not_linear, (X,), "", """
// DECISIONS: other:not_linear
// CHECK-LABEL: func.func public @main
// CHECK-NOT: xla_fp4
// CHECK: stablehlo.dot_general
// CHECK-NOT: xla_fp4"""),
    "keep_odd_contraction": (odd_contraction, (jax.ShapeDtypeStruct((32, 24), jnp.float32),
                                               jax.ShapeDtypeStruct((24, 64), jnp.float32)), "", """
// DECISIONS: fprop:contraction_not_16
// CHECK-LABEL: func.func public @main
// CHECK-NOT: xla_fp4
// CHECK: stablehlo.dot_general {{.*}} contracting_dims = [1] x [0]
// CHECK-NOT: xla_fp4"""),
    "keep_forward_only": (fprop, (X, W), "", """
// A program without a backward pass (eval, init, an eager matmul) is left exactly as it is by default.
// DECISIONS: fprop:forward_only
// CHECK-NOT: xla_fp4
// CHECK: stablehlo.dot_general %{{.*}}, %{{.*}}, contracting_dims = [1] x [0]
// CHECK-NOT: xla_fp4
"""),
    "keep_excluded_scope": (excluded, (X, W), "forward_only=1", """
// DECISIONS: fprop:exclude_scope
// CHECK-LABEL: func.func public @main
// CHECK-NOT: xla_fp4_qdq
// CHECK: stablehlo.dot_general
// CHECK-NOT: xla_fp4_qdq"""),
    "keep_excluded_regex": (fprop, (X, W), "exclude=fc\\d forward_only=1", """
// DECISIONS: fprop:exclude_regex
// CHECK-LABEL: func.func public @main
// CHECK-NOT: xla_fp4_qdq
// CHECK: stablehlo.dot_general"""),
    "keep_head": (head, (X, jax.ShapeDtypeStruct((64, 64), jnp.float32)), "", """
// fprop and wgrad of the head stay as they were (the gradient is taken of w only: no dgrad).
// DECISIONS: fprop:head wgrad:head
// CHECK-LABEL: func.func public @main
// CHECK-NOT: xla_fp4_qdq
// CHECK: stablehlo.dot_general
// CHECK: stablehlo.dot_general
// CHECK-NOT: xla_fp4_qdq
// CHECK: return"""),
    "head_in_nvfp4_when_asked": (head, (X, jax.ShapeDtypeStruct((64, 64), jnp.float32)), "keep_head=0", """
// DECISIONS: fprop:nvfp4 wgrad:nvfp4
// CHECK-LABEL: func.func public @main
// CHECK: stablehlo.custom_call @xla_fp4_qdq
// CHECK: stablehlo.dot_general"""),
    "scan_per_iteration_select": (scanned, (jax.ShapeDtypeStruct((8, 64, 64), jnp.float32), X),
                                  "keep_last=2 forward_only=1 keep_head=0", """
// The scan body gets the block index as an extra argument; a select on it per operand gives the GEMM the operand
// itself (s_dec = 1) for blocks 6, 7 and its q·scale for the others: one GEMM per iteration, after the selects.
// DECISIONS: fprop:nvfp4
// CHECK: stablehlo.while
// CHECK: func.call @[[BODY:closed_call[_0-9]*]]({{.*}}) : ({{.*}}, tensor<i32>) ->
// CHECK: func.func private @[[BODY]]({{.*}}%[[BLOCK:arg[0-9]+]]: tensor<i32>
// CHECK: %[[KEEP6:[0-9]+]] = stablehlo.compare EQ, %[[BLOCK]], %{{.*}}
// CHECK: %[[KEEP7:[0-9]+]] = stablehlo.compare EQ, %[[BLOCK]], %{{.*}}
// CHECK: %[[KEPT:[0-9]+]] = stablehlo.or %[[KEEP6]], %[[KEEP7]]
// CHECK: %[[QX:[0-9]+]]:2 = stablehlo.custom_call @xla_fp4_qdq_with_scale(%arg0)
// CHECK: %[[X:[0-9]+]] = stablehlo.select %[[KEPT]], %arg0, %[[QX]]#0
// CHECK: %[[SX:[0-9]+]] = stablehlo.select %[[KEPT]], %{{.*}}, %[[QX]]#1
// CHECK: %[[QW:[0-9]+]]:2 = stablehlo.custom_call @xla_fp4_qdq_with_scale(%arg1)
// CHECK: %[[W:[0-9]+]] = stablehlo.select %[[KEPT]], %arg1, %[[QW]]#0
// CHECK: %[[SW:[0-9]+]] = stablehlo.select %[[KEPT]], %{{.*}}, %[[QW]]#1
// CHECK-NEXT: stablehlo.dot_general %[[X]], %[[W]]
// CHECK: stablehlo.multiply %[[SX]], %[[SW]]
// CHECK-NOT: stablehlo.dot_general
// CHECK-NOT: stablehlo.case
// CHECK: return"""),
}


def main():
  for name, (fn, args, config, checks, *partitions) in CASES.items():
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    text = text.replace(f'"{ROOT}/', '"')  # source locations relative to the checkout: no machine's path in the file
    if partitions:  # as if jitted over that many devices (the pass reads only the module's attribute)
      text = text.replace("mhlo.num_partitions = 1 :", f"mhlo.num_partitions = {partitions[0]} :", 1)
    with open(os.path.join(HERE, f"{name}.mlir"), "w") as f:
      f.write(f"// CONFIG: {config}\n// Generated by regenerate.py from `{fn.__name__}`.\n{checks.strip()}\n\n{text}")
    print("wrote", name)


if __name__ == "__main__":
  main()
