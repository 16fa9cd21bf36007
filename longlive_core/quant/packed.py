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
from longlive_core.quant.nvfp4 import BLOCK, Backend, decode_e2m1, default_backend, quantize_nvfp4, unpack_codes
from longlive_core.quant.nvfp4_decode import partial_operand


def weight_operand(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, shape: tuple[int, int],
                   backend: Backend = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values x block scales in bfloat16, exact; the decode scale 1 / S_enc): a GEMM's partial operand
    and its scale, from the packed codes, the E4M3 block scales and the encode scale S_enc. The Triton
    path (``nvfp4_decode.partial_operand``) gives the same bits in one kernel."""
    m, k = shape
    if (backend or default_backend(packed)) == "triton":
        part = partial_operand(packed, scale)
    else:
        values = decode_e2m1(unpack_codes(packed)).view(m, k // BLOCK, BLOCK)
        part = (values * scale.float()[..., None]).view(m, k).to(torch.bfloat16)
    s_enc = global_scale.float().reshape(())
    return part, torch.ones_like(s_enc) / s_enc


def _forward(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
             bias: torch.Tensor | None, four_over_six: str | None, backend: str | None,
             amax: torch.Tensor | None) -> torch.Tensor:
    """The W4A4 product: x quantized in 1x16 blocks (``amax``: its global amax where already known),
    times the weight decoded from its codes, through the emulated GEMM."""
    x2 = x.reshape(-1, x.shape[-1])
    wp, wd = weight_operand(packed, scale, global_scale, (packed.shape[0], packed.shape[1] * 2), backend)
    xp, alpha = quantize_partial(x2, (1, BLOCK), four_over_six=four_over_six, backend=backend, amax=amax, times=wd)
    return emulated_mm(xp, alpha, wp.t(), None, bias, x.dtype).view(*x.shape[:-1], wp.shape[0])


@torch.library.custom_op("longlive::packed_nvfp4_linear", mutates_args=())
def packed_nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                        bias: torch.Tensor | None, four_over_six: str | None, backend: str | None,
                        amax: torch.Tensor | None) -> torch.Tensor:
    """``_forward`` as one operator a compiled graph calls as it is: the Triton quantize launch and the
    ctypes cuBLASLt GEMM inside are not traceable (dynamo fails on the launch once shapes go dynamic,
    as a generated video's first chunk makes them)."""
    return _forward(x, packed, scale, global_scale, bias, four_over_six, backend, amax)


@packed_nvfp4_linear.register_fake
def _(x, packed, scale, global_scale, bias, four_over_six, backend, amax):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class _PackedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer: PackedNVFP4Linear):
        ctx.layer, ctx.x_shape = layer, x.shape
        return _forward(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias,
                        layer.recipe.four_over_six, layer.recipe.backend, layer.input_amax(x))

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
        if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:  # the decode reads them as bytes
            raise ValueError(f"packed weight {packed.dtype} / scales {scale.dtype}: NVFP4 is held as uint8 codes "
                             f"and float8_e4m3fn block scales")
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
                              (self.out_features, self.in_features), self.recipe.backend)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return dequantize_packed(self.weight_packed, self.weight_scale, self.weight_global_scale,
                                 (self.out_features, self.in_features), torch.float32)

    def input_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x's global amax over the amax group (SP ranks quantize with one scale), None without one."""
        if self.amax_group is None:
            return None
        return amaxes_over_group(x.reshape(-1, x.shape[-1]), self.recipe, self.amax_group)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
            return packed_nvfp4_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias,
                                       self.recipe.four_over_six, self.recipe.backend, self.input_amax(x))
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
