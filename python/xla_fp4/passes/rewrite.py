"""Rewrite: replace each selected dot_general by the pattern of its plan (policy.Plan: recipe per operand, Form, block
index source).

Before (fprop of a linear layer):
  %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<8x32xbf16>, tensor<32x64xbf16>) -> ...
After, Form.WHOLE_TENSOR (a program that is not partitioned: every tensor is whole on its device):
  %qx, %sx = stablehlo.custom_call @xla_fp4_qdq_with_scale(%x) {axis, block_2d, stochastic, rht, rht_seed, salt}
  ... same for %w ...
  %acc  = stablehlo.dot_general %qx, %qw (same dims and precision) -> f32
  %y    = convert (%acc * (%sx * %sw))
The kernel measures the operand (amax -> s_dec = amax / (6 * 448); the stochastic-rounding key) and returns q·scale,
exact in the operand's dtype; the two global decode scales are folded into the f32 GEMM output, as cuBLASLt's alpha.
Form.PARTITIONED: the amax must be global, so it is a plain reduce that XLA partitions into an all-reduce:
  %xb   = stablehlo.custom_call @xla_fp4_block_amax(%x) {axis, rht, rht_seed}  ; max |.| per 1x16 block, NaN as Inf
  %sx   = call @xla_fp4_twin_decode_scale_<hash>(%xb)  ; max reduce, * 1/2688, optimization barrier
  %key  = call @xla_fp4_twin_stochastic_key_<hash>(%x, %salt)  ; stochastic rounding only, else the salt
  %qx   = stablehlo.custom_call @xla_fp4_qdq(%x, %sx, %key) {axis, block_2d, stochastic, rht, rht_seed,
            apply_global_scale = false, sdy.sharding_rule = ...}
Both forms compute the same numbers. How each op partitions (measured with benchmarks/sharding.py: dot FLOPs per
device 1.00x of the unrewritten program in every layout, collective bytes 1.00x but in MaxText's FSDP x TP on
data=4 x model=2: 1.03x, scanned 1.09x): the reductions, the scale's barrier and the GEMM are plain StableHLO that XLA
partitions itself; xla_fp4_block_amax and xla_fp4_qdq carry a Shardy rule and a registered custom-call partitioner
(python/xla_fp4/sharding/partition.py) that runs them on block-aligned shards of any dim, the quantization axis
included (tensor parallelism shards K). A fprop's activation and a dgrad's output gradient leave the sharding of
their K to the dot (`k_follows_dot`), so that XLA gathers such a tensor before the kernels, once for every reader
that needs it gathered, not each quantized version of it (1.21x the bytes before, docs/design.md §5).
`register_ffi_target_as_batch_partitionable` was not used: it covers leading batch dims only. The plain-StableHLO
twins of the kernels were not used: the kernels are faster. The scale and the key are: they are the twins
`kernel_twins.decode_scale` and `stochastic_key`, lowered into private functions (`Twins`), one per operand
signature. Lowering one costs 11-16 ms (measured), so each signature is lowered once per process: on a 7-layer
sharded train step the first compilation's pass time grows from 0.06 s to 0.32 s and later ones stay at 0.03 s
(measured). The partitioned form quantizes bit for bit as the whole-tensor kernel does (tests/sharding), and that
kernel as its twin (tests/kernels).
Measured on a 2048x1024 f32 operand, block_amax takes 0.33 ms along axis 0 against 1.06 ms for XLA's select/abs/max
reduction, and 1.23 ms with the RHT against 2.18 ms for xla_fp4_rht + that reduction; along the last axis 0.94 ms
(4.8 ms with the RHT, which the pass only applies to wgrad operands, quantized along their leading token axis).
Several contracting dims (a wgrad over batch and sequence) are merged into one, in place when they are adjacent, else
after a transpose to (batch, free, K). A nearest-rounded operand is quantized
once and reused by every dot that reads it the same way (q, k and v projections of one input; a dgrad and its fprop's
16x16-tiled weight, the same values along either axis, unless every device holds the weight whole: then the dgrad
quantizes it anew rather than hold its q·scale across the step). In the backward the gradient operand is quantized
first, and its decode scale is the key of the other operand's nearest-rounded qdq (which ignores it): XLA then
quantizes what the forward computed where the backward reads it, not in the forward (docs/design.md §5).
Stochastic-rounding keys are `digest(operand) ^ fold_in(seed, site)`: the digest is a wrapping uint32 sum of the
operand's bits, so keys change every step and differ between layers, yet are reproducible; in a partitioned program
each shard xors its own salt into the key.
In a scanned stack with high-precision blocks, each operand is `stablehlo.select(block in keep, x, q·scale)` (and s_dec
= 1 in kept iterations): one GEMM per iteration, and a weight that FSDP all-gathers is gathered once, after the
select, for all the dots that read it (a case around the whole dot made every dot gather the weight in its own
branch: MaxText under FSDP on 8 host devices moved 1.27x the bytes, measured). Kept iterations thus run the dot in the
operands' precision with f32 accumulation, rounded once to the output dtype, and quantize for nothing (the price of
the select). A case per operand would spare that work. It was dropped when it gave MaxText's scanned decoder a
wrong forward (step-0 loss 6.131 against 6.193), which came from the kernels' calls leaving their layouts free: XLA
gave a kernel's result a transposed layout. Every call now fixes row-major layouts (`kernels.custom_call`), and with
that the case per operand gives 6.193 too.
The packed form keeps a case around the whole dot (the original dot, or the FP4 GEMM on packed operands). The block
index is passed into the scan body function as an extra argument when needed.

Kernels come from a `KernelSet`: `FfiKernels` emits custom calls to the C++/CUDA FFI targets; `ReferenceKernels` emits
calls to the kernels' twins, lowered the same way (platforms without compiled kernels).
Form.PACKED (the `native` backend) is a second GEMM emitter in the same `Emitter.emit`: operands are made K-major,
quantized to the packed format (`xla_fp4_quantize_packed`) and multiplied by `xla_fp4_gemm_packed` (cuBLASLt FP4 on
sm_100+, the C++ reference GEMM on CPU) with alpha = s_dec_a * s_dec_b; scales, keys, RHT and the per-iteration select
are shared.
"""

