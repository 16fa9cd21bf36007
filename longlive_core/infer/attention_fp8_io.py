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

A chunk's passes (its denoising steps and the write at t = 0) read one window of cached keys and values:
``FP8Window`` keeps that window in E4M3 from the chunk's first pass, and a later pass quantizes only the
chunk's own rows into it (``placed_e4m3``, one launch a tensor), with the first pass's means and descales.
Any mean serves: softmax ignores a shift every key shares, and V's is added back to the output. The
descale is ``HEADROOM`` times the first pass's: own rows of a later pass beyond it saturate at +-448.
"""
from __future__ import annotations

import dataclasses

import torch

from longlive_core.quant.fp8 import E4M3_MAX, TINY, e4m3_codes_torch

# a kept window's descale over its first pass's amax / 448: one binade for the own rows of the later passes.
# Its cost: values below amax / 14,336 (2^-6 of the doubled descale) turn subnormal, a binade early, and
# so do the output's (cuDNN's O is scaled by V's descale: attention_cudnn_fp8.O_HEADROOM).
HEADROOM = 2.0
ROWS_PER_SPLIT = 256  # tokens one statistics program reads: 110 programs per head over a 28,160-key window
BLOCK_L = 32  # tokens per tile


def per_tensor_e4m3_torch(x: torch.Tensor, mean: torch.Tensor | None = None, headroom: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes in x's shape, contiguous; float32 descale (1, 1, 1, 1)) with x - mean ~ codes x descale,
    in float32 (``mean``: (B, H, 1, D) or None); the descale is ``headroom`` times amax / 448."""
    shifted = x.float() if mean is None else x.float() - mean
    descale = (shifted.abs().amax() / E4M3_MAX).clamp(min=TINY).view(1, 1, 1, 1) * headroom
    return e4m3_codes_torch(shifted, descale).contiguous(), descale


def dequantized_output_torch(o8: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
                             ) -> torch.Tensor:
    """o8 x scale + offset in float32, then ``dtype``."""
    return (o8.float() * scale + offset).to(dtype)


