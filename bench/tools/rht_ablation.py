"""Where the RHT codes kernel's time goes: copies of the block kernel's RHT codes path (amax given)
with one stage left out, and a row loop that loads the next rows while it computes these, timed
side by side on 8192x8192 bf16 (CUDA graphs over three rotating inputs). Only "full" and the
loops compute the real codes (checked bit for bit against the library); the others are for
timing only. On the lent H200, from the repository root:

    PYTHONPATH=. python3 bench/tools/rht_ablation.py
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.nvfp4_quant import REFERENCE_COPY_TBS, graph_ms
from longlive_core.quant import triton_kernels as tk

FULL, NO_CODES, NO_RHT, MEMORY_ONLY, NO_ROUNDING = 0, 1, 2, 3, 4
SPLIT_SIGN, PACKED_AMAX, RCP, ALL_THREE, ROUND_ALONE, ROUND_ALONE_RCP, IMAD_HORNER = 5, 6, 7, 8, 9, 10, 11
JOINED, JOINED_IMAD = 12, 13
MODES = {"full": FULL, "no codes arithmetic (xor of values)": NO_CODES, "no RHT (plain codes)": NO_RHT,
         "memory only (xor of loaded words)": MEMORY_ONLY, "no bf16 rounding after the RHT": NO_ROUNDING,
         "signs added after the magnitudes' Horner": SPLIT_SIGN, "packed bf16x2 block amax": PACKED_AMAX,
         "rcp.rn for the block reciprocals": RCP, "split signs + packed amax + rcp.rn": ALL_THREE,
         "each value rounded alone (cvt with a zero partner)": ROUND_ALONE,
         "rounded alone + rcp.rn": ROUND_ALONE_RCP,
         "rounded alone + rcp.rn + Horner by IMAD (16 from an argument)": IMAD_HORNER,
         "rounded alone + rcp.rn + one 64-bit code store per block": JOINED,
         "rounded alone + rcp.rn + IMAD Horner + 64-bit stores": JOINED_IMAD}
EXACT = (FULL, SPLIT_SIGN, PACKED_AMAX, RCP, ALL_THREE, ROUND_ALONE, ROUND_ALONE_RCP, IMAD_HORNER, JOINED, JOINED_IMAD)


@triton.jit
def _word_imad(x0, x1, x2, x3, x4, x5, x6, x7, enc, sixteen):
    """tk._word with the Horner multiplier a runtime 16: ptxas then emits IMAD (the FMA pipe), not LEA."""
    w = tk._nibble_bits(x7, enc)
    w = w * sixteen + tk._nibble_bits(x6, enc)
    w = w * sixteen + tk._nibble_bits(x5, enc)
    w = w * sixteen + tk._nibble_bits(x4, enc)
    w = w * sixteen + tk._nibble_bits(x3, enc)
    w = w * sixteen + tk._nibble_bits(x2, enc)
    w = w * sixteen + tk._nibble_bits(x1, enc)
    w = w * sixteen + tk._nibble_bits(x0, enc)
    return w + 0x05000000


@triton.jit
def _round_alone(v):
    """v rounded to bfloat16, as float32, by one convert: the value in the high half, zeros below."""
    if not tk._HW_ROUND:
        return tk._round_bf16(v)
    w = tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0; cvt.rn.bf16x2.f32 $0, $1, z; }", "=r,f", [v],
                                  dtype=tl.int32, is_pure=True, pack=1)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def _rht16_round_alone(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = tk._rht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, True, False)
    return (_round_alone(x0), _round_alone(x1), _round_alone(x2), _round_alone(x3), _round_alone(x4),
            _round_alone(x5), _round_alone(x6), _round_alone(x7), _round_alone(x8), _round_alone(x9),
            _round_alone(x10), _round_alone(x11), _round_alone(x12), _round_alone(x13), _round_alone(x14),
            _round_alone(x15))


@triton.jit
def _mag_bits(y):
    """0x4B000000 plus the E2M1 magnitude code of |y| (tk._nibble_bits without the sign)."""
    a = tl.abs(y)
    f = tl.minimum(tl.minimum(tl.fma(a, 2.0, 8388608.0), a + 8388610.0), tl.minimum(tl.fma(a, 0.5, 8388612.0),
                                                                                      8388615.0))
    return f.to(tl.int32, bitcast=True)


@triton.jit
def _word_split_sign(x0, x1, x2, x3, x4, x5, x6, x7, enc):
    """tk._word with the magnitudes packed first (shift-adds only) and each sign bit set after."""
    y0, y1, y2, y3, y4, y5, y6, y7 = x0 * enc, x1 * enc, x2 * enc, x3 * enc, x4 * enc, x5 * enc, x6 * enc, x7 * enc
    w = _mag_bits(y7)
    w = w * 16 + _mag_bits(y6)
    w = w * 16 + _mag_bits(y5)
    w = w * 16 + _mag_bits(y4)
    w = w * 16 + _mag_bits(y3)
    w = w * 16 + _mag_bits(y2)
    w = w * 16 + _mag_bits(y1)
    w = w * 16 + _mag_bits(y0) + 0x05000000
    w = tl.where(y0 < 0, w | 0x8, w)
    w = tl.where(y1 < 0, w | 0x80, w)
    w = tl.where(y2 < 0, w | 0x800, w)
    w = tl.where(y3 < 0, w | 0x8000, w)
    w = tl.where(y4 < 0, w | 0x80000, w)
    w = tl.where(y5 < 0, w | 0x800000, w)
    w = tl.where(y6 < 0, w | 0x8000000, w)
    return tl.where(y7 < 0, w | -2147483648, w)


@triton.jit
def _rcp_rn(v):
    if not tk._HW_ROUND:
        return tl.math.div_rn(1.0, v)
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _block_scales_rcp(bamax, s_enc):
    s_dec = tk._round_e4m3(tl.minimum(bamax * (s_enc * (1.0 / 6.0)), 448.0))
    return s_dec, tl.minimum(_rcp_rn(s_dec * _rcp_rn(s_enc)), 3.4028234663852886e38)


@triton.jit
def _load(x_ptr, sxm, M, K, row0, BM: tl.constexpr, G: tl.constexpr):
    rm = row0 + tl.arange(0, BM)
    rg = tl.program_id(1).to(tl.int64) * G + tl.arange(0, G)
    mask = (rm[:, None] < M) & (rg[None, :] < K // 16)
    base = x_ptr + rm[:, None, None] * sxm + rg[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    return tl.load(base, mask=mask[:, :, None], other=0.0), tl.load(base + 8, mask=mask[:, :, None], other=0.0)


@triton.jit
def _xor8(x0, x1, x2, x3, x4, x5, x6, x7):
    b = x0.to(tl.int32, bitcast=True) ^ x1.to(tl.int32, bitcast=True) ^ x2.to(tl.int32, bitcast=True)
    b = b ^ x3.to(tl.int32, bitcast=True) ^ x4.to(tl.int32, bitcast=True) ^ x5.to(tl.int32, bitcast=True)
    return b ^ x6.to(tl.int32, bitcast=True) ^ x7.to(tl.int32, bitcast=True)


@triton.jit
def _compute_store(lo, hi, M, K, amax_ptr, codes_ptr, scales_ptr, row0, BM: tl.constexpr, G: tl.constexpr,
                   MODE: tl.constexpr, sixteen=16):
    rm = row0 + tl.arange(0, BM)
    rg = tl.program_id(1).to(tl.int64) * G + tl.arange(0, G)
    mask = (rm[:, None] < M) & (rg[None, :] < K // 16)
    words = codes_ptr + rm[:, None] * (K // 8) + rg[None, :] * 2
    sptr = scales_ptr + rm[:, None] * (K // 16) + rg[None, :]
    if MODE == 3:
        w0 = tl.xor_sum(lo.to(tl.int16, bitcast=True).to(tl.int32), axis=2)
        w1 = tl.xor_sum(hi.to(tl.int16, bitcast=True).to(tl.int32), axis=2)
        tl.store(words, w0, mask=mask)
        tl.store(words + 1, w1, mask=mask)
        tl.store(sptr, w0.to(tl.uint8), mask=mask)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7 = tk._split8(tk._f32_pairs(lo), BM, G)
        x8, x9, x10, x11, x12, x13, x14, x15 = tk._split8(tk._f32_pairs(hi), BM, G)
        if MODE == 6 or MODE == 8:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, bamax = tk._transform_and_amax(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, amax_ptr, amax_ptr, True,
                True, False, True)
        elif MODE >= 9:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16_round_alone(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
            bamax = tk._amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        else:
            if MODE != 2:
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = tk._rht16(
                    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, True, MODE != 4)
            bamax = tk._amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        if MODE == 7 or MODE == 8 or MODE >= 10:
            s_dec, enc = _block_scales_rcp(bamax, tk._encode_scale(amax_ptr, 2688.0))
        else:
            s_dec, enc = tk._block_scales(bamax, tk._encode_scale(amax_ptr, 2688.0))
        if MODE == 1:
            w0 = _xor8(x0, x1, x2, x3, x4, x5, x6, x7)
            w1 = _xor8(x8, x9, x10, x11, x12, x13, x14, x15) ^ enc.to(tl.int32, bitcast=True)
        elif MODE == 11 or MODE == 13:
            w0 = _word_imad(x0, x1, x2, x3, x4, x5, x6, x7, enc, sixteen)
            w1 = _word_imad(x8, x9, x10, x11, x12, x13, x14, x15, enc, sixteen)
        elif MODE == 5 or MODE == 8:
            w0 = _word_split_sign(x0, x1, x2, x3, x4, x5, x6, x7, enc)
            w1 = _word_split_sign(x8, x9, x10, x11, x12, x13, x14, x15, enc)
        else:
            w0 = tk._word(x0, x1, x2, x3, x4, x5, x6, x7, enc)
            w1 = tk._word(x8, x9, x10, x11, x12, x13, x14, x15, enc)
        if MODE >= 12:
            joined = (w1.to(tl.int64) << 32) | (w0.to(tl.int64) & 0xFFFFFFFF)
            tl.store((codes_ptr.to(tl.pointer_type(tl.int64))) + rm[:, None] * (K // 16) + rg[None, :], joined,
                     mask=mask)
        else:
            tl.store(words, w0, mask=mask)
            tl.store(words + 1, w1, mask=mask)
        tl.store(sptr, s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _variant_kernel(x_ptr, sxm, M, K, amax_ptr, codes_ptr, scales_ptr, sixteen, BM: tl.constexpr, G: tl.constexpr,
                    MODE: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BM
    lo, hi = _load(x_ptr, sxm, M, K, row0, BM, G)
    _compute_store(lo, hi, M, K, amax_ptr, codes_ptr, scales_ptr, row0, BM, G, MODE, sixteen)


@triton.jit
def _loop_kernel(x_ptr, sxm, M, K, amax_ptr, codes_ptr, scales_ptr, BM: tl.constexpr, G: tl.constexpr,
                 ITERS: tl.constexpr):
    """ITERS row tiles per program; the next tile's loads are issued before this one's arithmetic, so
    they stay in flight in registers (no shared memory, no cp.async)."""
    row0 = tl.program_id(0).to(tl.int64) * (BM * ITERS)
    lo, hi = _load(x_ptr, sxm, M, K, row0, BM, G)
    for i in tl.range(ITERS, num_stages=1):
        # rows past this program's last are masked off: they are the next program's
        nlo, nhi = _load(x_ptr, sxm, tl.minimum(M, row0 + BM * ITERS), K, row0 + (i + 1) * BM, BM, G)
        _compute_store(lo, hi, M, K, amax_ptr, codes_ptr, scales_ptr, row0 + i * BM, BM, G, 0)  # FULL
        lo, hi = nlo, nhi


@triton.jit
def _rht_codes_tile(lo, hi, s_enc, inv_enc, M, K, codes_ptr, scales_ptr, row0, BM: tl.constexpr, G: tl.constexpr,
                    SPLIT: tl.constexpr):
    """The full RHT codes path of one tile, S_enc and 1 / S_enc given, block reciprocals by rcp.rn."""
    rm = row0 + tl.arange(0, BM)
    rg = tl.program_id(1).to(tl.int64) * G + tl.arange(0, G)
    mask = (rm[:, None] < M) & (rg[None, :] < K // 16)
    x0, x1, x2, x3, x4, x5, x6, x7 = tk._split8(tk._f32_pairs(lo), BM, G)
    x8, x9, x10, x11, x12, x13, x14, x15 = tk._split8(tk._f32_pairs(hi), BM, G)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = tk._rht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, True, True)
    bamax = tk._amax16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    s_dec = tk._round_e4m3(tl.minimum(bamax * (s_enc * (1.0 / 6.0)), 448.0))
    enc = tl.minimum(_rcp_rn(s_dec * inv_enc), 3.4028234663852886e38)
    if SPLIT:
        w0 = _word_split_sign(x0, x1, x2, x3, x4, x5, x6, x7, enc)
        w1 = _word_split_sign(x8, x9, x10, x11, x12, x13, x14, x15, enc)
    else:
        w0 = tk._word(x0, x1, x2, x3, x4, x5, x6, x7, enc)
        w1 = tk._word(x8, x9, x10, x11, x12, x13, x14, x15, enc)
    words = codes_ptr + rm[:, None] * (K // 8) + rg[None, :] * 2
    tl.store(words, w0, mask=mask)
    tl.store(words + 1, w1, mask=mask)
    tl.store(scales_ptr + rm[:, None] * (K // 16) + rg[None, :], s_dec.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
             mask=mask)


@triton.jit
def _persistent_kernel(x_ptr, sxm, M, K, amax_ptr, codes_ptr, scales_ptr, BM: tl.constexpr, G: tl.constexpr,
                       PREFETCH: tl.constexpr, SPLIT: tl.constexpr):
    """A fixed grid of programs striding over the row tiles: S_enc and its reciprocal once per program,
    no tail of a last partial wave, and (PREFETCH) the next tile's loads issued before this one's
    arithmetic."""
    s_enc = tk._encode_scale(amax_ptr, 2688.0)
    inv_enc = tl.math.div_rn(1.0, s_enc)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    tiles = tl.cdiv(M, BM)
    lo, hi = _load(x_ptr, sxm, M, K, pid.to(tl.int64) * BM, BM, G)
    for i in tl.range(0, tl.cdiv(tiles - pid, step), num_stages=1):
        row0 = (pid + i * step).to(tl.int64) * BM
        if PREFETCH:
            nlo, nhi = _load(x_ptr, sxm, M, K, row0 + step * BM, BM, G)
        else:
            lo, hi = _load(x_ptr, sxm, M, K, row0, BM, G)
        _rht_codes_tile(lo, hi, s_enc, inv_enc, M, K, codes_ptr, scales_ptr, row0, BM, G, SPLIT)
        if PREFETCH:
            lo, hi = nlo, nhi


def run(x, amax, codes, scales, bm, g, warps, mode=None, iters=None, maxnreg=None, persistent=None):
    """persistent: (programs per SM, prefetch, split signs) for _persistent_kernel."""
    m, k = x.shape
    opts = dict(num_warps=warps, enable_fp_fusion=False)
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    if persistent is not None:
        per_sm, prefetch, split = persistent
        grid = (min(triton.cdiv(m, bm), per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count),
                triton.cdiv(k // 16, g))
        _persistent_kernel[grid](x, x.stride(0), m, k, amax, codes, scales, BM=bm, G=g, PREFETCH=prefetch,
                                 SPLIT=split, **opts)
    elif iters is None:
        grid = (triton.cdiv(m, bm), triton.cdiv(k // 16, g))
        _variant_kernel[grid](x, x.stride(0), m, k, amax, codes, scales, 16, BM=bm, G=g, MODE=mode, **opts)
    else:
        grid = (triton.cdiv(m, bm * iters), triton.cdiv(k // 16, g))
        _loop_kernel[grid](x, x.stride(0), m, k, amax, codes, scales, BM=bm, G=g, ITERS=iters, **opts)


def variants() -> list[tuple[str, tuple, bool]]:
    """(name, run's arguments after scales, whether it computes the real codes)."""
    rows = [(f"{name}, 1x512 8 warps", (1, 512, 8, mode), mode in EXACT) for name, mode in MODES.items()]
    for per_sm in (3, 4):
        for prefetch in (False, True):
            for split in (False, True):
                rows.append((f"persistent {per_sm}/SM, prefetch {prefetch}, split signs {split}, rcp.rn, 1x512 8 warps",
                             (1, 512, 8, None, None, None, (per_sm, prefetch, split)), True))
    rows.append(("persistent 8/SM, rcp.rn, 1x256 4 warps", (1, 256, 4, None, None, None,
                                                                           (8, False, False)), True))
    rows.append(("persistent 8/SM, prefetch, rcp.rn, 1x256 4 warps", (1, 256, 4, None, None, None, (8, True, False)),
                 True))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="launch each variant twice, untimed (for ncu)")
    ap.add_argument("--modes", type=int, nargs="*", help="only these modes of _variant_kernel (and the library)")
    ap.add_argument("--rounds", type=int, default=1, help="time the rows this many times, interleaved")
    args = ap.parse_args()
    n = 8192
    torch.manual_seed(0)
    xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    amax = tk.global_amax(xs[0], True)
    ref = tk.quantize(xs[0], rht=True, amax=amax)
    codes = torch.empty(n, n // 8, dtype=torch.int32, device="cuda")
    scales = torch.empty(n, n // 16, dtype=torch.uint8, device="cuda")
    moved = 2 * n * n + n * n // 2 + n * n // 16
    rows = [r for r in variants() if args.modes is None or (len(r[1]) == 4 and r[1][3] in args.modes)]
    if args.profile:
        for _, params, _ in rows:
            for _ in range(2):
                run(xs[0], amax, codes, scales, *params)
        torch.cuda.synchronize()
        return
    print(f"# {torch.cuda.get_device_name()}, triton {triton.__version__}, {n}x{n} bf16, amax given; library tile "
          f"{tk.BLOCK_TILES['codes_rht']}")
    print(f"| variant | graph ms | of {REFERENCE_COPY_TBS} TB/s | bits equal |")
    print("|---|---|---|---|")
    equal = {}
    for name, params, exact in rows:
        if exact:
            codes.fill_(-1)
            scales.fill_(255)
            run(xs[0], amax, codes, scales, *params)
            equal[name] = str(torch.equal(codes.view(torch.uint8), ref.codes)
                              and torch.equal(scales, ref.scales.view(torch.uint8)))
    calls = [("library", lambda x: tk.quantize(x, rht=True, amax=amax))]
    calls += [(name, lambda x, params=params: run(x, amax, codes, scales, *params)) for name, params, _ in rows]
    for r in range(args.rounds):
        for name, fn in calls if r % 2 == 0 else calls[::-1]:
            t = graph_ms(fn, xs)
            print(f"| {name} | {t:.4f} | {moved / t / 1e9 / REFERENCE_COPY_TBS:.0%} | {equal.get(name, '-')} |")


if __name__ == "__main__":
    main()