import hashlib
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.numerics import formats
from xla_fp4.numerics import kernel_twins
from xla_fp4.passes.analyze import visible
from xla_fp4.passes.policy import Form
from xla_fp4.sharding import partition

_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _tensor_type(v):
  return ir.RankedTensorType(v.type)


def _scalar(dtype_ir):
  return ir.RankedTensorType.get([], dtype_ir)


def _f32():
  return ir.F32Type.get()


def _u32():
  return ir.IntegerType.get_unsigned(32)


def _const(value, ir_type):
  """A scalar constant of an f32, u32 or signed/unsigned integer MLIR type."""
  if isinstance(ir_type, ir.F32Type):
    np_dtype = np.float32
  else:
    int_type = ir.IntegerType(ir_type)
    np_dtype = np.dtype(f"{'u' if int_type.is_unsigned else 'i'}{int_type.width // 8}")
  return hlo.ConstantOp(ir.DenseElementsAttr.get(np.array(value, np_dtype),
                                                 type=ir.RankedTensorType.get([], ir_type))).result


def _broadcast(scalar, like_type):
  return hlo.BroadcastInDimOp(like_type, scalar, ir.DenseI64ArrayAttr.get([])).result


class KernelSet(typing.Protocol):
  """What the emitter calls to quantize (all ops take and return MLIR values; attributes as in xla_fp4/kernels.py).
  `has_packed`: whether quantize_packed and gemm_packed exist, i.e. whether the native backend can run."""
  has_packed: bool

  def qdq_with_scale(self, x, salt, **attrs): ...
  def block_amax(self, x, **attrs): ...
  def qdq(self, x, s_dec, key, *, k_follows_dot=False, **attrs): ...


