"""The emitter: the NVFP4 pattern of one planned dot (policy.Plan) at the dot, returning the value that replaces it.

Emulated forms (the GEMM in high precision on q·scale operands, f32 accumulation, both decode scales folded into the
output as cuBLASLt's alpha):
  Form.WHOLE_TENSOR   %q, %s = xla_fp4_qdq_with_scale(%x)   one call per operand measures it (amax, key) itself
  Form.PARTITIONED    %b(, %d) = xla_fp4_block_amax(%x) {digest where stochastic}; %s = decode_scale twin(%b) (a max
                      reduce XLA turns into an all-reduce); %key = %salt ^ digest_of_blocks twin(%d) (a sum,
                      all-reduced; once per value, reuse.py) or the salt; %q = xla_fp4_qdq(%x, %s, %key)
  then                %acc = dot_general(%qa, %qb) -> f32;  %y = convert(%acc * (%sa * %sb))
Form.PACKED: each operand read as a matrix in place where its contracting dims lead or trail (`dims.as_read`: (K, rows)
or (rows, K), a reshape; else a K-major copy), xla_fp4_quantize_packed along K (codes + E4M3 scales, K-major: where
K leads, the uint8 codes and scales are transposed, not the wide operand) and xla_fp4_gemm_packed with alpha =
s_dec_a * s_dec_b, which writes the dot's own output type. The decode scales come as
in Form.PARTITIONED (block maxima, then a max that XLA all-reduces), so the form partitions (sharding/packed.py): in a
partitioned program it is also the emulate backend's form, the GEMM's `emulate` making shards dequantize and use
XLA's dot; packed operands are what the partitioner moves between devices. A weight in 16x16 tiles with nearest
rounding is packed once: a dgrad takes its forward's codes as Bᵀ (xla_fp4_gemm_packed {b_transposed}), so both GEMMs
read one value, which FSDP gathers once (reuse.py).
Form.GROUPED (expert GEMMs, numerics/grouped.py's twins lowered into the program):
  a dot_general with group dims (Grouping.SLICES), e.g. on CPU a ragged dot's forward, which contracts the group dim G
  of %xg = select(%mask, broadcast(%x), 0) [G, M, K] and %w [G, K, N]:
                      %qx, %sx = slice_qdq(%xg, %salt) {groups = [0], axis = 2}   (%sx: f32[G], one per group)
                      %qw, %sw = slice_qdq(%w, %salt') {groups = [0], axis = 1, block_2d}
                      %acc = dot_general %qx, %qw, contracting_dims = [2, 0] x [1, 0] -> f32   (as the program's)
                      %y = masked_output(%acc, %mask, %sx, %sw)   (alpha of each row's group)
  an expert einsum (`ecd,edf->ecf`): the GEMM batched over the experts, %y = scaled_output(%acc, %sx, %sw)
  a chlo.ragged_dot:  %y = ragged_rows(%x, %w, %group_sizes, %salt, %salt')        (forward, dgrad)
                      %y = ragged_contracting(%x, %dy, %group_sizes, %salt, %salt') (wgrad)
  one ragged GEMM on the quantized operands inside, as many FLOPs as the original.
Form.PACKED_GROUPED (expert GEMMs under the native backend): with one group dim per operand, per expert e the
  operands' slices %x_e, %w_e packed with their own decode scales and %y_e = xla_fp4_gemm_packed -> f32; then the
  %y_e stacked along the expert dim (an einsum's batch dim) or summed in expert order (a contracted group dim), in
  the dot's type. A chlo.ragged_dot:
                      %a, %as, %b, %bs, %alpha = ragged_rows_packed(%x, %w, %group_sizes, %salt, %salt')
                      %y = xla_fp4_ragged_gemm_packed(%a, %as, %b, %bs, %group_sizes, %alpha) {ragged_k = false}
  (forward, dgrad); the wgrad's twin ragged_contracting_packed also returns its groups' padded sizes, which the GEMM
  takes with ragged_k = true (the groups split K) -> [G, K, N].

Per-iteration select of a scanned stack with kept blocks (`block_value` is the iteration's block index): in the
emulated forms a `stablehlo.select` per operand gives the GEMM the operand itself (and s_dec = 1) in kept iterations
and its q·scale in the others: one GEMM per iteration, and a weight that a layout all-gathers is gathered once, after
the select, for every dot that reads it (a case around the whole dot made each dot gather its weight in its own
branch: MaxText under FSDP moved 1.27x the bytes, measured). The packed form holds the original dot and the FP4
GEMM in the two branches of a `stablehlo.case`.

With the `telemetry` option (probes.py) the emitter takes each GEMM's step first, quantizes the whole-tensor form with
xla_fp4_qdq_with_scale_stats (the same values, and the statistics of the quantization in recorded steps), and hands the
probes what it quantized (probes.Measure).

Operands follow their OperandPlan: quantized in the plan's order; `after_gradient` operands take the gradient's
decode scale, bitcast to uint32, as their key: a nearest-rounded qdq never reads its key, so this orders the call
after the gradient without changing a number (StableHLO has no control dependency). `fresh` operands are never
reused (reuse.py). Stochastic-rounding keys are `digest(operand) ^ fold_in(seed, salt_id)`: they change every step
and differ between layers, yet are reproducible.
"""

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from xla_fp4.kernels import targets
from xla_fp4.numerics import formats
from xla_fp4.numerics import grouped
from xla_fp4.numerics import kernel_twins
from xla_fp4.numerics import telemetry
from xla_fp4.passes.analysis import ragged
from xla_fp4.passes.analysis.records import Grouping
from xla_fp4.passes.analysis.trace import ragged_dot_dims
from xla_fp4.passes.policy import Form, Operand
from xla_fp4.passes.rewrite import dims
from xla_fp4.passes.rewrite.probes import Measure, device_rows_type
from xla_fp4.passes.rewrite.reuse import Reuse, blocking
from xla_fp4.passes.rewrite.values import broadcast, const, f32, scalar_type, tensor_type, u32

