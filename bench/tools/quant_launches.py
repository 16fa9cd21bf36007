"""The block kernel's three launches and the training path's transposed RHT partial on an 8192x8192
bf16 tensor, two rounds (the first compiles), for Nsight Compute to read on the lent H200 (used by
bench/tools/ncu_quant.sh), e.g. the RHT codes kernel with the amax given (the 6th block-kernel
launch: round one's amaxes, codes and RHT codes first):

    ncu --clock-control none --set full -k regex:_block_kernel --launch-skip 5 --launch-count 1 \
        python3 bench/tools/quant_launches.py

Launch order per round: the block kernel's amax pass (both maxima), its plain codes and its RHT
codes (amax given), then the transposed RHT partial (its amax pass, then the slice kernel).
"""
import torch

from longlive_core.quant import triton_kernels
from longlive_core.quant.gemm import quantize_partial

torch.manual_seed(0)
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(2):  # the first round compiles
    amax, amax_rht = triton_kernels.amaxes(x)  # block kernel, AMAX_ONLY
    triton_kernels.quantize(x, amax=amax)  # block kernel, plain codes
    triton_kernels.quantize(x, rht=True, amax=amax_rht)  # block kernel, RHT codes
    quantize_partial(x.t(), rht=True, stochastic=True)  # slice kernel (its amax pass is a slice launch too)
torch.cuda.synchronize()
