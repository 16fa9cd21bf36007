"""The per-token FP8 quantization of an activation in one Triton kernel (see ``quant/fp8.py``): one
program per row reads it once for its amax and again (from cache) to scale, round and store E4M3.
The division is IEEE-rounded, as torch's, so the codes equal ``quantize_rows_torch``'s."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from longlive_core.quant.fp8 import E4M3_MAX, TINY


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(tl.float8e4nv), mask=offs < K)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert E4M3_MAX == 448.0 and TINY == 1e-12  # the kernel's constants
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=1024, num_warps=4)
    return q, s