# The frontend attribute of a kept-iteration case: how many iterations of its stack run each branch ("kept,other").
BRANCH_RUNS = "xla_fp4_branch_runs"


class Emitter:
  def __init__(self, kernels, twins, seed, matrix_gemm=False, emulate=False, probes=None):
    self.kernels = kernels  # a kernel_sets.KernelSet
    self.twins = twins  # kernel_sets.Twins of the module being rewritten
    self.seed = seed
    self.probes = probes  # probes.Probes where the telemetry option is on
    self._measures = None  # while a GEMM with probes is emitted: its operands' probes.Measures
    self._output = None  # ... and the emulated GEMM's (f32 accumulator, alpha), from which its output is made
    self._step = None  # ... and its telemetry step (int32: -1 where not recorded)
    self._stats = {}  # q·scale value (or packed codes) -> the statistics row its quantizer computed (telemetry)
    # XLA CPU fails at run time on some bf16 x bf16 -> f32 dots whose operands have several free dims ("Unsupported
    # element type for DotThunk::Execute", e.g. the wgrad of a two-contracting-dim einsum); as (batch, rows, cols)
    # matrices (dims.as_matrices) they run.
    self.matrix_gemm = matrix_gemm
    self.emulate = emulate  # the packed GEMM's `emulate`: shards multiply dequantized operands (sharding/packed.py)
    self.reuse = Reuse()

  def emit(self, plan, block_value=None):
    """Insert `plan`'s pattern before its dot; returns the value that replaces the dot's result (same type)."""
    dot, site, keep_blocks = plan.record.op, plan.site, plan.decision.keep_blocks
    with ir.InsertionPoint(dot), ir.Location.name(f"xla_fp4/{site.layer or 'dot'}/{site.role}", dot.location):
      select = None
      if keep_blocks and block_value is not None:
        select = self.reuse.selector(block_value, keep_blocks, dot, lambda: _kept(block_value, keep_blocks))
      # Telemetry: the step is taken here, before the operands are quantized (whose kernels measure in recorded steps)
      # and outside a kept-iteration case (so that every iteration counts).
      probe = None if self.probes is None else self.probes.begin(plan, block_value, select)
      probed = lambda build: self._probed(plan, build, probe)  # noqa: E731
      runs = (len(keep_blocks), site.num_stacked - len(keep_blocks)) if select is not None else None
      if plan.form is Form.PACKED_GROUPED:
        native = self._native_per_expert if site.groups.kind is Grouping.SLICES else self._native_ragged
        return self._in_case(select, runs, dot, lambda: probed(lambda: native(plan)))
      if plan.form is Form.GROUPED and site.groups.kind is Grouping.SLICES:
        return probed(lambda: self._slices(plan, select))
      if plan.form is Form.GROUPED:
        return self._in_case(select, runs, dot, lambda: probed(lambda: self._ragged(plan)))
      if plan.form is not Form.PACKED:
        return probed(lambda: self._emulated(plan, select))
      return self._in_case(select, runs, dot, lambda: probed(lambda: self._native_gemm(plan)))

  def _probed(self, plan, build, probe):
    """`build()`, followed by the telemetry probes of its GEMM (probes.py) where `probe` (Probes.begin) is given."""
    if probe is None:
      return build()
    self._measures, self._output, self._step = ([], []), None, probe.value
    y = build()
    measures, output = self._measures, self._output
    self._measures, self._output, self._step = None, None, None
    self.probes.emit(plan, measures, output or y, probe, result=y)
    return y

  def _row_of(self, q):
    """The statistics row the quantizer of q computed (telemetry), or None. A reuse reshapes an earlier q (a weight
    its dgrad reads with dims merged, as MaxText's attention projections): the same elements, the same row."""
    return self._stats.get(dims.reshape_source(q))

  def _measure(self, i, **measure):
    if self._measures is not None:
      self._measures[i].append(Measure(**measure))

  @staticmethod
  def _in_case(select, runs, dot, build):
    """`build()`, or with `select` a stablehlo.case that runs the original op in kept iterations and `build()`'s
    pattern in the others. `runs` (kept, other iterations of the stack) goes with the case as the frontend attribute
    BRANCH_RUNS, so that a cost model of the compiled step weights each branch by how often it runs
    (sharding/cost.py) rather than taking the dearer one: a kept branch gathers its weight at full width."""
    if select is None:
      return build()
    i32 = ir.IntegerType.get_signless(32)
    case = hlo.CaseOp([dot.results[0].type], hlo.SelectOp(select, const(0, i32), const(1, i32)).result, 2)
    case.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
        {BRANCH_RUNS: ir.StringAttr.get(",".join(str(n) for n in runs))})
    with ir.InsertionPoint(case.regions[0].blocks.append()):
      hlo.ReturnOp([dot.operation.clone().results[0]])
    with ir.InsertionPoint(case.regions[1].blocks.append()):
      hlo.ReturnOp([build()])
    return case.results[0]

  # -- quantization ---------------------------------------------------------------------------------------------

  def _scale_and_key(self, x, axis, operand, user):
    """The global decode scale of x (after the RHT where it applies) and the stochastic-rounding key, as the
    partitioned pattern computes them: per-block maxima (block-local, so each shard measures its own), then the twins
    kernel_twins.decode_scale (a plain max reduce, which XLA partitions into a scalar all-reduce) and
    digest_of_blocks (a sum of the per-block digests, all-reduced likewise) where no earlier dot `user` sees has
    digested x's elements (reuse.py)."""
    recipe = operand.recipe
    digest = self.reuse.digest(x, user) if recipe.stochastic else None
    # The key's digest comes from the same pass over x (the kernel's per-block digests): as a reduction of its own,
    # XLA CPU materialized x's bits as uint32 for it (native 2D, float32: 1.003x -> 0.954x the temporary memory of
    # the unrewritten step, benchmarks/sharding.py), and a GPU would read x once more.
    measured = self.kernels.call(targets.BLOCK_AMAX, [x], dict(axis=axis, rht=recipe.rht, rht_seed=self.seed,
                                                                digest=recipe.stochastic and digest is None))
    s_dec = self.twins.call(kernel_twins.decode_scale, [measured[0]], [scalar_type(f32())], **_peers(operand))[0]
    salt = const(formats.fold_in_int(self.seed, operand.salt_id), u32())
    if not recipe.stochastic:
      return s_dec, salt
    if digest is None:
      digest = self.twins.call(kernel_twins.digest_of_blocks, [measured[1]], [scalar_type(u32())])[0]
      self.reuse.remember_digest(x, digest)
    return s_dec, hlo.XorOp(salt, digest).result

  def _operand(self, x, axis, operand, user, form, select, after):
    """-> (q·scale in x's dtype, s_dec f32 scalar) of x quantized along `axis` per `operand` (an OperandPlan); with
    `select`, `stablehlo.select`s that give (x, 1.0) in kept iterations instead. `after`: the gradient's decode scale
    where the plan orders this operand after it."""
    reusable = not operand.recipe.stochastic and not operand.fresh
    blocks = blocking(tensor_type(x).shape, axis, operand.recipe.block_2d, operand.recipe.rht)
    if reusable:
      found = self.reuse.quantized(x, blocks, select, user)
      if found is not None:
        return found
    q, s_dec = self._quantize(x, axis, operand, form, after, user)
    if select is not None:
      measured = self._stats.get(q)
      q = hlo.SelectOp(select, x, q).result
      if measured is not None:  # telemetry measures the quantization, in the iterations that run it
        self._stats[q] = measured
      s_dec = hlo.SelectOp(select, const(1.0, f32()), s_dec).result
    if reusable:
      self.reuse.remember(x, blocks, select, q, s_dec)
    return q, s_dec

  def _quantize(self, x, axis, operand, form, after, user):
    recipe = operand.recipe
    attrs = dict(axis=axis, block_2d=recipe.block_2d, stochastic=recipe.stochastic, rht=recipe.rht,
                 rht_seed=self.seed)
    if form is Form.WHOLE_TENSOR and self._step is not None:
      # Telemetry: the quantizer also measures what it does, in the same pass, in recorded steps.
      q, s_dec, row = self.kernels.call(targets.QDQ_WITH_SCALE_STATS, [x, self._step],
                                        dict(attrs, salt=self._salt_value(operand)))
      self._stats[q] = row
      return q, s_dec
    if form is Form.WHOLE_TENSOR:
      q, s_dec = self.kernels.call(targets.QDQ_WITH_SCALE, [x], dict(attrs, salt=self._salt_value(operand)))
      return q, s_dec
    s_dec, key = self._scale_and_key(x, axis, operand, user)
    if after is not None and not recipe.stochastic:
      # Holding the wgrads' RHT-quantized activations from the forward cost 1.32x the temporary memory of the
      # unrewritten step under tensor parallelism (float32, benchmarks/sharding.py).
      key = hlo.BitcastConvertOp(scalar_type(u32()), after).result
    if self._step is not None and getattr(self.kernels, "mesh", None) is not None:
      # Telemetry: each device's row of what the quantizer did to its shard, from the same pass (probes.py).
      q, rows = self.kernels.call(targets.QDQ_AND_STATS, [x, s_dec, key, self._step], attrs,
                                  result_types=[x.type, device_rows_type(self.kernels.mesh)],
                                  k_follows_dot=operand.k_follows_dot)
      self._stats[q] = rows
      return q, s_dec
    q = self.kernels.call(targets.QDQ, [x, s_dec, key], dict(attrs, apply_global_scale=False),
                          k_follows_dot=operand.k_follows_dot)[0]
    return q, s_dec

  # -- GEMMs ----------------------------------------------------------------------------------------------------

  def _emulated(self, plan, select):
    dot = plan.record.op
    acc, alpha = self._emulated_gemm(plan, select)
    if self._measures is not None:
      self._output = (acc, alpha)
    out_type = tensor_type(dot.results[0])
    y = hlo.MulOp(acc, broadcast(alpha, tensor_type(acc))).result  # fold both s_dec into the f32 output
    if out_type.element_type != f32():
      y = hlo.ConvertOp(out_type, y).result
    return y

  def _emulated_gemm(self, plan, select):
    """The dot_general on q·scale operands (with `select`, on the operands themselves in kept iterations),
    accumulated in f32 -> (acc, s_dec_a * s_dec_b). One contracting dim per operand is quantized in place; several
    are merged first (dims.py)."""
    dot, site = plan.record.op, plan.site
    (lc, rc), (lb, rb) = site.gemm.contracting, site.gemm.batch
    lhs, rhs = dot.operands[0], dot.operands[1]
    dimension_numbers = dot.attributes["dot_dimension_numbers"]
    if len(lc) == 1:
      la, ra = lc[0], rc[0]
    elif dims.adjacent(lc) and dims.adjacent(rc):
      lhs, rhs = (self.reuse.reshaped(v, dims.merged_shape(v, c), dot) for v, c in ((lhs, lc), (rhs, rc)))
      la, ra = lc[0], rc[0]
      dimension_numbers = hlo.DotDimensionNumbers.get(
          lhs_batching_dimensions=[dims.after_merge(d, lc) for d in lb],
          rhs_batching_dimensions=[dims.after_merge(d, rc) for d in rb],
          lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
    else:
      lhs, rhs = dims.canonical(lhs, lb, lc), dims.canonical(rhs, rb, rc)
      la, ra = len(tensor_type(lhs).shape) - 1, len(tensor_type(rhs).shape) - 1
      batch = list(range(len(lb)))
      dimension_numbers = hlo.DotDimensionNumbers.get(
          lhs_batching_dimensions=batch, rhs_batching_dimensions=batch,
          lhs_contracting_dimensions=[la], rhs_contracting_dimensions=[ra])
    values, axes, quantized, after = (lhs, rhs), (la, ra), [None, None], None
    for i in plan.order:
      operand = plan.operands[i]
      quantized[i] = self._operand(values[i], axes[i], operand, dot, plan.form, select,
                                   after if operand.after_gradient else None)
      self._measure(i, x=values[i], axis=axes[i], recipe=operand.recipe, salt=self._salt_value(operand),
                    q=quantized[i][0], s_dec=quantized[i][1], row=self._row_of(quantized[i][0]))
      if operand.kind is Operand.GRADIENT:
        after = quantized[i][1]
    (qa, sa), (qb, sb) = quantized
    return self._f32_dot(dot, qa, qb, dimension_numbers, tensor_type(dot.results[0]).shape), hlo.MulOp(sa, sb).result

  def _f32_dot(self, dot, qa, qb, dimension_numbers, shape, shared=False):
    """dot_general(qa, qb) accumulated in f32 with `dot`'s precision: the emulated GEMM. `shared`: an operand is a
    quantization other dots read too, which XLA CPU then reads in float32 in all of them (one convert)."""
    acc_type = ir.RankedTensorType.get(shape, f32())
    kwargs = {}
    if "precision_config" in dot.attributes:
      kwargs["precision_config"] = dot.attributes["precision_config"]
    if not self.matrix_gemm or tensor_type(qa).element_type == f32():
      return hlo.DotGeneralOp(acc_type, qa, qb, dimension_numbers, **kwargs).result
    reshape = lambda v, shape: self.reuse.reshaped(v, shape, dot)  # noqa: E731
    matrices = None if shared else dims.as_matrices(qa, qb, dimension_numbers, reshape)
    if matrices is None:
      # Not matrices without moving data (batch dims not leading, K inside or several K dims), or shared: the
      # operands in f32 (exact: q·scale fits), which XLA CPU multiplies in any layout. Transposing them to matrices
      # would merge contracting dims, and a merged K keeps only its outer dim's sharding (a ragged dot's groups under
      # expert parallelism, or d_model under FSDP, whichever is inner, was gathered: 2.3x to 5.5x the dot FLOPs,
      # measured). A shared weight read as bf16 by one dot and in f32 by another was all-gathered twice under FSDP
      # (a dense MoE in bfloat16, measured).
      qa, qb = self.reuse.converted(qa, f32(), dot), self.reuse.converted(qb, f32(), dot)
      return hlo.DotGeneralOp(acc_type, qa, qb, dimension_numbers, **kwargs).result
    qa, qb, dimension_numbers, matrix_shape = matrices
    acc = hlo.DotGeneralOp(ir.RankedTensorType.get(matrix_shape, f32()), qa, qb, dimension_numbers, **kwargs).result
    return hlo.ReshapeOp(acc_type, acc).result  # (batch, lhs free, rhs free): the dot's own output order

  def _native_gemm(self, plan):
    """Packed E2M1 operands, K-major ("TN"), and the FP4 GEMM, which applies alpha = s_dec_a * s_dec_b to its f32
    accumulator and writes the dot's own output type (f32, bf16 or f16), as cuBLASLt's epilogue does."""
    dot, (lc, rc) = plan.record.op, plan.site.gemm.contracting
    out_type = tensor_type(dot.results[0])
    y = self._fp4_gemm(dot.operands[0], dot.operands[1], lc, rc, plan, out_type.element_type)
    return hlo.ReshapeOp(out_type, y).result

  def _fp4_gemm(self, lhs, rhs, lc, rc, plan, element_type):
    """lhs x rhs (contracting lc with rc, no batch dims) as the FP4 GEMM -> (M, N) in `element_type`."""
    reshape = lambda v, shape: self.reuse.reshaped(v, shape, plan.record.op)  # noqa: E731
    operands = [dims.as_read(v, c, reshape) for v, c in ((lhs, lc), (rhs, rc))]  # (M, K) or (K, M); (N, K) or (K, N)
    # The decode scale and key read the operand as the program has it where K is one dim (the same blocks; the digest
    # is order-free): only the quantizer reads a K-major copy where one is made, which XLA then need not hold for
    # them. Measured in float32 (benchmarks/sharding.py's step, stochastic rounding), temporary memory against the
    # unrewritten step: data parallel 1.16x -> 0.87x, FSDP 0.77x -> 0.57x, 2D 1.26x -> 1.21x, tensor parallel 1.06x ->
    # 1.09x. (Ordering the nearest-rounded operand after the gradient, as `_quantize` does, took tensor parallelism to
    # 1.36x.)
    measured = [(v, c[0]) if len(c) == 1 else read for v, c, read in ((lhs, lc, operands[0]), (rhs, rc, operands[1]))]
    (pa, sa, ka), _ = self._packed_tiles(*operands[0], measured[0], plan.operands[0], plan.record.op, False)
    (pb, sb, kb), b_transposed = self._packed_tiles(*operands[1], measured[1], plan.operands[1], plan.record.op, True)
    for i, ((x, axis), s_dec, key, codes) in enumerate(zip(operands, (sa, sb), (ka, kb), (pa[0], pb[0]))):
      self._measure(i, x=x, axis=axis, recipe=plan.operands[i].recipe, salt=self._salt_value(plan.operands[i]),
                    s_dec=s_dec, key=key, row=self._stats.get(codes))
    alpha = hlo.MulOp(sa, sb).result
    operands, attrs = [*pa, *pb, alpha], dict(emulate=self.emulate, b_transposed=b_transposed)
    dtype = _dtype_name(ir.RankedTensorType.get([], element_type))  # the GEMM writes the dot's own output type
    return self.kernels.call(targets.GEMM_PACKED, operands, attrs,
                             result_types=targets.GEMM_PACKED.result_types([v.type for v in operands], attrs, dtype))[0]

  def _packed_tiles(self, x, axis, measured, operand, user, transposable):
    """(`_packed`'s result, whether its codes are Bᵀ): a weight in 16x16 tiles with nearest rounding is packed once
    (reuse.py), and a later GEMM reads that copy, the rhs (`transposable`) also where it contracts the weight's other
    dim (a dgrad, as b_transposed: the same tiles hold the same codes along either axis)."""
    if not _tiles_alike(operand):
      return self._packed(x, axis, measured, operand, user), False
    found = self.reuse.packed_tiles(x, user, None if transposable else axis)
    if found is not None:
      found_axis, packed, s_dec, key = found
      return (packed, s_dec, key), found_axis != axis
    packed, s_dec, key = self._packed(x, axis, measured, operand, user)
    self.reuse.remember_packed_tiles(x, axis, packed, s_dec, key)
    return (packed, s_dec, key), False

  def _native_per_expert(self, plan):
    """An expert GEMM with one group dim per operand (Form.PACKED_GROUPED) as the FP4 GEMM once per expert: each
    expert's slices packed with their own decode scales (the per-expert scaling of numerics/grouped.py) and multiplied
    in f32; the products stacked along the group dim where it is a batch dim, summed in expert order where the program
    contracts it (a ragged dot's CPU expansion), then in the dot's output type."""
    dot, site = plan.record.op, plan.site
    (lc, rc), (gl, gr) = site.gemm.contracting, (site.groups.lhs[0], site.groups.rhs[0])
    out_type = tensor_type(dot.results[0])
    without = lambda dims_, g: [d - (d > g) for d in dims_ if d != g]  # noqa: E731
    products = []
    for e in range(tensor_type(dot.operands[0]).shape[gl]):
      y = self._fp4_gemm(_slice(dot.operands[0], gl, e), _slice(dot.operands[1], gr, e), without(lc, gl),
                         without(rc, gr), plan, f32())
      products.append(y)
    if gl in lc:
      total = products[0]
      for y in products[1:]:
        total = hlo.AddOp(total, y).result
    else:
      shape = tensor_type(products[0]).shape
      total = hlo.ConcatenateOp([hlo.ReshapeOp(ir.RankedTensorType.get([1] + shape, f32()), y).result
                                 for y in products], 0).result
    total = hlo.ReshapeOp(ir.RankedTensorType.get(out_type.shape, f32()), total).result
    return total if out_type.element_type == f32() else hlo.ConvertOp(out_type, total).result

  def _packed(self, x, axis, measured, operand, user):
    """((codes, scales) K-major, s_dec, key) of the matrix x quantized along `axis` (dims.as_read); `measured`: (the
    same values, their K axis), from which the decode scale and the stochastic-rounding key are taken. Where K is x's
    first axis the codes and scales come (K/2, rows), (K/16, rows) and are transposed as bytes: a pair of codes shares
    a byte along K either way, so XLA moves a uint8 tensor an eighth the size of a float32 K-major copy of x."""
    s_dec, key = self._scale_and_key(*measured, operand, user)
    recipe = operand.recipe
    attrs = dict(axis=axis, block_2d=recipe.block_2d, stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=self.seed)
    row = None
    mesh = getattr(self.kernels, "mesh", None)
    if self._step is not None and (mesh is not None or not self.kernels.partitioned):
      # Telemetry: the quantizer also measures what it does to x (each device to its shard), in the same pass.
      types = targets.QUANTIZE_PACKED_STATS.result_types([v.type for v in (x, s_dec, key, self._step)], attrs)
      if mesh is not None:
        types[-1] = device_rows_type(mesh)
      *packed, row = self.kernels.call(targets.QUANTIZE_PACKED_STATS, [x, s_dec, key, self._step], attrs,
                                       result_types=types)
    else:
      packed = self.kernels.call(targets.QUANTIZE_PACKED, [x, s_dec, key], attrs)
    if axis == 0:
      packed = [hlo.TransposeOp(v, ir.DenseI64ArrayAttr.get([1, 0])).result for v in packed]
    if row is not None:
      self._stats[packed[0]] = row
    return tuple(packed), s_dec, key


  # -- expert GEMMs (Form.GROUPED) -------------------------------------------------------------------------------

  def _salt_value(self, operand):
    """The operand's stochastic-rounding salt: the seed folded with its site's salt id."""
    return formats.fold_in_int(self.seed, operand.salt_id)

  def _salt(self, operand):
    return const(self._salt_value(operand), u32())

  def _slices(self, plan, select):
    """A dot_general with group dims (Grouping.SLICES): every slice quantized with its own scale (slice_qdq); a ragged
    dot's CPU expansion then runs its GEMM as the program does, over the groups, and takes alpha per row
    (masked_output); other grouped dots run theirs with the group dims as batch dims and take alpha per group
    (scaled_output, which sums over group dims the program contracted). A group dim free in one operand (Groups.free:
    a dense MoE's up projection and its wgrad) stays free, its scales along the accumulator's dim. Only 16x16-tiled
    slices (expert weights) are shared between dots; each dot quantizes its other operands."""
    dot, site = plan.record.op, plan.site
    groups = site.groups
    (lc, rc), (lb, rb) = site.gemm.contracting, site.gemm.batch
    contracted = [i for i, d in enumerate(lc) if d in groups.lhs]
    batch = (list(lb) + [lc[i] for i in contracted], list(rb) + [rc[i] for i in contracted])
    contracting = ([d for i, d in enumerate(lc) if i not in contracted],
                   [d for i, d in enumerate(rc) if i not in contracted])
    lhs_groups = [d for d in batch[0] if d in groups.lhs]
    free = [[d for side, d in groups.free if side == i] for i in (0, 1)]  # expert dims free in one operand
    group_dims = (lhs_groups + free[0], [batch[1][batch[0].index(d)] for d in lhs_groups] + free[1])
    quantized, shared = [None, None], False
    for i in plan.order:
      x, recipe, operand = dot.operands[i], plan.operands[i].recipe, plan.operands[i]
      shape = tensor_type(x).shape
      scale_type = ir.RankedTensorType.get([shape[d] for d in group_dims[i]], f32())
      # A 16x16-tiled matrix per slice quantizes alike along either of its dims: a dgrad reuses its fprop's expert
      # weights (a second quantization was a second all-gather of the weights under FSDP: a dense MoE moved 1.38x
      # the bytes, measured).
      tiled = _tiles_alike(operand) and len(shape) - len(group_dims[i]) == 2
      blocks = ("slices", tuple(shape), tuple(group_dims[i])) if tiled else None
      shared = shared or tiled
      found = self.reuse.quantized(x, blocks, select, dot) if tiled else None
      if found is not None:
        q, s_dec = found
      else:
        q, s_dec = self.twins.call(grouped.slice_qdq, [x, self._salt(operand)], [x.type, scale_type],
                                   groups=tuple(group_dims[i]), block_2d=recipe.block_2d,
                                   axis=contracting[i][0] if len(contracting[i]) == 1 else tuple(contracting[i]),
                                   stochastic=recipe.stochastic, rht=recipe.rht, rht_seed=self.seed,
                                   **_peers(operand))
        if tiled:
          self.reuse.remember(x, blocks, select, q, s_dec)
      self._measure(i, x=x, axis=contracting[i][0] if len(contracting[i]) == 1 else tuple(contracting[i]),
                    recipe=recipe, salt=None, q=q, s_dec=s_dec, groups=tuple(group_dims[i]))
      if select is not None:
        q = hlo.SelectOp(select, x, q).result
        s_dec = hlo.SelectOp(select, broadcast(const(1.0, f32()), scale_type), s_dec).result
      quantized[i] = (q, s_dec)
    (qa, sa), (qb, sb) = quantized
    out_type = tensor_type(dot.results[0])
    masks = [(i, ragged.group_mask(dot.operands[i])) for i in (0, 1)]
    masked = [(i, m) for i, m in masks if m is not None and tensor_type(m).shape == tensor_type(dot.operands[i]).shape]
    if contracted and masked and not lb:
      # A ragged dot's CPU expansion: one GEMM over the groups as the program has it, alpha per row (masked_output)
      i, mask = masked[0]
      acc = self._f32_dot(dot, qa, qb, dot.attributes["dot_dimension_numbers"], out_type.shape)
      return self.twins.call(grouped.masked_output, [acc, mask, sa, sb], [out_type],
                             group_dim=group_dims[i][0], contracted=tuple(contracting[i]), rows_first=i == 0,
                             dtype=_dtype_name(out_type))[0]
    numbers = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=batch[0], rhs_batching_dimensions=batch[1],
        lhs_contracting_dimensions=contracting[0], rhs_contracting_dimensions=contracting[1])
    # The accumulator's dims: the batch dims, then each operand's free dims (dot_general's order).
    acc_dims = [(0, d) for d in batch[0]] + [
        (i, d) for i, v in ((0, qa), (1, qb)) for d in range(len(tensor_type(v).shape))
        if d not in batch[i] and d not in contracting[i]]
    acc_shape = [tensor_type((qa, qb)[i]).shape[d] for i, d in acc_dims]
    acc = self._f32_dot(dot, qa, qb, numbers, acc_shape, shared=shared)
    # Where each operand's scales go: paired group dims are batch dims (the lhs's), free ones the operand's own.
    def position(i, d):
      return acc_dims.index((0, batch[0][batch[1].index(d)]) if i == 1 and d in batch[1] else (i, d))
    return self.twins.call(grouped.scaled_output, [acc, sa, sb], [out_type],
                           lhs_groups=tuple(position(0, d) for d in group_dims[0]),
                           rhs_groups=tuple(position(1, d) for d in group_dims[1]),
                           summed=tuple(len(lb) + j for j in range(len(contracted))),
                           dtype=_dtype_name(out_type))[0]

  def _ragged(self, plan):
    """A chlo.ragged_dot in the grouped recipe: one twin that quantizes per group and runs one ragged GEMM."""
    rows, operands, params = self._ragged_operands(plan)
    fn = grouped.ragged_rows if rows else grouped.ragged_contracting
    return self.twins.call(fn, operands, [tensor_type(plan.record.op.results[0])], **params)[0]

  def _native_ragged(self, plan):
    """A chlo.ragged_dot under the native backend: the twin that packs its operands as `_ragged`'s quantizes them
    (numerics/grouped.py ragged_rows_packed, ragged_contracting_packed), then the grouped FP4 GEMM, which takes the
    group sizes at run time (xla_fp4_ragged_gemm_packed; the wgrad's groups split its K, in a layout of whole blocks
    per group)."""
    rows, operands, params = self._ragged_operands(plan)
    del params["dtype"]
    if rows:
      a, a_scales, b, b_scales, alpha = self.twins.call(grouped.ragged_rows_packed, operands, **params)
      sizes = operands[2]
    else:
      a, a_scales, b, b_scales, sizes, alpha = self.twins.call(grouped.ragged_contracting_packed, operands, **params)
    return self.kernels.call(targets.RAGGED_GEMM_PACKED, [a, a_scales, b, b_scales, sizes, alpha],
                             dict(ragged_k=not rows), result_types=[tensor_type(plan.record.op.results[0])])[0]

  def _ragged_operands(self, plan):
    """(whether the groups are the lhs's rows (forward, dgrad) rather than the contraction's (wgrad), the twin's
    operands: lhs, rhs, group sizes and the two salts, its parameters); telemetry measures them as the twin quantizes
    them (probes.py, in recorded steps)."""
    op, site = plan.record.op, plan.site
    lhs, rhs, sizes = op.operands
    recipes = {name: (o.recipe.block_2d, o.recipe.stochastic, o.recipe.rht)
               for name, o in zip(("lhs_recipe", "rhs_recipe"), plan.operands)}
    operands = [lhs, rhs, sizes] + [self._salt(o) for o in plan.operands]
    params = dict(rht_seed=self.seed, dtype=_dtype_name(tensor_type(op.results[0])), **recipes,
                  **_peers(plan.operands[0]))
    rows = site.groups.kind is Grouping.RAGGED_ROWS
    stats_fn = telemetry.ragged_contracting_stats
    if rows:
      ((lc, rc), _), rhs_groups, _ = ragged_dot_dims(op)
      params.update(lhs_contracting=lc[0], rhs_contracting=rc[0], rhs_group=rhs_groups[0])
      stats_fn = telemetry.ragged_rows_stats
    self._measure(0, x=lhs, axis=None, recipe=plan.operands[0].recipe, salt=None, s_dec=None,
                  ragged=(stats_fn, operands, dict(params)))
    return rows, operands, params


