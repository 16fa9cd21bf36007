"""A few NVFP4 quantize launches on an 8192x8192 bf16 tensor, for a profiler to read (ncu)."""
import torch

from longlive_core.quant import triton_kernels
from longlive_core.quant.gemm import quantize_partial

x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
amax = triton_kernels.global_amax(x, False)
for _ in range(2):  # the first launch compiles
    triton_kernels.quantize(x, amax=amax)
    quantize_partial(x)
    quantize_partial(x.t(), rht=True, stochastic=True)
torch.cuda.synchronize()
