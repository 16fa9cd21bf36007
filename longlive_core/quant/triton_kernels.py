"""Triton kernels for NVFP4 quantization: the default on CUDA, bit-identical to the torch path.

Three kernels quantize a 2-D view (any strides, so a transposed view is quantized along its
other axis without a copy); ``pick_kernel`` chooses. They write the packed codes and E4M3 scales
(``quantize``) and/or the "partial" dequantization q * S_dec in bfloat16, which is exact and is
what the emulated NVFP4 GEMM multiplies (``quantize_partial``):
- rows: tiles of BM rows x BK columns; every option (16x16 tiles, Four-Over-Six, SR, partial).
- slices: 1x16 blocks of strided views as 16 elementwise slices (the wgrad operands, RHT and SR).
- blocks: codes and scales of contiguous rows, round to nearest (1x16 or 16x16 tiles): each thread
  holds whole blocks, so the RHT, block amax and nibble packing stay in registers; also the
  one-pass amaxes.
The global amax comes from one reduction pass (with the RHT applied in registers when asked), so
x is read twice unless the caller passes the amax.

Bit-exactness with ``nvfp4.quantize_torch`` rests on doing the same float32 operations in the
same order: IEEE division (``div_rn``), no contracted multiply-adds (``enable_fp_fusion=False``;
the explicit ``tl.fma`` calls stand where the product is exact or one rounding is meant), the RHT
butterfly and the Four-Over-Six error sums in the same pairwise order, and hardware
round-to-nearest-even casts to E4M3 and bfloat16. Stochastic rounding uses Philox (``tl.rand``)
from a seed, so its draws differ from the torch path's; both are unbiased. A NaN anywhere makes
the global amax and the decode scale NaN on both paths, so every dequantized value and GEMM output
is NaN; the codes and scale bytes of such a tensor differ (the kernels' minimum returns the number
where torch's propagates the NaN) and are not compared.
"""
from __future__ import annotations

import functools
import os

import torch

from longlive_core.devices import made_current
from longlive_core.quant.constants import device_constant
from longlive_core.quant.hadamard import SIGNS
from longlive_core.quant.nvfp4 import (
    BLOCK,
    E4M3_MAX,
    FLT_MAX,
    FOUR_OVER_SIX_E4M3_MAX,
    NVFP4Tensor,
    check_input,
    float32_scalar,
    global_encode_scale,
)
from longlive_core.quant.triton_launch import CachedLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None