def _peers(operand):
  """The twins' `peers` parameter of an operand in a shard_map body (OperandPlan.peers); none elsewhere, so that the
  twins outside bodies are the same functions as before bodies had peers."""
  return dict(peers=operand.peers) if operand.peers else {}


def _slice(x, dim, index):
  """x[..., index, ...] along `dim`, without that dim (a static slice)."""
  shape = list(tensor_type(x).shape)
  start, limit = [0] * len(shape), list(shape)
  start[dim], limit[dim] = index, index + 1
  piece = hlo.SliceOp(x, ir.DenseI64ArrayAttr.get(start), ir.DenseI64ArrayAttr.get(limit),
                      ir.DenseI64ArrayAttr.get([1] * len(shape))).result
  return hlo.ReshapeOp(ir.RankedTensorType.get(shape[:dim] + shape[dim + 1:], tensor_type(x).element_type),
                       piece).result


def _tiles_alike(operand):
  """Whether the operand's quantization reads alike along either of its matrix dims, so that one copy serves a GEMM
  that contracts the other: 16x16 tiles with nearest rounding and no RHT, in a value that may be reused (not
  `fresh`)."""
  recipe = operand.recipe
  return recipe.block_2d and not recipe.rht and not recipe.stochastic and not operand.fresh


def _dtype_name(tensor_type_):
  """The numpy name of an MLIR tensor type's element type (a twin's `dtype` parameter)."""
  return targets.shape_dtype(tensor_type_).dtype.name


def _kept(block, keep_blocks):
  """Whether `block` is one of `keep_blocks` (high precision): an i1 scalar."""
  etype = tensor_type(block).element_type
  kept = None
  for b in keep_blocks:
    c = hlo.CompareOp(block, const(b, etype), hlo.ComparisonDirectionAttr.get("EQ")).result
    kept = c if kept is None else hlo.OrOp(kept, c).result
  return kept
