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
from longlive_core.quant.linear import NVFP4Recipe, _amaxes_over_group
from longlive_core.quant.nvfp4 import BLOCK, NVFP4Tensor, quantize_nvfp4


def _weight_operand(codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, shape: tuple[int, int],
                    scale_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values x block scales in bfloat16, the decode scale 1 / S_enc): a GEMM's partial operand."""
    q = NVFP4Tensor(codes, scales, amax, shape, scale_max=scale_max)
    m, k = shape
    part = (q.values().view(m, k // BLOCK, BLOCK) * scales.float()[..., None]).view(m, k)
    return part.to(torch.bfloat16), (torch.ones_like(q.encode_scale) / q.encode_scale).reshape(())


class _PackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer: PackedNVFP4Linear):
        r, group = layer.recipe, layer.amax_group
        x2 = x.reshape(-1, x.shape[-1])
        wp, wd = layer.weight_operand()
        x_amax = _amaxes_over_group(x2, r, group)[0] if group is not None else None
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
        g_amax = _amaxes_over_group(g2, r, layer.amax_group)[0] if layer.amax_group is not None else None
        gp, alpha = quantize_partial(g2, (1, BLOCK), stochastic=r.grad_stochastic, backend=r.backend, amax=g_amax,
                                     times=wd)
        return emulated_mm(gp, alpha, wp, None, out_dtype=gy.dtype).view(ctx.x_shape), None


class PackedNVFP4Linear(nn.Linear):
    """An ``nn.Linear`` (so adapters such as peft's LoRA wrap it) whose frozen weight lives only as
    NVFP4 buffers ``weight_codes``, ``weight_scales``, ``weight_amax``; ``weight`` decodes it on
    demand (for inspection and merging, not for the forward)."""

    recipe: NVFP4Recipe
    amax_group: dist.ProcessGroup | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: NVFP4Recipe) -> PackedNVFP4Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.recipe, new.amax_group = recipe, None
        q = quantize_nvfp4(linear.weight.detach(), tile=recipe.weight_tile, four_over_six=recipe.four_over_six,
                           backend=recipe.backend)
        new.register_buffer("weight_codes", q.codes)
        new.register_buffer("weight_scales", q.scales)
        new.register_buffer("weight_amax", q.amax.reshape(()))
        new.scale_max = q.scale_max
        new.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        return new

    def weight_operand(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _weight_operand(self.weight_codes, self.weight_scales, self.weight_amax,
                               (self.out_features, self.in_features), self.scale_max)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        wp, wd = self.weight_operand()
        return wp.float() * wd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PackedFn.apply(x, self)

    def packed_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.weight_codes, self.weight_scales, self.weight_amax))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, packed NVFP4, recipe={self.recipe}"
