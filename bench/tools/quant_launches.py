"""A few NVFP4 quantize launches on an 8192x8192 bf16 tensor, for a profiler to read:

    ncu --clock-control none -k regex:kernel --launch-skip 4 --launch-count 4 python3 bench/tools/quant_launches.py
"""
import torch

from longlive_core.quant import triton_kernels
from longlive_core.quant.gemm import quantize_partial

x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
amax = triton_kernels.global_amax(x, False)
amax_rht = triton_kernels.global_amax(x, True)
for _ in range(2):  # the first round compiles
    triton_kernels.quantize(x, amax=amax)  # row-tile, codes
    triton_kernels.quantize(x, rht=True, amax=amax_rht)  # slice kernel, codes, contiguous rows
    quantize_partial(x)  # row-tile, partial (includes an amax pass: a zero fill and _absmax_kernel)
    quantize_partial(x.t(), rht=True, stochastic=True)  # slice, transposed (includes the RHT amax pass)
torch.cuda.synchronize()
