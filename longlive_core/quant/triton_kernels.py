"""Triton kernels for NVFP4 quantization: the default on CUDA, bit-identical to the torch path.

One kernel quantizes a 2-D view (any strides, so a transposed view is quantized along its
other axis without a copy) in tiles of BM rows x BK columns: it can write the packed codes and
E4M3 scales (``quantize``) and/or the "partial" dequantization q * S_dec in bfloat16, which is
exact and is what the emulated NVFP4 GEMM multiplies (``quantize_partial``). The global amax
comes from one reduction pass (with the RHT applied in registers when asked), so x is read twice
unless the caller passes the amax.

Bit-exactness with ``nvfp4.quantize_torch`` rests on doing the same float32 operations in the
same order: IEEE division (``div_rn``), no fused multiply-adds (``enable_fp_fusion=False``), the
RHT butterfly and the Four-Over-Six error sums in the same pairwise order, and hardware
round-to-nearest-even casts to E4M3 and bfloat16. Stochastic rounding uses Philox (``tl.rand``)
from a seed, so its draws differ from the torch path's; both are unbiased.
"""
from __future__ import annotations

import functools
import os

import torch

from longlive_core.quant.hadamard import SIGNS
from longlive_core.quant.nvfp4 import (
    BLOCK,
    E4M3_MAX,
    FLT_MAX,
    FOUR_OVER_SIX_E4M3_MAX,
    NVFP4Tensor,
    check_input,
    global_encode_scale,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None


@functools.cache
def available() -> bool:
    return triton is not None and torch.cuda.is_available()


FOS_CODES = {None: 0, "mse": 1, "mae": 2}
# TRITON_INTERPRET=1 runs the kernels on the CPU (numpy): slow, but lets the tests check them here.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    _FLT_MAX = tl.constexpr(FLT_MAX)

    @triton.jit
    def _round_e4m3(v):
        """float32 in [0, 448] -> the nearest E4M3 value (ties to even), still float32. Done in integer
        arithmetic so it does not depend on how a cast rounds (Triton's CPU interpreter truncates)."""
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # below 2^-6 E4M3 is subnormal, steps of 2^-9: adding 2^23 rounds v * 2^9 to an integer, ties to even
        sub = ((v * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
        return tl.where(v < 0.015625, sub, normal)

    @triton.jit
    def _round_bf16(v):
        """float32 -> the nearest bfloat16 value (ties to even), still float32."""
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
        """x (BM, G*16) float32 -> the RHT of each 16-block, rounded through the input dtype."""
        s = tl.load(signs_ptr + tl.arange(0, 16))
        v = tl.reshape(x, (BM, G, 16)) * s[None, None, :]
        v = _butterfly_stage(v, BM, G, 1)
        v = _butterfly_stage(v, BM, G, 2)
        v = _butterfly_stage(v, BM, G, 4)
        v = _butterfly_stage(v, BM, G, 8)
        v = tl.reshape(v * 0.25, (BM, G * 16))
        if IS_BF16:
            v = _round_bf16(v)
        return v

    @triton.jit
    def _load_tile(x_ptr, sxm, sxk, M, K, signs_ptr, BM: tl.constexpr, BK: tl.constexpr,
                   RHT: tl.constexpr, IS_BF16: tl.constexpr):
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rk = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        if RHT:
            x = _rht(x, signs_ptr, BM, BK // 16, IS_BF16)
        return x, rm, rk, mask

    @triton.jit
    def _amax_kernel(x_ptr, sxm, sxk, M, K, signs_ptr, out_ptr, BM: tl.constexpr, BK: tl.constexpr,
                     RHT: tl.constexpr, IS_BF16: tl.constexpr):
        x, rm, rk, mask = _load_tile(x_ptr, sxm, sxk, M, K, signs_ptr, BM, BK, RHT, IS_BF16)
        tile_max = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tile_max)

    @triton.jit
    def _e2m1_rne_mag(a):
        """Magnitude code 0..7 of |v| <= 6, ties to the even code."""
        return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))

    @triton.jit
    def _e2m1_value(mag):
        return tl.where(mag <= 4, mag.to(tl.float32) * 0.5, tl.where(mag == 7, 6.0, (mag - 2).to(tl.float32)))

    @triton.jit
    def _e2m1_sr_mag(a, u):
        lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
              + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32))
        lo_v = _e2m1_value(lo)
        hi_v = _e2m1_value(lo + 1)
        p = tl.math.div_rn(a - lo_v, hi_v - lo_v)
        return lo + (u < p).to(tl.int32)

    @triton.jit
    def _candidate(xb, bamax, s_enc, seed, offs, mult, SR: tl.constexpr, FOS: tl.constexpr):
        """One choice of block scales: (E4M3 scales as float32, signed E2M1 values, magnitude codes)."""
        if FOS == 0:
            scaled = bamax * (s_enc * (1.0 / 6.0))
        else:
            scaled = tl.math.div_rn(bamax, 6.0) * s_enc * mult
        s_dec = _round_e4m3(tl.minimum(scaled, 448.0))
        enc = tl.minimum(tl.math.div_rn(1.0, s_dec * tl.math.div_rn(1.0, s_enc)), _FLT_MAX)
        v = tl.minimum(tl.maximum(xb * enc[:, :, None], -6.0), 6.0)
        a = tl.abs(v)
        if SR:
            mag = _e2m1_sr_mag(a, tl.rand(seed, offs))
        else:
            mag = _e2m1_rne_mag(a)
        neg = v < 0
        val = _e2m1_value(mag)
        val = tl.where(neg, -val, val)
        code = mag + neg.to(tl.int32) * 8
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
    def _quant_kernel(x_ptr, sxm, sxk, M, K, signs_ptr, senc_ptr, codes_ptr, scales_ptr, part_ptr, spm, spk,
                      seed, BM: tl.constexpr, BK: tl.constexpr, TILE2D: tl.constexpr, RHT: tl.constexpr,
                      IS_BF16: tl.constexpr, SR: tl.constexpr, FOS: tl.constexpr,
                      WRITE_CODES: tl.constexpr, WRITE_PARTIAL: tl.constexpr):
        G: tl.constexpr = BK // 16
        x, rm, rk, mask = _load_tile(x_ptr, sxm, sxk, M, K, signs_ptr, BM, BK, RHT, IS_BF16)
        xb = tl.reshape(x, (BM, G, 16))
        bamax = tl.max(tl.abs(xb), axis=2)
        if TILE2D:
            t = tl.max(tl.reshape(bamax, (BM // 16, 16, G)), axis=1)
            bamax = tl.reshape(tl.broadcast_to(t[:, None, :], (BM // 16, 16, G)), (BM, G))
        s_enc = tl.load(senc_ptr)
        offs = tl.reshape((rm[:, None] * K + rk[None, :]).to(tl.int32), (BM, G, 16))
        if FOS == 0:
            s_dec, val, code = _candidate(xb, bamax, s_enc, seed, offs, 1.0, SR, FOS)
        else:
            s6, val6, code6 = _candidate(xb, bamax, s_enc, seed, offs, 1.0, SR, FOS)
            s4, val4, code4 = _candidate(xb, bamax, s_enc, seed + 1, offs, 1.5, SR, FOS)
            e6 = _block_err(val6, s6, s_enc, xb, BM, G, FOS)
            e4 = _block_err(val4, s4, s_enc, xb, BM, G, FOS)
            if TILE2D:
                e6 = _tile_reduce(e6, BM, G)
                e4 = _tile_reduce(e4, BM, G)
            pick4 = e4 < e6
            s_dec = tl.where(pick4, s4, s6)
            val = tl.where(pick4[:, :, None], val4, val6)
            code = tl.where(pick4[:, :, None], code4, code6)
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
    def _epilogue_kernel(acc_ptr, a_dec_ptr, b_dec_ptr, bias_ptr, out_ptr, numel, N, HAS_BIAS: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < numel
        alpha = tl.load(a_dec_ptr) * tl.load(b_dec_ptr)
        y = tl.load(acc_ptr + offs, mask=mask, other=0.0) * alpha
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_SIGNS: dict[torch.device, torch.Tensor] = {}
# tile of the quantize kernel (BM rows x BK columns) and its warps; bench/nvfp4_quant.py --sweep
TILE = {"BM": 32, "BK": 64, "num_warps": 4}


def epilogue(acc: torch.Tensor, a_decode: torch.Tensor, b_decode: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype) -> torch.Tensor:
    """acc * (a_decode * b_decode) (+ bias) cast to out_dtype, one pass; the torch path's operation order."""
    acc = acc.contiguous()
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    numel, block = acc.numel(), 2048
    _epilogue_kernel[(triton.cdiv(numel, block),)](
        acc, a_decode.reshape(1).float(), b_decode.reshape(1).float(), bias if bias is not None else acc, out,
        numel, acc.shape[-1], HAS_BIAS=bias is not None, BLOCK_SIZE=block, enable_fp_fusion=False)
    return out


def _signs(device: torch.device) -> torch.Tensor:
    if device not in _SIGNS:
        _SIGNS[device] = torch.tensor(SIGNS, dtype=torch.float32, device=device)
    return _SIGNS[device]


def _grid(m: int, k: int) -> tuple[int, int]:
    return triton.cdiv(m, TILE["BM"]), triton.cdiv(k, TILE["BK"])


def global_amax(x: torch.Tensor, rht: bool) -> torch.Tensor:
    """max |x| (after the RHT when asked), float32 scalar, one pass over x."""
    if not rht:
        return torch.linalg.vector_norm(x, float("inf")).float()
    m, k = x.shape
    grid = _grid(m, k)
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    _amax_kernel[grid](x, x.stride(0), x.stride(1), m, k, _signs(x.device), partial, BM=TILE["BM"], BK=TILE["BK"],
                       num_warps=TILE["num_warps"], RHT=True, IS_BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False)
    return partial.amax()


def _launch(x, tile, rht, stochastic, four_over_six, generator, amax, write_codes, part):
    check_input(x, tile)
    if not x.is_cuda and not INTERPRETING:
        raise ValueError("the Triton backend needs a CUDA tensor; use backend='torch' on the CPU")
    if four_over_six not in FOS_CODES:
        raise ValueError(f"four_over_six must be None, 'mse' or 'mae'; got {four_over_six!r}")
    m, k = x.shape
    amax = global_amax(x, rht) if amax is None else amax.float().reshape(())
    scale_max = FOUR_OVER_SIX_E4M3_MAX if four_over_six else E4M3_MAX
    s_enc = global_encode_scale(amax, scale_max).reshape(1)
    codes = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device) if write_codes else None
    scales = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=x.device) if write_codes else None
    seed = int(torch.randint(0, 2**31 - 2, (1,), generator=generator).item()) if stochastic else 0
    dummy = s_enc
    _quant_kernel[_grid(m, k)](
        x, x.stride(0), x.stride(1), m, k, _signs(x.device), s_enc,
        codes if codes is not None else dummy, scales if scales is not None else dummy,
        part if part is not None else dummy, part.stride(0) if part is not None else 0,
        part.stride(1) if part is not None else 0, seed,
        BM=TILE["BM"], BK=TILE["BK"], num_warps=TILE["num_warps"], TILE2D=tile[0] == BLOCK, RHT=rht,
        IS_BF16=x.dtype == torch.bfloat16, SR=stochastic,
        FOS=FOS_CODES[four_over_six], WRITE_CODES=write_codes, WRITE_PARTIAL=part is not None,
        enable_fp_fusion=False)
    return amax, s_enc, scale_max, codes, scales


def quantize(x: torch.Tensor, tile=(1, BLOCK), rht=False, stochastic=False, four_over_six=None,
             generator=None, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    amax, _, scale_max, codes, scales = _launch(x, tile, rht, stochastic, four_over_six, generator, amax,
                                                True, None)
    return NVFP4Tensor(codes=codes, scales=scales.view(torch.float8_e4m3fn), amax=amax, shape=tuple(x.shape),
                       tile=tuple(tile), rht=rht, scale_max=scale_max)


def quantize_partial(x: torch.Tensor, tile=(1, BLOCK), rht=False, stochastic=False, four_over_six=None,
                     generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * S_dec as bfloat16, in x's memory layout; 1 / S_enc as a float32 scalar)."""
    part = torch.empty_like(x, dtype=torch.bfloat16)  # same strides as x: a transposed view stays one
    _, s_enc, _, _, _ = _launch(x, tile, rht, stochastic, four_over_six, generator, None, False, part)
    return part, (1.0 / s_enc).reshape(())