class FfiKernels:
  """Custom calls to the compiled FFI targets (C++ on CPU, CUDA on GPU); contract in xla_fp4/kernels.py."""
  has_packed = True

  def __init__(self, partitioned=False):
    from xla_fp4 import kernels  # the compiled extension is only needed on this path
    self.targets = kernels
    # In a partitioned program the block-local calls carry their Shardy rule (xla_fp4/sharding/partition.py).
    self.partitioned = partitioned
    self._configs = {}

  def _custom_call(self, target, result_types, operands, attrs, k_follows_dot=False):
    key = (target, tuple(sorted(attrs.items())))
    config = self._configs.get(key)
    if config is None:
      config = self._configs[key] = self.targets.backend_config_attributes(target, attrs)
    op = self.targets.custom_call(target, result_types, operands, config)
    if self.partitioned and target in partition.PARTITIONED_TARGETS:
      op.attributes["sdy.sharding_rule"] = partition.sharding_rule(target, [o.type for o in operands], result_types,
                                                                   attrs, k_follows_dot)
    return op

  def _call(self, target, result_type, operands, **attrs):
    return self._custom_call(target, [result_type], operands, attrs).result

  def qdq_with_scale(self, x, salt, **attrs):
    op = self._custom_call(self.targets.QDQ_WITH_SCALE_TARGET, [x.type, _scalar(_f32())], [x],
                           dict(attrs, salt=salt))
    return op.results[0], op.results[1]

  def block_amax(self, x, **attrs):
    return self._call(self.targets.BLOCK_AMAX_TARGET, _block_amax_type(x, attrs["axis"]), [x], **attrs)

  def qdq(self, x, s_dec, key, *, axis, block_2d, stochastic, rht, rht_seed, k_follows_dot=False):
    attrs = dict(axis=axis, block_2d=block_2d, stochastic=stochastic, rht=rht, rht_seed=rht_seed,
                 apply_global_scale=False)
    return self._custom_call(self.targets.QDQ_TARGET, [x.type], [x, s_dec, key], attrs, k_follows_dot).result

  def quantize_packed(self, x, s_dec, key, **attrs):
    """(rows, K) -> (data u8 (rows, K/2), swizzled scales u8)."""
    from xla_fp4.numerics.packing import padded_scale_shape
    rows, k = _tensor_type(x).shape
    u8 = ir.IntegerType.get_unsigned(8)
    types = [ir.RankedTensorType.get([rows, k // 2], u8),
             ir.RankedTensorType.get([int(np.prod(padded_scale_shape(rows, k)))], u8)]
    op = self._custom_call(self.targets.QUANTIZE_PACKED_TARGET, types, [x, s_dec, key], attrs)
    return op.results[0], op.results[1]

  def gemm_packed(self, a, b, alpha, result_type):
    return self._call(self.targets.GEMM_PACKED_TARGET, result_type, [a[0], a[1], b[0], b[1], alpha])


def _block_amax_type(x, axis):
  shape = list(_tensor_type(x).shape)
  shape[axis] //= formats.BLOCK
  return ir.RankedTensorType.get(shape, _f32())


# Twin signature -> its StableHLO text: lowering a twin costs 11-16 ms (measured), parsing the text back well under
# one, so each signature is lowered once per process and every later compilation reuses it.
_LOWERED_TEXT = {}


class Twins:
  """Calls to private functions lowered from the pure-JAX twins (xla_fp4.numerics.kernel_twins) into `module`: one
  function per twin, operand types and parameters."""

  def __init__(self, module):
    self.module = module
    self.names = set()

  def call(self, fn, operands, result_types, **params):
    arg_types = [o.type for o in operands]
    sig = repr((fn.__module__, fn.__name__, [str(t) for t in arg_types], sorted(params.items())))
    name = "xla_fp4_twin_" + fn.__name__ + "_" + hashlib.sha256(sig.encode()).hexdigest()[:12]
    if name not in self.names:
      if name not in ir.SymbolTable(self.module.operation):  # another Twins on this module may have defined it
        self._define(name, sig, fn, arg_types, params)
      self.names.add(name)
    return func_dialect.CallOp(result_types, ir.FlatSymbolRefAttr.get(name), operands).results

  def _define(self, name, sig, fn, arg_types, params):
    text = _LOWERED_TEXT.get(sig)
    if text is None:
      avals = [jax.ShapeDtypeStruct(tuple(ir.RankedTensorType(t).shape),
                                    _DTYPES.get(str(ir.RankedTensorType(t).element_type), jnp.uint32))
               for t in arg_types]
      # Outside the user's mesh (the pass runs inside their jit): a twin takes whole tensors, and its functions must
      # not name a mesh that the module lacks.
      with jax.set_mesh(None):
        lowered = jax.jit(lambda *a: fn(*a, **params), keep_unused=True).lower(*avals)
      text = _LOWERED_TEXT[sig] = lowered.as_text(debug_info=False)
    helper = ir.Module.parse(text, context=self.module.context)
    funcs = [op for op in helper.body.operations if op.operation.name == "func.func"]  # not a mesh JAX may add
    for op in funcs:  # rename every symbol first, so that calls between helper functions follow
      sym = ir.StringAttr(op.attributes["sym_name"]).value
      new = name if sym == "main" else f"{name}_{sym}"
      ir.SymbolTable.replace_all_symbol_uses(sym, new, helper.operation)
      op.attributes["sym_name"] = ir.StringAttr.get(new)
      op.attributes["sym_visibility"] = ir.StringAttr.get("private")
      for attr in ("arg_attrs", "res_attrs"):
        if attr in op.attributes:
          del op.attributes[attr]
    for op in funcs:
      self.module.body.append(op.clone())


class ReferenceKernels:
  """The kernels as calls to their pure-JAX twins (Twins); for platforms without compiled kernels."""
  has_packed = False

  def __init__(self, module):
    self.twins = Twins(module)

  def qdq_with_scale(self, x, salt, **params):
    salt = _const(salt, _u32())  # an operand, so that all sites share one function per shape and recipe
    return tuple(self.twins.call(kernel_twins.qdq_with_scale, [x, salt], [x.type, _scalar(_f32())], **params))

  def block_amax(self, x, **params):
    return self.twins.call(kernel_twins.block_amax, [x], [_block_amax_type(x, params["axis"])], **params)[0]

  def qdq(self, x, s_dec, key, *, k_follows_dot=False, **params):  # XLA partitions the twins itself
    return self.twins.call(kernel_twins.qdq, [x, s_dec, key], [x.type], **params)[0]


class Emitter:
  """Emits the NVFP4 pattern for one dot at a time."""

  def __init__(self, kernels, twins, seed, matrix_gemm=False):
    self.kernels = kernels
    self.twins = twins  # Twins of the module being rewritten
    self.seed = seed
    # XLA CPU fails at run time on some bf16 x bf16 -> f32 dots whose operands have several free dims ("Unsupported
    # element type for DotThunk::Execute", e.g. the wgrad of a two-contracting-dim einsum); as (batch, rows, cols)
    # matrices, which a reshape gives when the contracting dim is first or last, they run (_as_matrices).
    self.matrix_gemm = matrix_gemm
    # value -> [(blocking, selector, q·scale, s_dec)] of the nearest-rounded quantizations of it or of reshapes of it
    self._quantized = {}
    self._selectors = {}  # (block index, kept blocks) -> whether the iteration is kept (_selector)
    self._reshapes = {}  # (source value, shape) -> its reshape (_reshaped)

  def _scale_and_key(self, x, axis, recipe, site_id):
    """The global decode scale of x (after the RHT where it applies) and the stochastic-rounding key, as the
    partitioned pattern computes them: per-block maxima (block-local, so each shard measures its own), then the twins
    kernel_twins.decode_scale (a plain max reduce, which XLA partitions into a scalar all-reduce) and stochastic_key."""
    blocks = self.kernels.block_amax(x, axis=axis, rht=recipe.rht, rht_seed=self.seed)
    s_dec = self.twins.call(kernel_twins.decode_scale, [blocks], [_scalar(_f32())])[0]
    stochastic = recipe.rounding == "stochastic"
    salt = _const(formats.fold_in_int(self.seed, site_id), _u32())
    key = self.twins.call(kernel_twins.stochastic_key, [x, salt], [_scalar(_u32())])[0] if stochastic else salt
    return s_dec, key, stochastic

  def _operand(self, x, axis, recipe, site_id, user, whole, select, k_follows_dot, after=None, fresh=False):
    """-> (q·scale in x's dtype, s_dec f32 scalar); with `select` (whether the iteration of a scanned stack with kept
    blocks is kept), `stablehlo.select`s that give (x, 1.0) in kept iterations instead. `k_follows_dot`: x is the
    activation (or output gradient) of a fprop (dgrad), whose K the weight's sharding decides (sharding/partition.py).

    Nearest rounding gives the same q wherever the same elements are quantized in the same blocks (_blocking), so
    each such operand is quantized once while the result is visible, and reshaped where another dot reads a reshape
    of it: the q, k and v projections of one input share it, and a dgrad reuses its fprop's 16x16-tiled weight (the
    recipe's "same quantized values as in fprop"), also where one of them merges the weight's dims (attention's
    (D, heads, head_dim) projections). `whole`: the kernel measures its operand itself (Form.WHOLE_TENSOR) instead of
    the reductions around it that a partitioned program needs for a global amax.

    `after` (a f32 scalar of the backward: the gradient's decode scale) orders a new nearest-rounded quantization of
    a tensor that the forward computed: otherwise XLA may quantize it as soon as the forward has it and hold the
    q·scale until the backward reads it, beside the tensor itself (_quantize). `fresh`: quantize anew rather than
    reuse, for a dgrad's weight that every device holds whole (_emulated_gemm)."""
    stochastic = recipe.rounding == "stochastic"
    source = _reshape_source(x)
    blocking = _blocking(_tensor_type(x).shape, axis, recipe.block_2d, recipe.rht)
    if not stochastic and not fresh:
      for (b, sel, q, s_dec) in self._quantized.get(source, ()):
        # Dots are rewritten in program order, so a q in the user's own block precedes it.
        if b == blocking and _same_selector(sel, select) and _before_in_program_order(q, user):
          return self._reshaped(q, _tensor_type(x).shape, user), s_dec
    q, s_dec = self._quantize(x, axis, recipe, site_id, whole, k_follows_dot, after)
    if select is not None:
      q = hlo.SelectOp(select, x, q).result
      s_dec = hlo.SelectOp(select, _const(1.0, _f32()), s_dec).result
    if not stochastic and not fresh:
      self._quantized.setdefault(source, []).append((blocking, select, q, s_dec))
    return q, s_dec

  def _quantize(self, x, axis, recipe, site_id, whole, k_follows_dot, after=None):
    stochastic = recipe.rounding == "stochastic"
    if whole:
      return self.kernels.qdq_with_scale(x, axis=axis, block_2d=recipe.block_2d, stochastic=stochastic,
                                         rht=recipe.rht, rht_seed=self.seed,
                                         salt=formats.fold_in_int(self.seed, site_id))
    s_dec, key, _ = self._scale_and_key(x, axis, recipe, site_id)
    if after is not None and not stochastic:
      # A nearest-rounded qdq ignores its key (xla_fp4/kernels.py), so the key can carry the ordering: XLA cannot run
      # the call before `after` exists. Holding the wgrads' RHT-quantized activations from the forward cost 1.32x the
      # temporary memory of the unrewritten step under tensor parallelism (float32, benchmarks/sharding.py).
      key = hlo.BitcastConvertOp(_scalar(_u32()), after).result
    q = self.kernels.qdq(x, s_dec, key, axis=axis, block_2d=recipe.block_2d, stochastic=stochastic,
                         rht=recipe.rht, rht_seed=self.seed, k_follows_dot=k_follows_dot)
    return q, s_dec

  def emit(self, dot, plan, block_value=None):
    """Insert `plan`'s pattern for `dot` (a policy.Plan); returns the value that replaces its result (same type).

    In a scanned stack with high-precision blocks (`block_value` is the iteration's block index) one GEMM runs per
    iteration. In the emulated forms a `stablehlo.select` per operand gives the GEMM the operand itself in kept
    iterations and its q·scale in the others, so a weight that a layout all-gathers is gathered once, after the
    select, for every dot that reads it (as without the pass); the packed form's `stablehlo.case` holds the original
    dot in one branch and the FP4 GEMM in the other."""
    site, keep_blocks = plan.site, plan.decision.keep_blocks
    with ir.InsertionPoint(dot), ir.Location.name(f"xla_fp4/{site.layer or 'dot'}/{site.role}", dot.location):
      select = self._selector(block_value, keep_blocks, dot) if keep_blocks and block_value is not None else None
      if plan.form is not Form.PACKED:
        return self._emulated(dot, plan, select)
      if select is None:
        return self._native_gemm(dot, site, plan.decision)
      i32 = ir.IntegerType.get_signless(32)
      case = hlo.CaseOp([dot.results[0].type], hlo.SelectOp(select, _const(0, i32), _const(1, i32)).result, 2)
      with ir.InsertionPoint(case.regions[0].blocks.append()):
        hlo.ReturnOp([dot.operation.clone().results[0]])
      with ir.InsertionPoint(case.regions[1].blocks.append()):
        hlo.ReturnOp([self._native_gemm(dot, site, plan.decision)])
      return case.results[0]

  def _selector(self, block, keep_blocks, user):
    """_kept, once per block index value and kept blocks while it is visible: the dots of one iteration then share it,
    and _operand's reuse can tell that they select alike."""
    return self._visible_cached(self._selectors, (block, tuple(keep_blocks)), user,
                                lambda: self._kept(block, keep_blocks))

  @staticmethod
  def _visible_cached(cache, key, user, make):
    """cache[key] where it is visible at `user` (in program order), else a fresh make(), stored there."""
    value = cache.get(key)
    if value is None or not _before_in_program_order(value, user):
      value = cache[key] = make()
    return value

  def _emulated(self, dot, plan, select):
    acc, alpha = self._emulated_gemm(dot, plan.site, plan.decision, plan.form is Form.WHOLE_TENSOR, select)
    out_type = _tensor_type(dot.results[0])
    y = hlo.MulOp(acc, _broadcast(alpha, _tensor_type(acc))).result  # fold both s_dec into the f32 output
    if out_type.element_type != _f32():
      y = hlo.ConvertOp(out_type, y).result
    return y

  def _reshaped(self, x, shape, user):
    """x reshaped to `shape`: one reshape per source value (_reshape_source) and shape while it is visible. The q, k
    and v wgrads then see the same merged activation, which _operand quantizes once, and XLA sees one value where
    two dots read a weight alike, which a layout then gathers once (an all-gather per reshape otherwise: MaxText's
    attention weights under FSDP, measured)."""
    source = _reshape_source(x)
    if list(_tensor_type(source).shape) == list(shape):
      return source
    t = ir.RankedTensorType.get(list(shape), _tensor_type(x).element_type)
    return self._visible_cached(self._reshapes, (source, tuple(shape)), user, lambda: hlo.ReshapeOp(t, source).result)

  def _emulated_gemm(self, dot, site, decision, whole, select):
    """The dot_general on q·scale operands (with `select`, on the operands themselves in kept iterations),
    accumulated in f32 -> (acc, s_dec_a * s_dec_b).

    With one contracting dim per operand the kernels quantize along it in place. Several (a wgrad over batch and
    sequence, an einsum over heads) are merged into one: in place by a reshape when they are adjacent and in order on
    both sides (a wgrad's leading batch x sequence: no data moves), else by making each operand (batch, free, K)."""
    (lc, rc), (lb, rb) = site.contracting, site.batch
    lhs, rhs = dot.operands[0], dot.operands[1]
    dims = dot.attributes["dot_dimension_numbers"]
    if len(lc) == 1:
      la, ra = lc[0], rc[0]
    elif _adjacent(lc) and _adjacent(rc):
      lhs, rhs = (self._reshaped(v, _merged_shape(v, c), dot) for v, c in ((lhs, lc), (rhs, rc)))
      la, ra = lc[0], rc[0]
      dims = hlo.DotDimensionNumbers.get(
          lhs_batching_dimensions=[_after_merge(d, lc) for d in lb],
          rhs_batching_dimensions=[_after_merge(d, rc) for d in rb],
          lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
    else:
      lhs, rhs = _canonical(lhs, lb, lc), _canonical(rhs, rb, rc)
      la, ra = len(_tensor_type(lhs).shape) - 1, len(_tensor_type(rhs).shape) - 1
      batch = list(range(len(lb)))
      dims = hlo.DotDimensionNumbers.get(lhs_batching_dimensions=batch, rhs_batching_dimensions=batch,
                                         lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
    follows = [site.role in ("fprop", "dgrad") and i != site.weight_operand for i in (0, 1)]
    operands, axes, recipes = [lhs, rhs], [la, ra], [decision.lhs, decision.rhs]
    quantized = [None, None]
    # In the backward the gradient goes first (JAX's transpose rule: a wgrad's lhs, a dgrad's non-weight operand); its
    # decode scale then orders the other operand, which the forward computed (_operand's `after`). A dgrad quantizes
    # a weight that every device holds whole anew, at no communication, rather than hold its fprop's q·scale across
    # the step (one weight per layer: 1.35x the temporary memory under data parallelism, float32); a sharded weight
    # reuses it, as a recomputation would gather it again (FSDP: 1.44x the collective bytes, measured).
    grad = {"wgrad": 0, "dgrad": 1 - (site.weight_operand or 0)}.get(site.role)
    after = None  # the gradient's s_dec once it is quantized (whole tensors have no key to carry it: _quantize)
    for i in ((1, 0) if grad == 1 else (0, 1)):
      fresh = site.role == "dgrad" and i == site.weight_operand and site.weight_replicated and not whole
      quantized[i] = self._operand(operands[i], axes[i], recipes[i], 2 * site.index + i, dot, whole, select,
                                   follows[i], after, fresh)
      if i == grad:
        after = quantized[i][1]
    (qa, sa), (qb, sb) = quantized
    acc_type = ir.RankedTensorType.get(_tensor_type(dot.results[0]).shape, _f32())
    kwargs = {}
    if "precision_config" in dot.attributes:
      kwargs["precision_config"] = dot.attributes["precision_config"]
    matrices = _as_matrices(qa, qb, dims, lambda v, shape: self._reshaped(v, shape, dot)) \
        if self.matrix_gemm and _tensor_type(qa).element_type != _f32() else None
    if matrices is None:
      acc = hlo.DotGeneralOp(acc_type, qa, qb, dims, **kwargs).result
    else:
      qa, qb, dims, shape = matrices
      acc = hlo.DotGeneralOp(ir.RankedTensorType.get(shape, _f32()), qa, qb, dims, **kwargs).result
      acc = hlo.ReshapeOp(acc_type, acc).result  # (batch, lhs free, rhs free): the dot's own output order
    return acc, hlo.MulOp(sa, sb).result

  def _native_gemm(self, dot, site, decision):
    """Packed E2M1 operands, K-major ("TN"), and the FP4 GEMM, which applies alpha = s_dec_a * s_dec_b to its f32
    accumulator and writes the dot's own output type (f32, bf16 or f16), as cuBLASLt's epilogue does."""
    (lc, rc), _ = site.contracting, site.batch
    a = _matrix(_canonical(dot.operands[0], (), lc))  # (M, K)
    b = _matrix(_canonical(dot.operands[1], (), rc))  # (N, K)
    pa, sa = self._packed(a, decision.lhs, 2 * site.index)
    pb, sb = self._packed(b, decision.rhs, 2 * site.index + 1)
    alpha = hlo.MulOp(sa, sb).result
    m, n = _tensor_type(a).shape[0], _tensor_type(b).shape[0]
    out_type = _tensor_type(dot.results[0])
    y = self.kernels.gemm_packed(pa, pb, alpha, ir.RankedTensorType.get([m, n], out_type.element_type))
    return hlo.ReshapeOp(out_type, y).result

  def _packed(self, x, recipe, site_id):
    s_dec, key, stochastic = self._scale_and_key(x, 1, recipe, site_id)
    packed = self.kernels.quantize_packed(x, s_dec, key, block_2d=recipe.block_2d, stochastic=stochastic,
                                          rht=recipe.rht, rht_seed=self.seed)
    return packed, s_dec

  @staticmethod
  def _kept(block, keep_blocks):
    """Whether `block` is one of `keep_blocks` (high precision): an i1 scalar."""
    etype = _tensor_type(block).element_type
    kept = None
    for b in keep_blocks:
      c = hlo.CompareOp(block, _const(b, etype), hlo.ComparisonDirectionAttr.get("EQ")).result
      kept = c if kept is None else hlo.OrOp(kept, c).result
    return kept


def _as_matrices(a, b, dims, reshape):
  """(a, b, dims, output shape) with each operand reshaped (reshape(value, shape)) to (batch..., free, K) or
  (batch..., K, free): possible when its batch dims lead and its one contracting dim is first or last among the rest
  (no data moves); else None."""
  dn = hlo.DotDimensionNumbers(dims)
  out, new_dims = [], []
  for x, batch, contract in ((a, dn.lhs_batching_dimensions, dn.lhs_contracting_dimensions),
                             (b, dn.rhs_batching_dimensions, dn.rhs_contracting_dimensions)):
    shape, nb = list(_tensor_type(x).shape), len(batch)
    if list(batch) != list(range(nb)) or len(contract) != 1 or contract[0] not in (nb, len(shape) - 1):
      return None
    k_last = contract[0] == len(shape) - 1
    free = math.prod(shape[nb:-1] if k_last else shape[nb + 1:])
    matrix = shape[:nb] + ([free, shape[-1]] if k_last else [shape[nb], free])
    out.append(reshape(x, matrix))
    new_dims.append((nb + 1 if k_last else nb, free))
  batch = list(range(len(dn.lhs_batching_dimensions)))
  shape = list(_tensor_type(a).shape)[:len(batch)] + [new_dims[0][1], new_dims[1][1]]
  dims = hlo.DotDimensionNumbers.get(lhs_batching_dimensions=batch, rhs_batching_dimensions=batch,
                                     lhs_contracting_dimensions=[new_dims[0][0]],
                                     rhs_contracting_dimensions=[new_dims[1][0]])
  return out[0], out[1], dims, shape


def _reshape_source(x):
  """The value that x is a chain of reshapes of (x itself if none): the same elements in row-major order."""
  while not isinstance(x.owner, ir.Block) and x.owner.name == "stablehlo.reshape":
    x = x.owner.operands[0]
  return x


def _blocking(shape, axis, block_2d, rht):
  """Which elements, in row-major order, share a scale (and an RHT) when a tensor of `shape` is quantized along `axis`
  (numerics/nvfp4.py _encode): viewed as the matrix (outer * K, inner), a 1x16 block is 16 consecutive rows of one
  column (K % 16 == 0: no block straddles two outer indices) and the RHT mixes the same 16 values; a 16x16 tile is 16
  rows by 16 columns of that matrix, or of (outer, K) when inner is 1. Two quantizations with equal blocking, of a
  tensor and of a reshape of it, give the same q in row-major order (tests/passes/test_reuse.py)."""
  outer, k, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
  return (block_2d, rht) + ((outer, k) if block_2d and inner == 1 else (outer * k, inner))


def _same_selector(a, b):
  """Whether two quantizations select alike: neither is per iteration, or both on the same branch index value."""
  return a is None and b is None or (a is not None and b is not None and a == b)


def _before_in_program_order(value, op):
  """visible(), for a value the rewrite made for an earlier dot: dots are rewritten in program order, so one in op's
  own block precedes it (is_before_in_block is the costly part of visible)."""
  owner = value.owner.operation if hasattr(value.owner, "operation") else value.owner
  return owner.block == op.block or visible(value, op)


def _adjacent(dims):
  return list(dims) == list(range(dims[0], dims[0] + len(dims)))


def _merged_shape(x, dims):
  """x's shape with the adjacent dims `dims` (in order) merged into one at dims[0]: row-major, so no data moves."""
  shape = list(_tensor_type(x).shape)
  return shape[:dims[0]] + [math.prod(shape[d] for d in dims)] + shape[dims[-1] + 1:]


def _after_merge(d, dims):
  """The number of dim `d` (not in `dims`) once `dims` are merged."""
  return d if d < dims[0] else d - (len(dims) - 1)


def _canonical(x, batch, contract):
  """Transpose to (batch, free, contract) and merge the contracting dims into one trailing dim K."""
  t = _tensor_type(x)
  rank = len(t.shape)
  free = [d for d in range(rank) if d not in batch and d not in contract]
  perm = list(batch) + free + list(contract)
  if perm != list(range(rank)):
    x = hlo.TransposeOp(x, ir.DenseI64ArrayAttr.get(perm)).result
  if len(contract) != 1:
    kept = [t.shape[d] for d in list(batch) + free]
    x = hlo.ReshapeOp(ir.RankedTensorType.get(kept + [math.prod(t.shape[d] for d in contract)], t.element_type),
                      x).result
  return x


def _matrix(x):
  """(free..., K) -> (prod(free), K)."""
  t = _tensor_type(x)
  if len(t.shape) == 2:
    return x
  return hlo.ReshapeOp(ir.RankedTensorType.get([math.prod(t.shape[:-1]), t.shape[-1]], t.element_type), x).result


def plumb_block_value(value, entry_call, func_op):
  """Make `value` (visible at `entry_call`) available inside `func_op` by adding an argument; returns it there."""
  block = func_op.regions[0].blocks[0]
  arg = block.add_argument(value.type, ir.Location.unknown())
  ftype = ir.FunctionType(ir.TypeAttr(func_op.attributes["function_type"]).value)
  func_op.attributes["function_type"] = ir.TypeAttr.get(
      ir.FunctionType.get(list(ftype.inputs) + [value.type], list(ftype.results)))
  if "arg_attrs" in func_op.attributes:
    attrs = list(ir.ArrayAttr(func_op.attributes["arg_attrs"]))
    func_op.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs + [ir.DictAttr.get({})])
  with ir.InsertionPoint(entry_call), entry_call.location:
    new_call = func_dialect.CallOp([r.type for r in entry_call.results], entry_call.attributes["callee"],
                                   list(entry_call.operands) + [value])
  for old, new in zip(entry_call.results, new_call.results):
    old.replace_all_uses_with(new)
  entry_call.erase()
  return arg
