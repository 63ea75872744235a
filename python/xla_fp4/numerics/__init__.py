"""Pure-JAX reference of the NVFP4 recipe: the test oracle, the portable fallback and a research API.

    from xla_fp4 import numerics as nv
    t = nv.quantize(w, axis=0, block_2d=True)       # NVFP4Tensor(values, scales, global_scale)
    w_hat = nv.dequantize(t, jnp.bfloat16)
    y = nv.dot_general(x, w, (((1,), (0,)), ((), ())), b_recipe=nv.OperandRecipe(block_2d=True))
"""

from xla_fp4.numerics.formats import (BLOCK, E2M1_MAX, E2M1_VALUES, E4M3_MAX, GLOBAL_SCALE_DIVISOR, fold_in, mix32,
                                      random_bits, round_e2m1_nearest, round_e2m1_stochastic, round_e4m3,
                                      uniform_from_bits)
from xla_fp4.numerics.gemm import OperandRecipe, dot_general
from xla_fp4.numerics.grouped import ragged_contracting_dot, ragged_dot
from xla_fp4.numerics.packing import (PackedNVFP4, pack, pack_mx, padded_scale_shape, swizzle_scales, unpack, unpack_mx,
                                     unswizzle_scales)
from xla_fp4.numerics.nvfp4 import (NVFP4Tensor, Rounding, amax, block_amax, block_digest, dequantize,
                                     global_decode_scale, qdq, quantize, tensor_digest)
from xla_fp4.numerics.rht import hadamard_matrix, random_hadamard_transform, rht_signs
