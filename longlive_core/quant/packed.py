"""A frozen linear layer held packed in NVFP4 (W4A4): the weight as E2M1 codes and E4M3 block scales,
no high-precision master. Distillation's frozen backbone runs on these (the generator and the fake
score add BF16 LoRA adapters on top), and so does the merged W4A4 model.

The forward equals :class:`~longlive_core.quant.linear.NVFP4Linear`'s on the weight the codes came
from: the input quantized in 1x16 blocks at run time (round to nearest), the weight's partial
operand decoded from the codes (exact in bfloat16), the emulated GEMM. The backward gives the input
gradient only (the weight is frozen), through an NVFP4 dgrad GEMM as training's. The decoded weight
is transient: it is decoded again in the backward rather than kept between the passes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longlive_core.quant.gemm import emulated_mm, quantize_partial
from longlive_core.quant.linear import NVFP4Recipe, amaxes_over_group
from longlive_core.quant.nvfp4 import BLOCK, decode_e2m1, quantize_nvfp4, unpack_codes


def weight_operand(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, shape: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values x block scales in bfloat16, exact; the decode scale 1 / S_enc): a GEMM's partial operand
    and its scale, from the packed codes, the E4M3 block scales and the encode scale S_enc."""
    m, k = shape
    values = decode_e2m1(unpack_codes(packed)).view(m, k // BLOCK, BLOCK)
    part = (values * scale.float()[..., None]).view(m, k)
    s_enc = global_scale.float().reshape(())
    return part.to(torch.bfloat16), torch.ones_like(s_enc) / s_enc


class _PackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer: PackedNVFP4Linear):
        r, group = layer.recipe, layer.amax_group
        x2 = x.reshape(-1, x.shape[-1])
        wp, wd = layer.weight_operand()
        x_amax = amaxes_over_group(x2, r, group)[0] if group is not None else None
        xp, alpha = quantize_partial(x2, (1, BLOCK), four_over_six=r.four_over_six, backend=r.backend, amax=x_amax,
                                     times=wd)
        y = emulated_mm(xp, alpha, wp.t(), None, layer.bias, x.dtype)
        ctx.layer, ctx.x_shape = layer, x.shape
        return y.view(*x.shape[:-1], wp.shape[0])

    @staticmethod
    def backward(ctx, gy):
        layer: PackedNVFP4Linear = ctx.layer
        r = layer.recipe
        g2 = gy.reshape(-1, gy.shape[-1])
        wp, wd = layer.weight_operand()
        g_amax = amaxes_over_group(g2, r, layer.amax_group)[0] if layer.amax_group is not None else None
        gp, alpha = quantize_partial(g2, (1, BLOCK), stochastic=r.grad_stochastic, backend=r.backend, amax=g_amax,
                                     times=wd)
        return emulated_mm(gp, alpha, wp, None, out_dtype=gy.dtype).view(ctx.x_shape), None


class PackedNVFP4Linear(nn.Linear):
    """An ``nn.Linear`` (so adapters such as peft's LoRA wrap it) whose frozen weight lives only as
    NVFP4 buffers, named as compressed-tensors names them: ``weight_packed`` (uint8, element 2i in
    the low nibble), ``weight_scale`` (E4M3, out x in/16) and ``weight_global_scale`` (float32 [1],
    the encode scale S_enc); ``weight`` decodes it on demand (for inspection and merging, not for
    the forward)."""

    recipe: NVFP4Recipe
    amax_group: dist.ProcessGroup | None = None

    @classmethod
    def from_packed(cls, in_features: int, out_features: int, packed: torch.Tensor, scale: torch.Tensor,
                    global_scale: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe) -> PackedNVFP4Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = in_features, out_features
        new.recipe, new.amax_group = recipe, None
        if packed.shape != (out_features, in_features // 2) or scale.shape != (out_features, in_features // BLOCK):
            raise ValueError(f"packed weight {tuple(packed.shape)} / scales {tuple(scale.shape)} do not fit a "
                             f"{out_features}x{in_features} layer")
        new.register_buffer("weight_packed", packed)
        new.register_buffer("weight_scale", scale)
        new.register_buffer("weight_global_scale", global_scale.float().reshape(1))
        new.register_buffer("bias", bias)
        return new

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: NVFP4Recipe) -> PackedNVFP4Linear:
        q = quantize_nvfp4(linear.weight.detach(), tile=recipe.weight_tile, four_over_six=recipe.four_over_six,
                           backend=recipe.backend)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_packed(linear.in_features, linear.out_features, q.codes, q.scales, q.encode_scale, bias,
                               recipe)

    def weight_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return weight_operand(self.weight_packed, self.weight_scale, self.weight_global_scale,
                              (self.out_features, self.in_features))

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return dequantize_packed(self.weight_packed, self.weight_scale, self.weight_global_scale,
                                 (self.out_features, self.in_features), torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PackedFn.apply(x, self)

    def packed_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.weight_packed, self.weight_scale,
                                                           self.weight_global_scale))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, packed NVFP4, recipe={self.recipe}"


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, shape: tuple[int, int],
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight the codes stand for, computed in compressed-tensors' order (values x (scale / S_enc)
    in float32, then ``dtype``), so its decompression of our file gives these numbers exactly."""
    m, k = shape
    values = decode_e2m1(unpack_codes(packed)).view(m, k // BLOCK, BLOCK)
    return (values * (scale.float() / global_scale.float().reshape(()))[..., None]).view(m, k).to(dtype)