@functools.cache
def available() -> bool:
    """Triton and a GPU that runs these kernels: compute capability 8.9+ (Triton converts to FP8
    E4M3 there only); older GPUs take the torch path."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


FOS_CODES = {None: 0, "mse": 1, "mae": 2}
# TRITON_INTERPRET=1 runs the kernels on the CPU (numpy): slow, but lets the tests check them here.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    _FLT_MAX = tl.constexpr(FLT_MAX)
    _HW_ROUND = tl.constexpr(not INTERPRETING)
    # S_enc from which no block's x * enc can underflow to zero: enc >= S_enc / 448 (slightly less
    # after its two roundings), so 2^-6 keeps bfloat16 products (|x| >= 2^-133) at 2^-147.8 or more,
    # 2^9 float32 ones (|x| >= 2^-149) at 2^-148.8 or more; both above 2^-149, the least nonzero float
    _NO_UNDERFLOW_BF16 = tl.constexpr(2.0 ** -6)
    _NO_UNDERFLOW_F32 = tl.constexpr(2.0 ** 9)

    def _sign_asm(plus_zero: bool) -> str:
        """_sign_bits' PTX: operands $1..$8 are y0..y7, y7's top bits shifted in first."""
        take = "add.f32 t, ${}, 0f00000000;" if plus_zero else "mov.b32 t, ${};"
        steps = [take.format(8) + " shr.b32 $0, t, 28;"]
        steps += [take.format(i) + " shf.l.wrap.b32 $0, t, $0, 4;" for i in range(7, 0, -1)]
        return "{ .reg .b32 t; " + " ".join(steps) + " }"

    _SIGN_ASM = tl.constexpr(_sign_asm(False))
    _SIGN_ASM_PLUS_ZERO = tl.constexpr(_sign_asm(True))

    @triton.jit
    def _round_e4m3(v):
        """float32 in [0, 448] -> the nearest E4M3 value (ties to even), still float32: the GPU's
        rounding convert there and back, or integer arithmetic under the CPU interpreter (whose
        casts truncate)."""
        if _HW_ROUND:
            return v.to(tl.float8e4nv).to(tl.float32)
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # below 2^-6 E4M3 is subnormal, steps of 2^-9: adding 2^23 rounds v * 2^9 to an integer, ties to even
        sub = ((v * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        return tl.where(v < 0.015625, sub, normal)

    @triton.jit
    def _f32(v):
        """A loaded tile as float32. The CPU interpreter's bfloat16 cast misreads subnormals (it gives
        4.4e-39 for 1.0e-39), so there the bits are widened by hand, as the GPU's convert does."""
        if not _HW_ROUND and v.dtype == tl.bfloat16:
            return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return v.to(tl.float32)

    @triton.jit
    def _f32_pairs(v, m65536):
        """_f32 of a tile whose last axis holds consecutive elements in one thread (the block
        kernel's loads): on the GPU each 32-bit word of two bfloat16 widens with one instruction per
        element (a multiply by m65536 for the low half, a mask for the high one), where the convert
        Triton emits first moves the high half down (two for it). m65536 is 65536 as a value the
        compiler cannot see (_opaque), so the multiply stays an IMAD on the FMA pipe instead of
        becoming a shift on the integer one, which the RHT codes kernel keeps the busier
        (bench/RESULTS.md, iteration 10)."""
        if _HW_ROUND and v.dtype == tl.bfloat16:
            # pack=2: two bfloat16 in $2, and m65536 twice ($3, $4)
            w = tl.inline_asm_elementwise("{ mul.lo.u32 $0, $2, $3; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r,r,r",
                                          [v, m65536], dtype=tl.int32, is_pure=True, pack=2)
            return w.to(tl.float32, bitcast=True)
        return _f32(v)

    @triton.jit
    def _opaque(K, value: tl.constexpr):
        """value, computed from the kernel argument K >= 0 (K >> 31 is 0): a multiplier the compiler
        cannot turn into a shift (see _f32_pairs, _word)."""
        return (K >> 31) + value

    @triton.jit
    def _round_bf16(v):
        """float32 -> the nearest bfloat16 value (ties to even), still float32: the GPU's rounding
        convert, or integer arithmetic under the CPU interpreter (whose casts truncate)."""
        if _HW_ROUND:
            return v.to(tl.bfloat16).to(tl.float32)
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _pairsum16(e, A: tl.constexpr, B: tl.constexpr):
        """Sums the last axis (16) of an (A, B, 16) tensor by adjacent pairs (the torch order)."""
        e = tl.reshape(e, (A, B, 8, 2))
        a, b = tl.split(e)
        e = tl.reshape(a + b, (A, B, 4, 2))
        a, b = tl.split(e)
        e = tl.reshape(a + b, (A, B, 2, 2))
        a, b = tl.split(e)
        e = a + b
        a, b = tl.split(e)
        return a + b

    @triton.jit
    def _butterfly_stage(x, BM: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
        v = tl.reshape(x, (BM, G, 16 // (2 * H), 2, H))
        v = tl.permute(v, (0, 1, 2, 4, 3))
        a, b = tl.split(v)
        v = tl.join(a + b, a - b)
        v = tl.permute(v, (0, 1, 2, 4, 3))
        return tl.reshape(v, (BM, G, 16))

    @triton.jit
    def _rht(x, signs_ptr, BM: tl.constexpr, G: tl.constexpr, IS_BF16: tl.constexpr):
        """x (BM, G*16) float32 -> the RHT of each 16-block (signs and 1/4 first, as
        hadamard.rht), rounded through the input dtype."""
        s = tl.load(signs_ptr + tl.arange(0, 16)) * 0.25
        v = tl.reshape(x, (BM, G, 16)) * s[None, None, :]
        v = _butterfly_stage(v, BM, G, 1)
        v = _butterfly_stage(v, BM, G, 2)
        v = _butterfly_stage(v, BM, G, 4)
        v = _butterfly_stage(v, BM, G, 8)
        v = tl.reshape(v, (BM, G * 16))
        if IS_BF16:
            v = _round_bf16(v)
        return v

    @triton.jit
    def _load_tile(x_ptr, sxm, sxk, M, K, signs_ptr, BM: tl.constexpr, BK: tl.constexpr,
                   RHT: tl.constexpr, IS_BF16: tl.constexpr):
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rk = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = _f32(tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0))
        if RHT:
            x = _rht(x, signs_ptr, BM, BK // 16, IS_BF16)
        return x, rm, rk, mask

    @triton.jit
    def _e2m1(a, u, SR: tl.constexpr):
        """|v| <= 6 -> (E2M1 magnitude, its code 0..7): nearest, ties to even, or (SR) the upper
        neighbour with probability equal to the fractional distance (u uniform in [0, 1)).
        Round to nearest adds c = 2^22, 2^23 or 2^24 (2^(22 + max(exponent of a, 0)), built from a's
        exponent bits), whose float32 spacing (0.5, 1, 2) is E2M1's step in that range; the code is
        then the number of steps above c plus 0, 2 or 4."""
        if SR:
            inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
            r = tl.minimum(tl.floor(a * inv_step + u) / inv_step, 6.0)
            code = tl.where(r <= 2.0, r * 2.0, tl.where(r <= 4.0, r + 2.0, 7.0)).to(tl.int32)
        else:
            cb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + 0x0B000000
            c = cb.to(tl.float32, bitcast=True)
            t = a + c
            code = (t.to(tl.int32, bitcast=True) - cb) + ((cb - 0x4A800000) >> 22)
            r = t - c
        return r, code

    @triton.jit
    def _quant_elem(x, enc, u, SR: tl.constexpr):
        """(signed E2M1 value, 4-bit code) of x * enc, clamped to +-6."""
        y = x * enc
        r, code = _e2m1(tl.minimum(tl.abs(y), 6.0), u, SR)
        neg = y < 0
        return tl.where(neg, -r, r), code + neg.to(tl.int32) * 8

    @triton.jit
    def _rcp_rn(v):
        """1 / v, correctly rounded (as div_rn(1.0, v), which IEEE 754 makes the same number): on the
        GPU PTX's rcp.rn, a few instructions fewer than the division's sequence."""
        if _HW_ROUND:
            return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True,
                                             pack=1)
        return tl.math.div_rn(1.0, v)

    @triton.jit
    def _block_scales(bamax, s_enc):
        """(S_dec as float32, the encode multiplier) for blocks with amax bamax."""
        s_dec = _round_e4m3(tl.minimum(bamax * (s_enc * (1.0 / 6.0)), 448.0))
        return s_dec, tl.minimum(_rcp_rn(s_dec * _rcp_rn(s_enc)), _FLT_MAX)

    @triton.jit
    def _encode_scale(amax_ptr, SCALE6: tl.constexpr):
        """S_enc from the global amax, as global_encode_scale computes it."""
        amax = tl.load(amax_ptr).to(tl.float32)
        s = tl.math.div_rn(SCALE6, amax)
        s = tl.where((amax == 0) | (s == 0), 1.0, s)
        return tl.minimum(s, _FLT_MAX, propagate_nan=tl.PropagateNan.ALL)  # a NaN amax makes NaN scales

    @triton.jit
    def _uniform16(seed, offs):
        """Uniform [0, 1) numbers for a (BM, G, 16) tile from a quarter as many Philox calls: offs
        (BM, G, 4) block-quarter counters, each call giving four numbers."""
        a, b, c, d = tl.randint4x(seed, offs)
        u = tl.join(tl.join(a, b), tl.join(c, d))  # (BM, G, 4, 2, 2)
        return tl.random.uint_to_uniform_float(tl.reshape(u, (offs.shape[0], offs.shape[1], 16)))

    @triton.jit
    def _candidate(xb, bamax, s_enc, seed, offs, mult, SR: tl.constexpr, FOS: tl.constexpr):
        """One choice of block scales: (E4M3 scales as float32, signed E2M1 values, codes)."""
        if FOS == 0:
            s_dec, enc = _block_scales(bamax, s_enc)
        else:
            s_dec = _round_e4m3(tl.minimum(tl.math.div_rn(bamax, 6.0) * s_enc * mult, 448.0))
            enc = tl.minimum(_rcp_rn(s_dec * _rcp_rn(s_enc)), _FLT_MAX)
        if SR:
            u = _uniform16(seed, offs)
        else:
            u = 0.0
        val, code = _quant_elem(xb, enc[:, :, None], u, SR)
        return s_dec, val, code

    @triton.jit
    def _block_err(val, s_dec, s_enc, xb, BM: tl.constexpr, G: tl.constexpr, FOS: tl.constexpr):
        d = tl.math.div_rn(val * s_dec[:, :, None], s_enc) - xb
        e = d * d if FOS == 1 else tl.abs(d)
        return _pairsum16(e, BM, G)

    @triton.jit
    def _tile_reduce(e, BM: tl.constexpr, G: tl.constexpr):
        """(BM, G) row errors -> (BM, G) with each 16-row tile's pairwise sum on all its rows."""
        t = tl.permute(tl.reshape(e, (BM // 16, 16, G)), (0, 2, 1))
        t = _pairsum16(t, BM // 16, G)
        return tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, G)), (BM, G))

    @triton.jit
    def _rows16_max(v, BM: tl.constexpr, G: tl.constexpr):
        """(BM, G) block amaxes -> (BM, G) with each 16-row tile's max (NaN if any is) on all its rows."""
        m = tl.reduce(tl.reshape(v, (BM // 16, 16, G)), 1, _nanmax)
        return tl.reshape(tl.broadcast_to(m[:, None, :], (BM // 16, 16, G)), (BM, G))

    @triton.jit
    def _store_decode(dec_ptr, times_ptr, s_enc, TIMES: tl.constexpr):
        """1 / S_enc into dec_ptr from program (0, 0); with TIMES, times the float32 at times_ptr
        (another operand's decode scale: the product is a GEMM's alpha, and the host is spared a
        torch multiply per GEMM). One rounding each, as the torch path's division and product."""
        d = tl.math.div_rn(1.0, s_enc)
        if TIMES:
            d = d * tl.load(times_ptr)
        tl.store(dec_ptr, d, mask=(tl.program_id(0) == 0) & (tl.program_id(1) == 0))

    @triton.jit
    def _quant_kernel(x_ptr, sxm, sxk, M, K, signs_ptr, amax_ptr, codes_ptr, scales_ptr, part_ptr, spm, spk,
                      dec_ptr, times_ptr, seed_ptr, SCALE6: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                      TILE2D: tl.constexpr, RHT: tl.constexpr,
                      IS_BF16: tl.constexpr, SR: tl.constexpr, FOS: tl.constexpr,
                      WRITE_CODES: tl.constexpr, WRITE_PARTIAL: tl.constexpr, WRITE_DEC: tl.constexpr,
                      TIMES: tl.constexpr):
        """Row tiles: a thread holds whole 16-element blocks; every option (16x16 tiles, 4/6)."""
        G: tl.constexpr = BK // 16
        x, rm, rk, mask = _load_tile(x_ptr, sxm, sxk, M, K, signs_ptr, BM, BK, RHT, IS_BF16)
        xb = tl.reshape(x, (BM, G, 16))
        bamax = tl.max(tl.abs(xb), axis=2)
        if TILE2D:
            bamax = _rows16_max(bamax, BM, G)
        s_enc = _encode_scale(amax_ptr, SCALE6)
        if WRITE_DEC:
            _store_decode(dec_ptr, times_ptr, s_enc, TIMES)
        rq = tl.program_id(1).to(tl.int64) * (BK // 4) + tl.arange(0, BK // 4)
        offs = tl.reshape((rm[:, None] * (K // 4) + rq[None, :]).to(tl.int32), (BM, G, 4))
        seed = tl.load(seed_ptr) if SR else 0
        if FOS == 0:
            s_dec, val, code = _candidate(xb, bamax, s_enc, seed, offs, 1.0, SR, FOS)
        else:
            s6, val6, code6 = _candidate(xb, bamax, s_enc, seed, offs, 1.0, SR, FOS)
            e6 = _block_err(val6, s6, s_enc, xb, BM, G, FOS)
            s4, val4, code4 = _candidate(xb, bamax, s_enc, seed + 1, offs, 1.5, SR, FOS)
            e4 = _block_err(val4, s4, s_enc, xb, BM, G, FOS)
            if TILE2D:
                e6 = _tile_reduce(e6, BM, G)
                e4 = _tile_reduce(e4, BM, G)
            pick4 = e4 < e6
            s_dec = tl.where(pick4, s4, s6)
            # round to nearest encodes the picked candidate again rather than holding both candidates' values
            # and codes (96 registers a thread at 32x128x4 against 208); stochastic rounding keeps both draws
            if SR:
                val = tl.where(pick4[:, :, None], val4, val6)
                code = tl.where(pick4[:, :, None], code4, code6)
            else:
                enc = tl.minimum(_rcp_rn(s_dec * _rcp_rn(s_enc)), _FLT_MAX)
                val, code = _quant_elem(xb, enc[:, :, None], 0.0, SR)
        if WRITE_CODES:
            c = tl.reshape(code.to(tl.uint8), (BM, BK // 2, 2))
            lo, hi = tl.split(c)
            rc = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
            cmask = (rm[:, None] < M) & (rc[None, :] < K // 2)
            tl.store(codes_ptr + rm[:, None] * (K // 2) + rc[None, :], lo | (hi << 4), mask=cmask)
            rs = tl.program_id(1) * G + tl.arange(0, G)
            smask = (rm[:, None] < M) & (rs[None, :] < K // 16)
            sbits = s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(scales_ptr + rm[:, None] * (K // 16) + rs[None, :], sbits, mask=smask)
        if WRITE_PARTIAL:
            p = tl.reshape(val * s_dec[:, :, None], (BM, BK)).to(tl.bfloat16)
            tl.store(part_ptr + rm[:, None] * spm + rk[None, :] * spk, p, mask=mask)


    @triton.jit
    def _bf(a, b):
        return a + b, a - b

    @triton.jit
    def _bf_scaled(a, b, sa: tl.constexpr, sb: tl.constexpr, IS_BF16: tl.constexpr):
        """The first butterfly stage on a * sa and b * sb (sa, sb = +-1/4). For bfloat16 inputs
        those products are exact, so a fused multiply-add gives the same sums with one instruction
        fewer per pair; float32 inputs can lose subnormal bits there and take separate roundings."""
        t = b * sb
        if IS_BF16:
            return tl.fma(a, sa, t), tl.fma(a, sa, -t)
        u = a * sa
        return u + t, u - t

    @triton.jit
    def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, IS_BF16: tl.constexpr,
               ROUND: tl.constexpr):
        """The RHT of one block held as 16 separate slices: each element times its +-1/4, then the
        butterfly at strides 1, 2, 4, 8 (the order of hadamard._butterfly), then (ROUND) rounded
        through the input dtype. Without ROUND the caller rounds itself, e.g. once to a maximum:
        rounding is odd and monotonic, so the largest rounded |v| is the rounded largest |v|."""
        x0, x1 = _bf_scaled(x0, x1, 0.25, 0.25, IS_BF16)
        x2, x3 = _bf_scaled(x2, x3, 0.25, -0.25, IS_BF16)
        x4, x5 = _bf_scaled(x4, x5, 0.25, -0.25, IS_BF16)
        x6, x7 = _bf_scaled(x6, x7, -0.25, -0.25, IS_BF16)
        x8, x9 = _bf_scaled(x8, x9, -0.25, -0.25, IS_BF16)
        x10, x11 = _bf_scaled(x10, x11, -0.25, 0.25, IS_BF16)
        x12, x13 = _bf_scaled(x12, x13, -0.25, 0.25, IS_BF16)
        x14, x15 = _bf_scaled(x14, x15, -0.25, -0.25, IS_BF16)
        x0, x2 = _bf(x0, x2)
        x1, x3 = _bf(x1, x3)
        x4, x6 = _bf(x4, x6)
        x5, x7 = _bf(x5, x7)
        x8, x10 = _bf(x8, x10)
        x9, x11 = _bf(x9, x11)
        x12, x14 = _bf(x12, x14)
        x13, x15 = _bf(x13, x15)
        x0, x4 = _bf(x0, x4)
        x1, x5 = _bf(x1, x5)
        x2, x6 = _bf(x2, x6)
        x3, x7 = _bf(x3, x7)
        x8, x12 = _bf(x8, x12)
        x9, x13 = _bf(x9, x13)
        x10, x14 = _bf(x10, x14)
        x11, x15 = _bf(x11, x15)
        x0, x8 = _bf(x0, x8)
        x1, x9 = _bf(x1, x9)
        x2, x10 = _bf(x2, x10)
        x3, x11 = _bf(x3, x11)
        x4, x12 = _bf(x4, x12)
        x5, x13 = _bf(x5, x13)
        x6, x14 = _bf(x6, x14)
        x7, x15 = _bf(x7, x15)
        if not ROUND:
            return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15
        return (_round_one(x0, IS_BF16), _round_one(x1, IS_BF16), _round_one(x2, IS_BF16), _round_one(x3, IS_BF16),
                _round_one(x4, IS_BF16), _round_one(x5, IS_BF16), _round_one(x6, IS_BF16), _round_one(x7, IS_BF16),
                _round_one(x8, IS_BF16), _round_one(x9, IS_BF16), _round_one(x10, IS_BF16),
                _round_one(x11, IS_BF16), _round_one(x12, IS_BF16), _round_one(x13, IS_BF16),
                _round_one(x14, IS_BF16), _round_one(x15, IS_BF16))

    @triton.jit
    def _round_input(v, IS_BF16: tl.constexpr):
        """v rounded through the input dtype (bfloat16) or left as it is (float32)."""
        if IS_BF16:
            v = _round_bf16(v)
        return v

    @triton.jit
    def _bf16x2(a, b):
        """a and b rounded to bfloat16 by one convert (GPU only), a in the high half of the word."""
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _unpack_bf16x2(w):
        """The two values of a _bf16x2 word as float32: (high half, low half)."""
        return (w & -65536).to(tl.float32, bitcast=True), (w << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _abs_max_bf16x2(v, w):
        """Halfwise max |.| of two bfloat16x2 words, NaN where either half is (GPU only). The sign
        bits of the result are those of the inputs xor'ed (PTX max.xorsign.abs): callers take |.|."""
        return tl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [v, w],
                                         dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _round_one(v, IS_BF16: tl.constexpr):
        """_round_input; on the GPU for bfloat16 one convert with a zero partner, whose word is then
        the rounded value as float32 (bfloat16 bits above sixteen zeros): one instruction per value,
        where converting pairs and unpacking them took 1.5 (bench/RESULTS.md, iteration 9). The asm
        hands back a float register: from an int32 bitcast, LLVM turned some later |v| into integer
        masks (a LOP3 each) instead of modifiers on the instructions that use them (iteration 10)."""
        if IS_BF16 and _HW_ROUND:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 z, w; mov.b32 z, 0; cvt.rn.bf16x2.f32 w, $1, z; mov.b32 $0, w; }", "=f,f", [v],
                dtype=tl.float32, is_pure=True, pack=1)
        return _round_input(v, IS_BF16)

    @triton.jit
    def _ld(ptr, p, sxk, mask):
        return _f32(tl.load(ptr + p * sxk, mask=mask, other=0.0))

    @triton.jit
    def _nanmax(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
        """Block max |x|, NaN if any element is (as torch's amax)."""
        a = _nanmax(_nanmax(tl.abs(x0), tl.abs(x1)), _nanmax(tl.abs(x2), tl.abs(x3)))
        b = _nanmax(_nanmax(tl.abs(x4), tl.abs(x5)), _nanmax(tl.abs(x6), tl.abs(x7)))
        c = _nanmax(_nanmax(tl.abs(x8), tl.abs(x9)), _nanmax(tl.abs(x10), tl.abs(x11)))
        d = _nanmax(_nanmax(tl.abs(x12), tl.abs(x13)), _nanmax(tl.abs(x14), tl.abs(x15)))
        return _nanmax(_nanmax(a, b), _nanmax(c, d))

    @triton.jit
    def _tile_max(v):
        """max of a tile, NaN if any element is (tl.max would skip NaN)."""
        return tl.reduce(v, None, _nanmax)

    @triton.jit
    def _atomic_amax(word_ptr, amax):
        """max into one int32 word (zeroed by the caller) of amax's float32 bits: for non-negative
        floats the integer order is the float order, and a NaN (sign cleared by abs) is above +inf,
        so the word ends as the float max of all programs' maxima, NaN if any is: no partials for
        a torch reduction to gather, which costs the host a dispatch per amax pass. A program whose
        max is not above the word's value as it reads it (from L2) skips its atomic: the word only
        grows, so the skip is exact, and it spares most programs the same-address atomics, which
        serialize."""
        bits = amax.to(tl.int32, bitcast=True)
        seen = tl.load(word_ptr, cache_modifier=".cg")
        tl.atomic_max(word_ptr, bits, mask=bits > seen, sem="relaxed")

    @triton.jit
    def _transform_and_amax(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, max_ptr,
                            plain_max_ptr, RHT: tl.constexpr, IS_BF16: tl.constexpr, AMAX_ONLY: tl.constexpr,
                            PACKED_AMAX: tl.constexpr):
        """The 16 slices after the RHT (when asked) and their block amax. AMAX_ONLY: folds this
        tile's plain and transformed maxima (the transformed one rounded once, see _rht16) into the
        int32 words at plain_max_ptr and max_ptr instead (_atomic_amax). PACKED_AMAX: the RHT'd
        bfloat16 block amax by paired maxima (on the H200 the slice kernel gains ~1 us from it at
        8192^2 and the block kernel loses 1-2 us: bench/RESULTS.md, iteration 8)."""
        if AMAX_ONLY:  # the plain amax too, from the same read (both operands of one tensor)
            plain = _amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
            _atomic_amax(plain_max_ptr, _tile_max(plain))
        if RHT and PACKED_AMAX and IS_BF16 and _HW_ROUND and not AMAX_ONLY:
            # the block amax from the rounded values while they are packed two to a word: half the maxima
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, IS_BF16, False)
            w0, w1, w2, w3 = _bf16x2(x0, x1), _bf16x2(x2, x3), _bf16x2(x4, x5), _bf16x2(x6, x7)
            w4, w5, w6, w7 = _bf16x2(x8, x9), _bf16x2(x10, x11), _bf16x2(x12, x13), _bf16x2(x14, x15)
            m = _abs_max_bf16x2(_abs_max_bf16x2(_abs_max_bf16x2(w0, w1), _abs_max_bf16x2(w2, w3)),
                                _abs_max_bf16x2(_abs_max_bf16x2(w4, w5), _abs_max_bf16x2(w6, w7)))
            hi, lo = _unpack_bf16x2(m)
            bamax = _nanmax(tl.abs(hi), tl.abs(lo))
            x0, x1 = _unpack_bf16x2(w0)
            x2, x3 = _unpack_bf16x2(w1)
            x4, x5 = _unpack_bf16x2(w2)
            x6, x7 = _unpack_bf16x2(w3)
            x8, x9 = _unpack_bf16x2(w4)
            x10, x11 = _unpack_bf16x2(w5)
            x12, x13 = _unpack_bf16x2(w6)
            x14, x15 = _unpack_bf16x2(w7)
            return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax
        if RHT:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, IS_BF16, not AMAX_ONLY)
        bamax = _amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        if AMAX_ONLY:
            tile_max = _tile_max(bamax)
            if RHT:
                tile_max = _round_input(tile_max, IS_BF16)
            _atomic_amax(max_ptr, tile_max)
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax

    @triton.jit
    def _emit_pair(xa, xb, pa, enc, s_dec, ua, ub, part_ptrs, spk, codes_ptrs, mask, SR: tl.constexpr,
                   WRITE_CODES: tl.constexpr, WRITE_PARTIAL: tl.constexpr):
        """Quantizes elements pa and pa + 1 of every block; stores their partials and packed byte."""
        va, ca = _quant_elem(xa, enc, ua, SR)
        vb, cb = _quant_elem(xb, enc, ub, SR)
        if WRITE_PARTIAL:
            tl.store(part_ptrs + pa * spk, (va * s_dec).to(tl.bfloat16), mask=mask)
            tl.store(part_ptrs + (pa + 1) * spk, (vb * s_dec).to(tl.bfloat16), mask=mask)
        if WRITE_CODES:
            tl.store(codes_ptrs + pa // 2, (ca | (cb << 4)).to(tl.uint8), mask=mask)

    @triton.jit
    def _uniform4(seed, offs):
        a, b, c, d = tl.randint4x(seed, offs)
        return (tl.random.uint_to_uniform_float(a), tl.random.uint_to_uniform_float(b),
                tl.random.uint_to_uniform_float(c), tl.random.uint_to_uniform_float(d))

    @triton.jit
    def _slice_kernel(x_ptr, sxm, sxk, M, K, amax_ptr, codes_ptr, scales_ptr, part_ptr, spm, spk, dec_ptr,
                      times_ptr, max_ptr, plain_max_ptr, seed_ptr, SCALE6: tl.constexpr, BM: tl.constexpr,
                      G: tl.constexpr, RHT: tl.constexpr,
                      IS_BF16: tl.constexpr, SR: tl.constexpr, WRITE_CODES: tl.constexpr,
                      WRITE_PARTIAL: tl.constexpr, WRITE_DEC: tl.constexpr, TIMES: tl.constexpr,
                      AMAX_ONLY: tl.constexpr):
        """1x16 blocks as 16 slices of a (BM rows x G blocks) tile: slice p holds element p of every
        block. Everything is then elementwise (no layout changes, the RHT included), and a strided
        view (a transposed tensor) is read and written along its contiguous axis. Tensors are
        (G, BM), rows last: the order Triton's default layout favours, so that values computed
        from indices (the random numbers) need no layout change to meet the loaded ones."""
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rg = tl.program_id(1).to(tl.int64) * G + tl.arange(0, G)
        mask = (rm[None, :] < M) & (rg[:, None] < K // 16)
        xp = x_ptr + rm[None, :] * sxm + rg[:, None] * (16 * sxk)
        x0, x1, x2, x3 = _ld(xp, 0, sxk, mask), _ld(xp, 1, sxk, mask), _ld(xp, 2, sxk, mask), _ld(xp, 3, sxk, mask)
        x4, x5, x6, x7 = _ld(xp, 4, sxk, mask), _ld(xp, 5, sxk, mask), _ld(xp, 6, sxk, mask), _ld(xp, 7, sxk, mask)
        x8, x9, x10, x11 = _ld(xp, 8, sxk, mask), _ld(xp, 9, sxk, mask), _ld(xp, 10, sxk, mask), _ld(xp, 11, sxk, mask)
        x12, x13 = _ld(xp, 12, sxk, mask), _ld(xp, 13, sxk, mask)
        x14, x15 = _ld(xp, 14, sxk, mask), _ld(xp, 15, sxk, mask)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax = _transform_and_amax(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, max_ptr, plain_max_ptr, RHT,
            IS_BF16, AMAX_ONLY, True)
        if not AMAX_ONLY:
            s_enc = _encode_scale(amax_ptr, SCALE6)
            if WRITE_DEC:
                _store_decode(dec_ptr, times_ptr, s_enc, TIMES)
            s_dec, enc = _block_scales(bamax, s_enc)
            if SR:
                seed = tl.load(seed_ptr)
                blk = ((rm[None, :] * (K // 16) + rg[:, None]) * 4).to(tl.int32)
                u0, u1, u2, u3 = _uniform4(seed, blk)
                u4, u5, u6, u7 = _uniform4(seed, blk + 1)
                u8, u9, u10, u11 = _uniform4(seed, blk + 2)
                u12, u13, u14, u15 = _uniform4(seed, blk + 3)
            else:
                u0, u1, u2, u3, u4, u5, u6, u7 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
                u8, u9, u10, u11, u12, u13, u14, u15 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
            pp = part_ptr + rm[None, :] * spm + rg[:, None] * (16 * spk)
            cp = codes_ptr + rm[None, :] * (K // 2) + rg[:, None] * 8
            _emit_pair(x0, x1, 0, enc, s_dec, u0, u1, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x2, x3, 2, enc, s_dec, u2, u3, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x4, x5, 4, enc, s_dec, u4, u5, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x6, x7, 6, enc, s_dec, u6, u7, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x8, x9, 8, enc, s_dec, u8, u9, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x10, x11, 10, enc, s_dec, u10, u11, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x12, x13, 12, enc, s_dec, u12, u13, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            _emit_pair(x14, x15, 14, enc, s_dec, u14, u15, pp, spk, cp, mask, SR, WRITE_CODES, WRITE_PARTIAL)
            if WRITE_CODES:
                sbits = s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
                tl.store(scales_ptr + rm[None, :] * (K // 16) + rg[:, None], sbits, mask=mask)

    @triton.jit
    def _split8(v, BM: tl.constexpr, G: tl.constexpr):
        """(BM, G, 8) with the 8 in one thread -> its 8 (BM, G) slices in element order (register moves)."""
        a, b = tl.split(tl.reshape(v, (BM, G, 4, 2)))  # elements 0,2,4,6 and 1,3,5,7
        a0, a1 = tl.split(tl.reshape(a, (BM, G, 2, 2)))  # 0,4 and 2,6
        b0, b1 = tl.split(tl.reshape(b, (BM, G, 2, 2)))  # 1,5 and 3,7
        e0, e4 = tl.split(a0)
        e2, e6 = tl.split(a1)
        e1, e5 = tl.split(b0)
        e3, e7 = tl.split(b1)
        return e0, e1, e2, e3, e4, e5, e6, e7

    @triton.jit
    def _magnitude_bits(y, BASE: tl.constexpr):
        """BASE's float32 bits plus the 3-bit magnitude code of y, round to nearest even, for BASE in
        [2^23, 2^24 - 8) with its low four bits clear: the same magnitudes as _e2m1, in fewer (and
        fewer integer) instructions, for the block kernel, which needs no values. With a = |y|, the
        code is rne(min(2a, a + 2, a/2 + 4)), capped at 7: the three pieces are E2M1's steps of 1/2,
        1 and 2, and rounding commutes with min as it is monotonic. Each piece is rounded by adding
        it to BASE, where floats are the integers (one rounding: the fused multiply-add is exact
        before it), so the minimum is BASE + code. Agrees with e2m1_rne on every float32 in [0, 8)
        (checked once); selfcheck.check_ties sweeps it densely."""
        a = tl.abs(y)
        f = tl.minimum(tl.minimum(tl.fma(a, 2.0, BASE), a + (BASE + 2.0)),
                       tl.minimum(tl.fma(a, 0.5, BASE + 4.0), BASE + 7.0))
        return f.to(tl.int32, bitcast=True)

    @triton.jit
    def _sign_bits(y0, y1, y2, y3, y4, y5, y6, y7, PLUS_ZERO: tl.constexpr):
        """A word whose bit 3 of nibble i is y_i's sign bit (the caller masks the other bits): a funnel
        shift moves each one's top four bits in, one instruction per element, where a compare and a
        select took two. The sign bit is e2m1_rne's sign (y < 0) wherever y is not -0.0; PLUS_ZERO
        adds +0.0 first, which turns -0.0 into +0.0 and leaves every other value as it is. In PTX on
        the GPU, where LLVM would split the first two shifts into three instructions."""
        if _HW_ROUND:
            return tl.inline_asm_elementwise(_SIGN_ASM_PLUS_ZERO if PLUS_ZERO else _SIGN_ASM, "=r,f,f,f,f,f,f,f,f",
                                             [y0, y1, y2, y3, y4, y5, y6, y7], dtype=tl.int32, is_pure=True, pack=1)
        s = _top4(y7, PLUS_ZERO)
        s = (s << 4) | _top4(y6, PLUS_ZERO)
        s = (s << 4) | _top4(y5, PLUS_ZERO)
        s = (s << 4) | _top4(y4, PLUS_ZERO)
        s = (s << 4) | _top4(y3, PLUS_ZERO)
        s = (s << 4) | _top4(y2, PLUS_ZERO)
        s = (s << 4) | _top4(y1, PLUS_ZERO)
        s = (s << 4) | _top4(y0, PLUS_ZERO)
        return s.to(tl.int32, bitcast=True)

    @triton.jit
    def _top4(y, PLUS_ZERO: tl.constexpr):
        """The top four bits of y (+ 0.0) as the low nibble (see _sign_bits)."""
        if PLUS_ZERO:
            y = y + 0.0
        return y.to(tl.uint32, bitcast=True) >> 28

    @triton.jit
    def _word(x0, x1, x2, x3, x4, x5, x6, x7, enc, sixteen, PLUS_ZERO: tl.constexpr):
        """Eight elements' codes as one little-endian int32 (element 2i in the low nibble of byte i).
        y = x * enc + 0.0 in one rounding: -0.0 only where a negative product underflows, as a
        -0.0 input gives +0.0 (see _block_kernel for when PLUS_ZERO must clear it). The magnitudes go
        in by Horner's rule on _magnitude_bits, multiplying by sixteen (16 from _opaque: IMADs on the
        FMA pipe, where shifts would take the busier integer pipe). Of the bases, only the two
        lowest nibbles' survive the shifts, and they were chosen to cancel: 0x4B000000 +
        (0x4B500000 << 4) = 2^32. The sign bits are merged in with their mask by one instruction."""
        y0, y1, y2, y3 = tl.fma(x0, enc, 0.0), tl.fma(x1, enc, 0.0), tl.fma(x2, enc, 0.0), tl.fma(x3, enc, 0.0)
        y4, y5, y6, y7 = tl.fma(x4, enc, 0.0), tl.fma(x5, enc, 0.0), tl.fma(x6, enc, 0.0), tl.fma(x7, enc, 0.0)
        w = _magnitude_bits(y7, 8388608.0)
        w = w * sixteen + _magnitude_bits(y6, 8388608.0)
        w = w * sixteen + _magnitude_bits(y5, 8388608.0)
        w = w * sixteen + _magnitude_bits(y4, 8388608.0)
        w = w * sixteen + _magnitude_bits(y3, 8388608.0)
        w = w * sixteen + _magnitude_bits(y2, 8388608.0)
        w = w * sixteen + _magnitude_bits(y1, 13631488.0)  # 0x4B500000
        w = w * sixteen + _magnitude_bits(y0, 8388608.0)  # 0x4B000000
        return w | (_sign_bits(y0, y1, y2, y3, y4, y5, y6, y7, PLUS_ZERO) & -2004318072)  # 0x88888888

    @triton.jit
    def _block_kernel(x_ptr, sxm, M, K, amax_ptr, codes_ptr, scales_ptr, max_ptr, plain_max_ptr,
                      SCALE6: tl.constexpr, BM: tl.constexpr, G: tl.constexpr, RHT: tl.constexpr,
                      IS_BF16: tl.constexpr, AMAX_ONLY: tl.constexpr, TILE2D: tl.constexpr):
        """Contiguous rows, 1x16 blocks, round to nearest, codes and scales (or only the amaxes):
        each thread loads whole blocks as two 8-element vectors and splits them into 16 (BM, G)
        slices in its own registers, so the RHT butterfly, the block amax and the nibble packing
        are elementwise: no shared-memory layout changes (the row-tile kernel needs several).
        TILE2D: 16x16 tiles (BM a multiple of 16, M too), whose amax is the max of its 16 rows'
        block amaxes: one reduction across threads per tile."""
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rg = tl.program_id(1).to(tl.int64) * G + tl.arange(0, G)
        mask = (rm[:, None] < M) & (rg[None, :] < K // 16)
        base = x_ptr + rm[:, None, None] * sxm + rg[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        m65536 = _opaque(K, 65536)
        lo = _f32_pairs(tl.load(base, mask=mask[:, :, None], other=0.0), m65536)
        hi = _f32_pairs(tl.load(base + 8, mask=mask[:, :, None], other=0.0), m65536)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(lo, BM, G)
        x8, x9, x10, x11, x12, x13, x14, x15 = _split8(hi, BM, G)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax = _transform_and_amax(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, max_ptr, plain_max_ptr, RHT,
            IS_BF16, AMAX_ONLY, False)
        if TILE2D:
            bamax = _rows16_max(bamax, BM, G)
        if not AMAX_ONLY:
            s_enc = _encode_scale(amax_ptr, SCALE6)
            s_dec, enc = _block_scales(bamax, s_enc)
            # y = x * enc + 0.0 in one rounding is -0.0 only where the product underflows, which an
            # S_enc of at least _NO_UNDERFLOW rules out for every block: then the sign bits need no
            # addition of their own (_sign_bits)
            sixteen = _opaque(K, 16)
            if s_enc >= (_NO_UNDERFLOW_BF16 if IS_BF16 else _NO_UNDERFLOW_F32):
                lo_word = _word(x0, x1, x2, x3, x4, x5, x6, x7, enc, sixteen, False)
                hi_word = _word(x8, x9, x10, x11, x12, x13, x14, x15, enc, sixteen, False)
            else:
                lo_word = _word(x0, x1, x2, x3, x4, x5, x6, x7, enc, sixteen, True)
                hi_word = _word(x8, x9, x10, x11, x12, x13, x14, x15, enc, sixteen, True)
            # one 64-bit word per block: a warp's store then fills whole 32-byte sectors, where two
            # 32-bit stores each wrote half of every sector (L2 write sectors 2.21M -> 1.77M at 8192^2,
            # bench/RESULTS.md iteration 9)
            lo_word = lo_word.to(tl.int64) & 0xFFFFFFFF
            hi_word = hi_word.to(tl.int64) << 32
            tl.store(codes_ptr + rm[:, None] * (K // 16) + rg[None, :], hi_word | lo_word, mask=mask)
            sbits = s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            tl.store(scales_ptr + rm[:, None] * (K // 16) + rg[None, :], sbits, mask=mask)

    @triton.jit
    def _absmax_kernel(x_ptr, n, word_ptr, BLOCK_SIZE: tl.constexpr, ITERS: tl.constexpr):
        """max |x| of a contiguous tensor into the zeroed int32 word_ptr (float32 bits), each program
        folding in the max of its ITERS consecutive chunks (_atomic_amax)."""
        start = tl.program_id(0).to(tl.int64) * (BLOCK_SIZE * ITERS)
        acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
        for i in range(ITERS):
            offs = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            acc = _nanmax(acc, tl.abs(_f32(tl.load(x_ptr + offs, mask=offs < n, other=0.0))))
        _atomic_amax(word_ptr, _tile_max(acc))

    # launched through CachedLaunch: Triton's own fn[grid] costs tens of microseconds of host time
    # per call, which bounded the eager NVFP4 linear step at 3072 -> 3072, 16K tokens (triton_launch)
    _quant_launcher = CachedLaunch(_quant_kernel)
    _slice_launcher = CachedLaunch(_slice_kernel)
    _block_launcher = CachedLaunch(_block_kernel)
    _absmax_launcher = CachedLaunch(_absmax_kernel)


# tile of the quantize kernel (BM rows x BK columns) and its warps; bench/nvfp4_quant.py --sweep
TILE = {"BM": 32, "BK": 128, "num_warps": 4}
# the row kernel's tile under Four-Over-Six (the NVFP4 KV cache's writes): 8 elements a thread, where the
# kernel's two candidates a block made TILE's 32 a thread slow (bench/nvfp4_quant.py --fos-sweep, H100: the
# KV write 0.140 ms against 0.185 at TILE; bench/RESULTS.md). BM stays a multiple of 16 (16x16 tiles)
FOS_TILE = {"BM": 16, "BK": 128, "num_warps": 8}
SLICE_TILE = {"BM": 64, "G": 4, "num_warps": 4}
AMAX_TILE = {"BLOCK_SIZE": 8192, "ITERS": 8, "num_warps": 16}  # bench/nvfp4_quant.py block_sweep
# the block kernel's tile per use (bench/nvfp4_quant.py block_sweep): 4 blocks per thread for the codes
# (plain and RHT'd: 0.060 -> 0.059 ms at 8192^2 for the RHT, 2 -> 4 blocks, iteration 9; 16x16 tiles: 16 rows,
# 4 warps, 0.057 ms, where 16x16 with 2 warps swept at 0.054 but has not had the selfcheck, iteration 10), 1
# for the amaxes
BLOCK_TILES = {"codes": {"BM": 1, "G": 512, "num_warps": 4}, "codes_rht": {"BM": 1, "G": 512, "num_warps": 4},
               "codes_16x16": {"BM": 16, "G": 32, "num_warps": 4}, "amaxes": {"BM": 4, "G": 128, "num_warps": 4}}
KERNELS = ("rows", "slices", "blocks")
FORCE_KERNEL: str | None = None  # None: pick_kernel decides; the tests and benches force each in turn


def _signs(device: torch.device) -> torch.Tensor:
    # made on first use; inside a CUDA graph capture the host-to-device copy itself is refused by CUDA
    return device_constant(SIGNS, device)


def _cdiv(a: int, b: int) -> int:
    # plain integer ceil-division: triton.cdiv is a constexpr function whose host-side call wrapper
    # costs microseconds, and the grids are computed on every launch
    return -(-a // b)


def _grid(m: int, k: int, tile: dict) -> tuple[int, int]:
    return _cdiv(m, tile["BM"]), _cdiv(k, tile["BK"])


def _block_tile(use: str, k: int) -> dict:
    """BLOCK_TILES[use], its G narrowed (and BM widened to match) where rows have fewer blocks."""
    tile = dict(BLOCK_TILES[use])
    while tile["G"] > 1 and tile["G"] // 2 >= k // BLOCK:
        tile["G"] //= 2
        tile["BM"] *= 2
    return tile


def _block_launch(tile: dict, m: int, k: int, *args, **constexprs) -> None:
    grid = (_cdiv(m, tile["BM"]), _cdiv(k // BLOCK, tile["G"]))
    _block_launcher[grid](*args, BM=tile["BM"], G=tile["G"], num_warps=tile["num_warps"], enable_fp_fusion=False,
                          **constexprs)


def _slice_grid(m: int, k: int) -> tuple[int, int]:
    return _cdiv(m, SLICE_TILE["BM"]), _cdiv(k // BLOCK, SLICE_TILE["G"])


def pick_kernel(x: torch.Tensor, tile, stochastic: bool, four_over_six, codes_only: bool) -> str:
    """rows: row tiles, every option (16x16 tiles, 4/6). slices: 1x16 blocks of strided views (the
    wgrad operands), read along their contiguous axis. blocks: codes and scales of contiguous rows,
    round to nearest (1x16 or 16x16 tiles), each thread holding whole blocks (bench/nvfp4_quant.py
    compares them)."""
    if FORCE_KERNEL not in (None, *KERNELS):
        raise ValueError(f"FORCE_KERNEL must be None or one of {KERNELS}; got {FORCE_KERNEL!r}")
    if four_over_six is not None:
        return "rows"
    blocks_apply = codes_only and not stochastic and x.stride(1) == 1
    if tile != (1, BLOCK):  # 16x16 tiles: the slice kernel has none
        return "blocks" if blocks_apply and FORCE_KERNEL in (None, "blocks") else "rows"
    if FORCE_KERNEL is not None:
        return FORCE_KERNEL if FORCE_KERNEL != "blocks" or blocks_apply else "rows"
    if x.stride(1) != 1:
        return "slices"
    return "blocks" if blocks_apply else "rows"


def global_amax(x: torch.Tensor, rht: bool) -> torch.Tensor:
    """max |x| (after the RHT when asked), one pass over x, as a float32 scalar."""
    with made_current(x):
        return _global_amax(x, rht)


def _global_amax(x: torch.Tensor, rht: bool) -> torch.Tensor:
    if rht:
        return _amaxes(x)[1]
    if not x.is_contiguous():
        return torch.linalg.vector_norm(x, float("inf")).float()
    n = x.numel()
    per_program = AMAX_TILE["BLOCK_SIZE"] * AMAX_TILE["ITERS"]
    word = torch.zeros((), dtype=torch.int32, device=x.device)
    _absmax_launcher[(_cdiv(n, per_program),)](x, n, word, BLOCK_SIZE=AMAX_TILE["BLOCK_SIZE"],
                                               ITERS=AMAX_TILE["ITERS"], num_warps=AMAX_TILE["num_warps"])
    return word.view(torch.float32)


def _check(x: torch.Tensor, tile) -> None:
    check_input(x, tile)
    if not x.is_cuda and not INTERPRETING:
        raise ValueError("the Triton backend needs a CUDA tensor; use backend='torch' on the CPU")


def amaxes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, max |RHT(x)|) as float32 scalars from one pass over x (blocks along its last axis)."""
    with made_current(x):
        return _amaxes(x)


def _amaxes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, (1, BLOCK))
    m, k = x.shape
    if m * k == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero.clone()
    rows = x.stride(1) == 1  # contiguous rows: whole blocks per thread; else slices along the other axis
    maxes = torch.zeros(2, dtype=torch.int32, device=x.device)  # float32 bits, for _atomic_amax
    rht_max, plain_max = maxes.unbind()
    is_bf16 = x.dtype == torch.bfloat16
    if rows:
        _block_launch(_block_tile("amaxes", k), m, k, x, x.stride(0), m, k, rht_max, rht_max, rht_max, rht_max,
                      plain_max, SCALE6=0.0, RHT=True, IS_BF16=is_bf16, AMAX_ONLY=True, TILE2D=False)
    else:
        _slice_launcher[_slice_grid(m, k)](x, x.stride(0), x.stride(1), m, k, rht_max, rht_max, rht_max, rht_max, 0,
                                           0, rht_max, rht_max, rht_max, plain_max, rht_max, SCALE6=0.0,
                                           BM=SLICE_TILE["BM"], G=SLICE_TILE["G"], num_warps=SLICE_TILE["num_warps"],
                                           RHT=True, IS_BF16=is_bf16, SR=False, WRITE_CODES=False,
                                           WRITE_PARTIAL=False, WRITE_DEC=False, TIMES=False, AMAX_ONLY=True,
                                           enable_fp_fusion=False)
    rht, plain = maxes.view(torch.float32).unbind()
    return plain, rht


def _device_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The stochastic-rounding seed as a tensor on x's device, drawn by a torch random op from
    ``generator`` (None: the device's default generator). The kernel reads it there, so there is
    no host sync, and a CUDA graph replay draws a new one as torch's graph-safe generators do."""
    source = generator.device if generator is not None else device  # a generator fills tensors on its device
    if source.type == "cpu" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError("stochastic rounding inside a CUDA graph capture needs a CUDA generator (or None): "
                         "a CPU generator's seed would be drawn once, at capture, and reused by every replay")
    seed = torch.randint(0, 2**31 - 2, (1,), generator=generator, device=source, dtype=torch.int32)
    if seed.device != device:
        if seed.is_cpu and device.type == "cuda":  # pinned, so the copy does not wait for the GPU
            seed = seed.pin_memory()
        seed = seed.to(device, non_blocking=True)
    return seed


def _launch(x, tile, rht, stochastic, four_over_six, generator, amax, codes, scales, part, dec, times=None):
    # with x's device current (the callers make it so): Triton launches on the current device
    _check(x, tile)
    if four_over_six not in FOS_CODES:
        raise ValueError(f"four_over_six must be None, 'mse' or 'mae'; got {four_over_six!r}")
    m, k = x.shape
    scale_max = FOUR_OVER_SIX_E4M3_MAX if four_over_six else E4M3_MAX
    amax = None if amax is None else float32_scalar(amax, x.device)
    times = None if times is None else float32_scalar(times, x.device)
    if m * k == 0:  # nothing to launch; the torch path's amax (0 unless given) and decode scale
        amax = torch.zeros((), dtype=torch.float32, device=x.device) if amax is None else amax
        if dec is not None:
            dec.copy_(1.0 / global_encode_scale(amax, scale_max) * (1.0 if times is None else times))
        return amax, scale_max
    amax = _global_amax(x, rht) if amax is None else amax
    dummy = amax
    seed = _device_seed(generator, x.device) if stochastic else dummy
    common = dict(SCALE6=scale_max * 6.0, RHT=rht, IS_BF16=x.dtype == torch.bfloat16, SR=stochastic,
                  WRITE_CODES=codes is not None, WRITE_PARTIAL=part is not None, WRITE_DEC=dec is not None,
                  TIMES=times is not None, enable_fp_fusion=False)
    args = (x, x.stride(0), x.stride(1), m, k)
    outs = (codes if codes is not None else dummy, scales if scales is not None else dummy,
            part if part is not None else dummy, part.stride(0) if part is not None else 0,
            part.stride(1) if part is not None else 0, dec if dec is not None else dummy,
            dummy if times is None else times)
    kernel = pick_kernel(x, tile, stochastic, four_over_six, codes is not None and part is None)
    if kernel == "blocks":
        use = "codes_16x16" if tile[0] == BLOCK else "codes_rht" if rht else "codes"
        _block_launch(_block_tile(use, k), m, k, x, x.stride(0), m, k, amax, codes.view(torch.int64), scales, dummy,
                      dummy, SCALE6=scale_max * 6.0, RHT=rht, IS_BF16=x.dtype == torch.bfloat16, AMAX_ONLY=False,
                      TILE2D=tile[0] == BLOCK)
    elif kernel == "slices":
        _slice_launcher[_slice_grid(m, k)](*args, amax, *outs, dummy, dummy, seed, BM=SLICE_TILE["BM"],
                                           G=SLICE_TILE["G"], num_warps=SLICE_TILE["num_warps"], AMAX_ONLY=False,
                                           **common)
    else:
        row = FOS_TILE if four_over_six else TILE
        _quant_launcher[_grid(m, k, row)](*args, _signs(x.device), amax, *outs, seed, BM=row["BM"],
                                          BK=row["BK"], num_warps=row["num_warps"], TILE2D=tile[0] == BLOCK,
                                          FOS=FOS_CODES[four_over_six], **common)
    return amax, scale_max


def quantize(x: torch.Tensor, tile=(1, BLOCK), rht=False, stochastic=False, four_over_six=None,
             generator=None, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    check_input(x, tile)
    m, k = x.shape
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=x.device)
    with made_current(x):
        amax, scale_max = _launch(x, tile, rht, stochastic, four_over_six, generator, amax, codes, scales, None, None)
    return NVFP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn), amax=amax.float(), shape=(m, k),
                       tile=tuple(tile), rht=rht, scale_max=scale_max)


def quantize_partial(x: torch.Tensor, tile=(1, BLOCK), rht=False, stochastic=False, four_over_six=None,
                     generator=None, amax: torch.Tensor | None = None,
                     times: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * S_dec as bfloat16, in x's memory layout; 1 / S_enc as a float32 scalar, times ``times``
    where given)."""
    check_input(x, tile)
    part = torch.empty_like(x, dtype=torch.bfloat16)  # same strides as x: a transposed view stays one
    dec = torch.empty((), dtype=torch.float32, device=x.device)
    with made_current(x):
        _launch(x, tile, rht, stochastic, four_over_six, generator, amax, None, None, part, dec, times)
    return part, dec
