"""A linear layer that computes like Transformer Engine's NVFP4 recipe, emulated on any device.

Forward ``y = x W^T + b``: x quantized in 1x16 blocks (round to nearest even), W in 16x16 tiles
(so its row- and column-wise copies are the same numbers and serve both fprop and dgrad). Backward:
the output gradient in 1x16 blocks with stochastic rounding; the weight-gradient GEMM quantizes
both of its inputs along the token axis after the random Hadamard transform. Master weights,
their gradients and the bias stay in their own (high) precision; only the GEMM operands are 4-bit.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longlive_core.quant.gemm import emulated_mm, operand_amaxes, quantize_partial
from longlive_core.quant.nvfp4 import BLOCK


@dataclasses.dataclass(frozen=True)
class NVFP4Recipe:
    """How the GEMM operands of a converted layer are quantized."""

    weight_tile: tuple[int, int] = (BLOCK, BLOCK)
    grad_stochastic: bool = True
    wgrad_rht: bool = True
    # Four-Over-Six block scales for the forward operands (weights and activations): None, "mse", "mae"
    four_over_six: str | None = None
    backend: str | None = None  # None: Triton on CUDA, torch elsewhere
    # the forward GEMM in the input's own precision while dgrad and wgrad stay NVFP4: the NVFP4
    # pretraining study (Appendix D) switches to this late in training, where most of the loss gap
    # comes from the forward pass
    forward_high_precision: bool = False


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Signal-to-quantization-noise ratio in dB (a 0-d tensor: no host sync until read)."""
    xf = x.float()
    noise = (xf - approx.float()).square().sum()
    return 10 * torch.log10(xf.square().sum() / noise.clamp_min(torch.finfo(torch.float32).tiny))


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16: the wgrad GEMM's blocks run along the token axis, and zero
    tokens add nothing to the product."""
    extra = -t.shape[0] % BLOCK
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _amaxes_along_tokens(t2: torch.Tensor, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |t2|, max |RHT along tokens| of t2 zero-padded to whole token blocks): one pass gives the
    amax of the row-wise operand and of the wgrad operand (the RHT'd transpose)."""
    return operand_amaxes(_pad_rows(t2).t(), backend)


def amaxes_over_group(t2: torch.Tensor, recipe: NVFP4Recipe, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The two amaxes of :func:`_amaxes_along_tokens` max-reduced over ``group``: ranks that each hold
    part of the tokens (sequence parallelism) quantize with the whole tensor's scales, as one rank
    holding every token would."""
    amax, t_amax = _amaxes_along_tokens(t2, recipe.backend)
    both = torch.stack([amax, t_amax if recipe.wgrad_rht else amax])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[0], both[1]


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: NVFP4Recipe, probe: dict | None, for_backward: bool, group=None):
        x2 = x.reshape(-1, x.shape[-1])
        x_amax = xt_amax = None
        fused = for_backward and recipe.wgrad_rht and recipe.four_over_six is None
        if group is not None:
            x_amax, xt_amax = amaxes_over_group(x2, recipe, group)
        elif fused:  # the wgrad operand's amax now, from the same read as the forward's
            x_amax, xt_amax = _amaxes_along_tokens(x2, recipe.backend)
        wp, wd = quantize_partial(weight, recipe.weight_tile, four_over_six=recipe.four_over_six,
                                  backend=recipe.backend)
        # the quantizer multiplies in the weight's decode scale (one host multiply fewer per GEMM),
        # unless the probe needs the input's own
        times = wd if probe is None else None
        if recipe.forward_high_precision:
            y = F.linear(x2, weight.to(x2.dtype), None if bias is None else bias.to(x2.dtype))
        else:
            xp, xd = quantize_partial(x2, (1, BLOCK), four_over_six=recipe.four_over_six, backend=recipe.backend,
                                      amax=x_amax, times=times)
            y = emulated_mm(xp, xd, wp.t(), wd if times is None else None, bias, x.dtype)
        if probe is not None:
            probe["weight"] = sqnr_db(weight, wp.float() * wd)
            if not recipe.forward_high_precision:
                probe["input"] = sqnr_db(x2, xp.float() * xd)
        ctx.save_for_backward(x2, wp, wd, xt_amax)
        ctx.recipe, ctx.probe, ctx.x_shape, ctx.has_bias = recipe, probe, x.shape, bias is not None
        ctx.group = group
        ctx.weight_dtype = weight.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, wp, wd, xt_amax = ctx.saved_tensors
        r: NVFP4Recipe = ctx.recipe
        g2 = gy.reshape(-1, gy.shape[-1])
        grad_x = grad_w = grad_b = None
        g_amax = gt_amax = None
        if ctx.group is not None:
            g_amax, gt_amax = amaxes_over_group(g2, r, ctx.group)
        elif xt_amax is not None and ctx.needs_input_grad[1]:
            g_amax, gt_amax = _amaxes_along_tokens(g2, r.backend)
        if ctx.needs_input_grad[0]:
            times = wd if ctx.probe is None else None
            gp, gd = quantize_partial(g2, (1, BLOCK), stochastic=r.grad_stochastic, backend=r.backend, amax=g_amax,
                                      times=times)
            grad_x = emulated_mm(gp, gd, wp, wd if times is None else None, out_dtype=gy.dtype).view(ctx.x_shape)
            if ctx.probe is not None:
                ctx.probe["grad_output"] = sqnr_db(g2, gp.float() * gd)
        if ctx.needs_input_grad[1]:
            gt, gtd = quantize_partial(_pad_rows(g2).t(), (1, BLOCK), rht=r.wgrad_rht,
                                       stochastic=r.grad_stochastic, backend=r.backend, amax=gt_amax)
            xt, alpha = quantize_partial(_pad_rows(x2).t(), (1, BLOCK), rht=r.wgrad_rht, backend=r.backend,
                                         amax=xt_amax, times=gtd)
            grad_w = emulated_mm(gt, alpha, xt.t(), None, out_dtype=ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0, dtype=torch.float32)  # accumulates in float32 without a float32 copy of g
        return grad_x, grad_w, grad_b, None, None, None, None


class NVFP4Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run through the emulated NVFP4 path; same parameters and state-dict
    keys as the layer it replaces. ``probe``, when a dict, receives per-step SQNRs (see
    :func:`longlive_core.quant.numerics.record_sqnr`)."""

    recipe: NVFP4Recipe
    probe: dict | None = None
    amax_group: dist.ProcessGroup | None = None  # ranks that split the tokens: global amaxes reduced over it

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: NVFP4Recipe) -> NVFP4Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe, new.probe, new.amax_group = recipe, None, None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NVFP4LinearFn.apply(x, self.weight, self.bias, self.recipe, self.probe,
                                    torch.is_grad_enabled() and self.weight.requires_grad, self.amax_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
