"""The passes around cuDNN's FP8 attention kernel (``attention_cudnn_fp8``): Q, K and V into E4M3 with one
float32 scale per tensor, K and V first smoothed by their mean over the tokens (per head and channel), and
the kernel's E4M3 output back to the input's dtype with V's mean added back.

Done by torch these are a dozen passes over float32 copies: on the H200, for one chunk over the paper's
window, 3.3 ms of cuDNN FP8 attention's 5.9, where the kernel alone takes 2.6 (bench/attention_kernels.py
at e744ce6). On CUDA, Triton does each input in two launches: one reads the tensor for every channel's
sum, minimum and maximum (in slices of the tokens, in parallel), one reads it again and writes the codes;
one more launch dequantizes the output. The per-tensor amax comes from the channels' extremes: for a
fixed mean, float32 subtraction keeps the order of the values, so the largest |x - mean| is at a
channel's minimum or maximum, exactly as the torch path finds it. Given the same means, the codes, the
scales and the output equal the torch path's bit for bit; the means are float32 sums in another order.
"""
from __future__ import annotations

import torch

from longlive_core.quant.fp8 import E4M3_MAX, TINY, quantize_rows_torch

ROWS_PER_SPLIT = 256  # tokens one statistics program reads: 110 programs per head over a 28,160-key window
BLOCK_L = 32  # tokens per tile


