"""The Wan VAE decoder's spatial upsampling (nearest 2x, then a 3x3 convolution with zero padding 1) computed
as a sub-pixel convolution: one 2x2 convolution over the input with four times the output channels, one
set a phase (output row parity p, column parity q), then the phases interleaved.

Why it is the same map: after a nearest 2x upsampling, the 3x3 window around output row 2a + p covers
input rows a - 1 and a where p = 0 (kernel row 0 on the first, rows 1 and 2 on the second) and rows a and
a + 1 where p = 1 (rows 0 and 1, then row 2); columns likewise. So each phase is a 2x2 kernel whose
taps are sums of the 3x3 kernel's, and the border's zero rows correspond one to one. Per output pixel
it multiplies 4 input pixels, where the upsampled image's convolution multiplies 9 (about 2.2x fewer
FLOPs with the phases' extra border row and column; a steady chunk of the Wan2.2 decoder at 704x1280 does
7.5% fewer in all, as bench/vae_decode.py counts them), and the 4x upsampled input is never written.
The summed taps are rounded once to the weights' dtype (in bfloat16 a relative 2^-9, as one more rounding
of an activation), so frames differ from the plain decoder's within that rounding
(tests/test_infer_vae_upsample.py; bench/vae_decode.py measures the PSNR against float32).
"""
from __future__ import annotations

import torch
from torch import nn

# per phase, which of the 3x3 kernel's rows (or columns) each of the 2x2 kernel's sums
_TAPS = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]],   # p = 0: input row a - 1, then a
                      [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]],  # p = 1: input row a, then a + 1
                     dtype=torch.float64)


class SubpixelUpsampleConv(nn.Module):
    """``nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest-exact"), conv)`` for a 3x3, stride-1,
    padding-1 ``conv``, as one 2x2 convolution (``conv.weight``'s dtype and device) and an interleave."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        if not upsample_conv_fits(conv):
            raise ValueError(f"a sub-pixel upsampling needs a 3x3 convolution of stride 1, padding 1, no groups, "
                             f"no dilation; got {conv}")
        w = conv.weight.detach().to(torch.float64)  # (C_out, C_in, 3, 3)
        taps = _TAPS.to(w.device)
        phases = torch.einsum("prk,qsl,oikl->pqoirs", taps, taps, w)  # (2, 2, C_out, C_in, 2, 2)
        c_out, c_in = w.shape[:2]
        self.out_channels = c_out
        self.conv = nn.Conv2d(c_in, 4 * c_out, 2, padding=1, bias=conv.bias is not None,
                              device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            self.conv.weight.copy_(phases.reshape(4 * c_out, c_in, 2, 2))
            if conv.bias is not None:
                self.conv.bias.copy_(conv.bias.detach().repeat(4))
        self.conv.requires_grad_(conv.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        c = self.out_channels
        z = self.conv(x)  # (N, 4 C, H + 1, W + 1): phase (p, q) at rows p.., columns q..
        # the layout the plain convolution's output would take (its input's and weights'), read off z's: with its
        # 4 C channels and a border row and column, unambiguous where x's may not be (one channel or pixel)
        channels_last = z.is_contiguous(memory_format=torch.channels_last) and not z.is_contiguous()
        out = torch.empty((n, c, 2 * h, 2 * w), dtype=z.dtype, device=z.device,
                          memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        z = z.view(n, 2, 2, c, h + 1, w + 1)
        for p in (0, 1):
            for q in (0, 1):
                out[:, :, p::2, q::2] = z[:, p, q, :, p:p + h, q:q + w]
        return out


def upsample_conv_fits(conv: nn.Module) -> bool:
    return (isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
            and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


def _nearest_2x(module: nn.Module) -> bool:
    scale = module.scale_factor if isinstance(module, nn.Upsample) else None
    scale = tuple(scale) if isinstance(scale, tuple | list) else (scale, scale)
    return (isinstance(module, nn.Upsample) and module.mode in ("nearest", "nearest-exact") and module.size is None
            and tuple(float(s) for s in scale) == (2.0, 2.0))


def subpixel_upsampling(decoder: nn.Module) -> int:
    """Replaces, in place, every ``nn.Sequential(nearest 2x upsampling, 3x3 convolution)`` under
    ``decoder`` (the Wan decoder's ``WanResample.resample`` of its upsampling modes) by a
    ``SubpixelUpsampleConv``; returns how many it replaced."""
    found = [(parent, name, child) for parent in decoder.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Sequential) and len(child) == 2 and _nearest_2x(child[0])
             and upsample_conv_fits(child[1])]
    for parent, name, child in found:
        setattr(parent, name, SubpixelUpsampleConv(child[1]))
    return len(found)
