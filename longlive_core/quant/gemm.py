"""The emulated NVFP4 GEMM: E2M1 values times their E4M3 block scales (exact in bfloat16), a
bfloat16 matmul accumulating in float32, then both tensors' global decode scales on the float32
result. That equals a real NVFP4 GEMM up to accumulation order, and runs on any device (on CUDA as
one cuBLASLt call with the decode scales as its device-side alpha, see :mod:`.cublas`)."""
from __future__ import annotations

import torch

from longlive_core.quant import cublas
from longlive_core.quant.hadamard import rht as apply_rht
from longlive_core.quant.nvfp4 import BLOCK, Backend, check_input, default_backend, float32_scalar, quantize_torch


def quantize_partial(x: torch.Tensor, tile: tuple[int, int] = (1, BLOCK), rht: bool = False,
                     stochastic: bool = False, generator: torch.Generator | None = None,
                     four_over_six: str | None = None, backend: Backend = None,
                     amax: torch.Tensor | None = None,
                     times: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantizes ``x`` (2-D, blocks along its last axis) and returns (q * S_dec in bfloat16,
    1 / S_enc as a float32 scalar): the operand and the decode scale an emulated GEMM needs.
    ``amax``: x's global amax (after the RHT when rht) if already known; saves a pass over x.
    ``times``: the other GEMM operand's decode scale (a float32 scalar on x's device); the second
    result is then the product, the GEMM's alpha, as ``emulated_mm(..., b_decode=None)`` takes it
    (the Triton kernel writes it, sparing the host a multiply per GEMM)."""
    backend = backend or default_backend(x)
    if backend == "triton":
        if generator is not None:  # an operator cannot take a generator; tests pass one, training does not
            from longlive_core.quant import triton_kernels
            return triton_kernels.quantize_partial(x, tile, rht, stochastic, four_over_six, generator, amax, times)
        amax, times = (None if v is None else float32_scalar(v, x.device) for v in (amax, times))
        return triton_partial(x, list(tile), rht, stochastic, four_over_six, amax, times)
    q = quantize_torch(x.contiguous(), tile, rht, stochastic, four_over_six, generator, amax)
    m, k = q.shape
    part = (q.values().view(m, k // BLOCK, BLOCK) * q.scales.float()[..., None]).view(m, k)
    s_enc = q.encode_scale
    dec = (torch.ones_like(s_enc) / s_enc).reshape(())
    return part.to(torch.bfloat16), dec if times is None else dec * float32_scalar(times, dec.device)


def operand_amaxes(x: torch.Tensor, backend: Backend = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, max |RHT(x)|) as float32 scalars, blocks along x's last axis: the global amaxes of
    a tensor that is quantized both plainly and after the RHT (one pass over x on the Triton path)."""
    backend = backend or default_backend(x)
    if backend == "triton":
        return triton_amaxes(x).unbind()
    check_input(x, (1, BLOCK))
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero.clone()
    return x.abs().amax().float(), apply_rht(x).float().abs().amax()


def emulated_mm(a: torch.Tensor, a_decode: torch.Tensor, b: torch.Tensor, b_decode: torch.Tensor | None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """((a @ b) * (a_decode * b_decode) + bias).to(out_dtype), a (M, K) and b (K, N) partial operands,
    bias an (N,) vector; the product and the scaling in float32, in that order. ``b_decode`` None:
    ``a_decode`` is the product already (``quantize_partial(..., times=...)``). The bias is first cast
    to out_dtype (as autocast and Transformer Engine cast it to the activations' dtype), then added
    in float32. On CUDA one cuBLASLt GEMM applies the decode scales as its device-side alpha and adds
    the bias in its epilogue before rounding, as a real NVFP4 GEMM does: the result equals the float32
    product's up to accumulation order and a fused multiply-add."""
    alpha = float32_scalar(a_decode, a.device)
    if b_decode is not None:
        alpha = alpha * float32_scalar(b_decode, a.device)
    if bias is not None:
        if bias.shape != (b.shape[-1],) or bias.device != a.device:
            raise ValueError(f"emulated_mm's bias must be a ({b.shape[-1]},) vector on {a.device}, one value per "
                             f"output column; got {tuple(bias.shape)} on {bias.device}")
        bias = bias.to(out_dtype)
    return scaled_product(a, b, alpha, out_dtype, bias)


@torch.library.custom_op("longlive::scaled_product", mutates_args=())
def scaled_product(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``emulated_mm``'s product as one operator, so that a compiled graph calls it as it is (the
    ctypes cuBLASLt call reads data pointers, which tracing cannot: a graph break, and a checkpointed
    block with a graph break runs eagerly), and so that activation checkpointing's policies and the
    budget planner's profile see it: one op whose output can be kept and whose time is counted."""
    if cublas.supported(a, b, out_dtype):
        return cublas.scaled_mm_unchecked(a, b, alpha, out_dtype, bias)
    # the CPU has no bf16 -> fp32 mm; there the operands go to float32, where they are exact too
    acc = torch.mm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.mm(a.float(), b.float())
    out = acc * alpha
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@scaled_product.register_fake
def _(a, b, alpha, out_dtype, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# The Triton quantize launches as operators, for the reason ``scaled_product`` is one: a compiled
# checkpointed block calls them as they are (on the H200 a block with them inline was not traced at
# all: torch._dynamo.explain gave no graph) and the checkpointing policies see their outputs.
@torch.library.custom_op("longlive::triton_partial", mutates_args=())
def triton_partial(x: torch.Tensor, tile: list[int], rht: bool, stochastic: bool, four_over_six: str | None,
                   amax: torch.Tensor | None, times: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_partial``'s Triton path (stochastic rounding from the device's default generator)."""
    from longlive_core.quant import triton_kernels
    return triton_kernels.quantize_partial(x, tuple(tile), rht, stochastic, four_over_six, None, amax, times)


@triton_partial.register_fake
def _(x, tile, rht, stochastic, four_over_six, amax, times):
    return torch.empty_like(x, dtype=torch.bfloat16), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("longlive::triton_amaxes", mutates_args=())
def triton_amaxes(x: torch.Tensor) -> torch.Tensor:
    """``operand_amaxes``' Triton path: (max |x|, max |RHT(x)|) as one float32 pair."""
    from longlive_core.quant import triton_kernels
    return torch.stack(triton_kernels.amaxes(x))


@triton_amaxes.register_fake
def _(x):
    return x.new_empty((2,), dtype=torch.float32)