def per_tensor_e4m3_torch(x: torch.Tensor, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes in x's shape, contiguous; float32 descale (1, 1, 1, 1)) with x - mean ~ codes x descale,
    in float32 (``mean``: (B, H, 1, D) or None)."""
    shifted = x.float() if mean is None else x.float() - mean
    codes, descale = quantize_rows_torch(shifted.reshape(1, -1))
    return codes.view(x.shape), descale.view(1, 1, 1, 1)


def dequantized_output_torch(o8: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
                             ) -> torch.Tensor:
    """o8 x scale + offset in float32, then ``dtype``."""
    return (o8.float() * scale + offset).to(dtype)


def _on_triton(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from longlive_core.quant import triton_kernels

    return triton_kernels.available()


def smoothed_e4m3_torch(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A (B, H, L, D) tensor in E4M3 with one float32 descale, less its mean over L per head and channel
    where ``smooth``: (codes (B, H, L, D) contiguous, descale (1, 1, 1, 1), the float32 mean (B, H, 1, D)
    or None), by torch's passes."""
    mean = x.float().mean(dim=2, keepdim=True) if smooth else None
    return (*per_tensor_e4m3_torch(x, mean), mean)


def smoothed_e4m3(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``smoothed_e4m3_torch``'s result; on CUDA from Triton (the means summed in another order)."""
    if _on_triton(x):
        return triton_smoothed_e4m3(x, smooth)
    return smoothed_e4m3_torch(x, smooth)


def dequantized_output(o8: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
                       ) -> torch.Tensor:
    """``dequantized_output_torch``'s result; on CUDA from one Triton launch. ``o8``: (B, H, L, D)
    contiguous E4M3; ``scale``: one float32 element; ``offset``: (B, H, 1, D) float32."""
    if _on_triton(o8):
        return triton_dequantized_output(o8, scale, offset, dtype)
    return dequantized_output_torch(o8, scale, offset, dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path above needs no Triton
    triton = None

if triton is not None:
    from longlive_core.quant.triton_kernels import _HW_ROUND, _f32, _round_bf16, _round_e4m3

    @triton.jit
    def _channel_stats(x_ptr, sum_ptr, min_ptr, max_ptr, H, L, sxb, sxh, sxl,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        base = x_ptr + (bh // H).to(tl.int64) * sxb + (bh % H).to(tl.int64) * sxh
        d = tl.arange(0, D_PAD)
        in_d = d < D
        total = tl.zeros([D_PAD], dtype=tl.float32)
        lo = tl.full([D_PAD], float("inf"), dtype=tl.float32)
        hi = tl.full([D_PAD], float("-inf"), dtype=tl.float32)
        for r0 in range(0, ROWS, BLOCK):  # a constant trip count: ROWS tokens from the split's first
            rows = split * ROWS + r0 + tl.arange(0, BLOCK)
            valid = (rows < L)[:, None] & in_d[None, :]
            tile = _f32(tl.load(base + rows[:, None].to(tl.int64) * sxl + d[None, :], mask=valid, other=0.0))
            total += tl.sum(tile, axis=0)
            lo = tl.minimum(lo, tl.min(tl.where(valid, tile, float("inf")), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(valid, tile, float("-inf")), axis=0))
        out = (bh * tl.num_programs(1) + split).to(tl.int64) * D + d
        tl.store(sum_ptr + out, total, mask=in_d)
        tl.store(min_ptr + out, lo, mask=in_d)
        tl.store(max_ptr + out, hi, mask=in_d)

    @triton.jit
    def _quantize_shifted(x_ptr, mean_ptr, descale_ptr, q_ptr, H, L, sxb, sxh, sxl,
                          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, SMOOTH: tl.constexpr):
        bh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, D_PAD)
        valid = (rows < L)[:, None] & (d < D)[None, :]
        base = x_ptr + (bh // H).to(tl.int64) * sxb + (bh % H).to(tl.int64) * sxh
        x = _f32(tl.load(base + rows[:, None].to(tl.int64) * sxl + d[None, :], mask=valid, other=0.0))
        if SMOOTH:
            x = x - tl.load(mean_ptr + bh * D + d, mask=d < D, other=0.0)[None, :]
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.load(descale_ptr)), -448.0), 448.0)
        if not _HW_ROUND:  # rounded here: the interpreter's cast truncates. A product, not Triton's unary
            # minus (0 - x): a negative value that rounds to zero keeps its sign, as torch's cast and the GPU's do
            q = tl.where(q < 0, -1.0, 1.0) * _round_e4m3(tl.abs(q))
        out = (bh.to(tl.int64) * L + rows[:, None]) * D + d[None, :]
        tl.store(q_ptr + out, q.to(tl.float8e4nv), mask=valid)

    @triton.jit
    def _dequantize(o_ptr, scale_ptr, offset_ptr, out_ptr, L, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK: tl.constexpr, BF16: tl.constexpr):
        bh = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, D_PAD)
        valid = (rows < L)[:, None] & (d < D)[None, :]
        at = (bh.to(tl.int64) * L + rows[:, None]) * D + d[None, :]
        o = tl.load(o_ptr + at, mask=valid, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        o = o + tl.load(offset_ptr + bh * D + d, mask=d < D, other=0.0)[None, :]
        if BF16:  # rounded here: the interpreter's cast truncates
            o = _round_bf16(o)
        tl.store(out_ptr + at, o.to(out_ptr.dtype.element_ty), mask=valid)


def _pad(d: int) -> int:
    return 1 << (d - 1).bit_length()


def triton_smoothed_e4m3(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``smoothed_e4m3`` by the Triton kernels (any device Triton runs on, its interpreter included)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, length, d = x.shape
    splits = max(1, triton.cdiv(length, ROWS_PER_SPLIT))
    stats = torch.empty((3, b * h, splits, d), dtype=torch.float32, device=x.device)
    _channel_stats[(b * h, splits)](x, stats[0], stats[1], stats[2], h, length, x.stride(0), x.stride(1),
                                    x.stride(2), D=d, D_PAD=_pad(d), BLOCK=BLOCK_L, ROWS=ROWS_PER_SPLIT)
    lo, hi = stats[1].amin(dim=1), stats[2].amax(dim=1)  # (B x H, D)
    if smooth:
        mean = stats[0].sum(dim=1) / length
        amax = torch.maximum(hi - mean, mean - lo).amax()
    else:
        mean = None
        amax = torch.maximum(hi.abs(), lo.abs()).amax()
    descale = (amax / E4M3_MAX).clamp(min=TINY).view(1, 1, 1, 1)
    codes = torch.empty((b, h, length, d), dtype=torch.float8_e4m3fn, device=x.device)
    _quantize_shifted[(b * h, triton.cdiv(length, BLOCK_L))](  # unsmoothed, the mean's pointer is never read
        x, mean if smooth else descale, descale, codes, h, length, x.stride(0), x.stride(1), x.stride(2),
        D=d, D_PAD=_pad(d), BLOCK=BLOCK_L, SMOOTH=smooth)
    return codes, descale, None if mean is None else mean.view(b, h, 1, d)


def triton_dequantized_output(o8: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
                              ) -> torch.Tensor:
    """``dequantized_output`` by the Triton kernel (contraction into a fused multiply-add off: torch rounds
    the product, then the sum)."""
    o8, offset = o8.contiguous(), offset.float().contiguous()
    b, h, length, d = o8.shape
    out = torch.empty(o8.shape, dtype=dtype, device=o8.device)
    _dequantize[(b * h, triton.cdiv(length, BLOCK_L))](o8, scale.float().contiguous(), offset, out, length, D=d,
                                                       D_PAD=_pad(d), BLOCK=BLOCK_L, BF16=dtype == torch.bfloat16,
                                                       enable_fp_fusion=False)
    return out