def _on_triton(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from longlive_core.quant import triton_kernels

    return triton_kernels.available()


def smoothed_e4m3_torch(x: torch.Tensor, smooth: bool, headroom: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A (B, H, L, D) tensor in E4M3 with one float32 descale (``headroom`` x amax / 448), less its mean over
    L per head and channel where ``smooth``: (codes (B, H, L, D) contiguous, descale (1, 1, 1, 1), the
    float32 mean (B, H, 1, D) or None), by torch's passes."""
    mean = x.float().mean(dim=2, keepdim=True) if smooth else None
    return (*per_tensor_e4m3_torch(x, mean, headroom), mean)


def smoothed_e4m3(x: torch.Tensor, smooth: bool, headroom: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``smoothed_e4m3_torch``'s result; on CUDA from Triton (the means summed in another order)."""
    if _on_triton(x):
        return triton_smoothed_e4m3(x, smooth, headroom)
    return smoothed_e4m3_torch(x, smooth, headroom)


def placed_e4m3_torch(x: torch.Tensor, mean: torch.Tensor, descale: torch.Tensor, out: torch.Tensor, row0: int
                      ) -> None:
    """(x - mean) / descale in E4M3 into rows [row0, row0 + L) of ``out`` (B, H, T, D), by torch's passes."""
    out[:, :, row0:row0 + x.shape[2]] = e4m3_codes_torch(x.float() - mean, descale)


def placed_e4m3(x: torch.Tensor, mean: torch.Tensor, descale: torch.Tensor, out: torch.Tensor, row0: int) -> None:
    """``placed_e4m3_torch``'s codes; on CUDA from one Triton launch (``out`` contiguous): the same bits."""
    if _on_triton(x):
        triton_placed_e4m3(x, mean, descale, out, row0)
    else:
        placed_e4m3_torch(x, mean, descale, out, row0)


@dataclasses.dataclass(frozen=True)
class FP8Window:
    """One layer's [cached keys and values; a chunk's own] in E4M3 as cuDNN's FP8 SDPA reads them (K and V
    smoothed, one descale each), kept across the chunk's passes: the cached rows' codes stay, and each later
    pass writes its own rows' codes after them (``place``). What a pass attends to is exact to E4M3; only
    the scales were chosen on the first pass."""

    k8: torch.Tensor  # (B, H, N + M, D) contiguous E4M3: N cached rows, then the chunk's own M
    v8: torch.Tensor
    descale_k: torch.Tensor  # float32 (1, 1, 1, 1)
    descale_v: torch.Tensor
    k_mean: torch.Tensor  # float32 (B, H, 1, D)
    v_mean: torch.Tensor  # float32 (B, H, 1, D): added back to the output
    cached: int  # N

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, own: int, headroom: float = HEADROOM) -> FP8Window:
        """The window [cached; own] of (B, H, N + M, D) ``k`` and ``v`` whose last ``own`` rows are the
        chunk's: its means and ``headroom`` x its amax / 448 as the scales (1: a window for this pass only)."""
        k8, descale_k, k_mean = smoothed_e4m3(k, smooth=True, headroom=headroom)
        v8, descale_v, v_mean = smoothed_e4m3(v, smooth=True, headroom=headroom)
        return cls(k8, v8, descale_k, descale_v, k_mean, v_mean, k.shape[2] - own)

    def fits(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a chunk's own ``k`` and ``v`` (B, H, M, D) take the place of the first pass's."""
        own = (*self.k8.shape[:2], self.k8.shape[2] - self.cached)
        return (tuple(k.shape[:3]) == own == tuple(v.shape[:3]) and k.shape[3] == self.k8.shape[3]
                and v.shape[3] == self.v8.shape[3] and k.device == v.device == self.k8.device)

    def place(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A later pass's own keys and values into the rows after the cached ones (``fits`` first)."""
        placed_e4m3(k, self.k_mean, self.descale_k, self.k8, self.cached)
        placed_e4m3(v, self.v_mean, self.descale_v, self.v8, self.cached)


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
    def _quantize_shifted(x_ptr, mean_ptr, descale_ptr, q_ptr, H, L, sxb, sxh, sxl, out_rows, row0,
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
        out = (bh.to(tl.int64) * out_rows + row0 + rows[:, None]) * D + d[None, :]
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


def triton_smoothed_e4m3(x: torch.Tensor, smooth: bool, headroom: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
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
    descale = (amax / E4M3_MAX).clamp(min=TINY).view(1, 1, 1, 1) * headroom
    codes = torch.empty((b, h, length, d), dtype=torch.float8_e4m3fn, device=x.device)
    _quantize_shifted[(b * h, triton.cdiv(length, BLOCK_L))](  # unsmoothed, the mean's pointer is never read
        x, mean if smooth else descale, descale, codes, h, length, x.stride(0), x.stride(1), x.stride(2),
        length, 0, D=d, D_PAD=_pad(d), BLOCK=BLOCK_L, SMOOTH=smooth)
    return codes, descale, None if mean is None else mean.view(b, h, 1, d)


def triton_placed_e4m3(x: torch.Tensor, mean: torch.Tensor, descale: torch.Tensor, out: torch.Tensor, row0: int
                       ) -> None:
    """``placed_e4m3`` by the Triton kernel: ``mean`` (B, H, 1, D) float32 and ``out`` contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, length, d = x.shape
    if not (out.is_contiguous() and out.shape[:2] == x.shape[:2] and out.shape[3] == d
            and row0 >= 0 and row0 + length <= out.shape[2]):
        raise ValueError(f"rows {row0}..{row0 + length} of {tuple(x.shape)} do not fit a contiguous "
                         f"{tuple(out.shape)}")
    if tuple(mean.shape) != (b, h, 1, d):
        raise ValueError(f"the mean must be ({b}, {h}, 1, {d}); got {tuple(mean.shape)}")
    if length:
        _quantize_shifted[(b * h, triton.cdiv(length, BLOCK_L))](
            x, mean.float().contiguous(), descale, out, h, length, x.stride(0), x.stride(1), x.stride(2),
            out.shape[2], row0, D=d, D_PAD=_pad(d), BLOCK=BLOCK_L, SMOOTH=True)


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
