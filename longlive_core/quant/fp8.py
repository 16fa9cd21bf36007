"""FP8 W8A8 linear layers for inference on Hopper, where FP4 tensor cores are missing.

Weights and activations in E4M3 with one FP32 scale per row (per output channel for the weight, per
token for the activation: amax / 448), multiplied by ``torch._scaled_mm`` with row-wise scales and
BF16 output on CUDA (on the CPU, the same products in float32, rounded to BF16 as the GPU's are).
REFERENCE.md §7: the GEMM alone is 1.56-1.78x BF16's on the H200, and an eager torch quantization of
the activation eats it all, so on CUDA the activation is quantized by one Triton kernel that reads
each row once for its amax and once to scale and cast (the row stays in cache). The weight is
quantized once, at conversion, and held in FP8 with no BF16 copy. Inference only: nothing here has
a backward.
"""
from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = 448.0
TINY = 1e-12  # an all-zero row gets a scale that divides safely and multiplies back to zero


def e4m3_codes_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` over ``scale`` (broadcast), saturated at +-448, rounded to E4M3: the one rounding every
    torch path here and each Triton kernel's reference use."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (E4M3 codes (M, K), float32 scales (M, 1)): x ~ codes * scale."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=TINY)
    return e4m3_codes_torch(x.float(), scale), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_torch``'s result; on CUDA from one Triton kernel."""
    if not x.is_cuda:
        return quantize_rows_torch(x)
    from longlive_core.quant.fp8_kernel import quantize_rows_triton

    return quantize_rows_triton(x)


class FP8Linear(nn.Module):
    """A frozen ``nn.Linear`` as E4M3 weight codes with per-output-channel scales; the input is
    quantized per token at every call. The state dict holds the codes, the scales and the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                       device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> FP8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device, dtype)
        with torch.no_grad():
            codes, scale = quantize_rows_torch(linear.weight.detach())
            layer.weight_fp8.copy_(codes)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach().to(dtype))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        codes, scale = quantize_rows(x.reshape(-1, self.in_features))
        if x.is_cuda:
            y = torch._scaled_mm(codes, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale.t(),
                                 bias=self.bias, out_dtype=torch.bfloat16, use_fast_accum=True)
        else:  # the same products in float32 (torch 2.11 has no CPU _scaled_mm): for tests and CPU runs
            y = (codes.float() * scale) @ (self.weight_fp8.float() * self.weight_scale).t()
            y = (y if self.bias is None else y + self.bias.float()).to(torch.bfloat16)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 row-wise"
