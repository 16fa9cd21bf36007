import copy

import pytest
import torch
from torch import nn

from longlive_core.infer.decode import ShotDecoder
from longlive_core.infer.generate import vae_from
from longlive_core.infer.vae_upsample import SubpixelUpsampleConv, subpixel_upsampling


def plain(conv: nn.Conv2d) -> nn.Sequential:
    return nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), conv)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_subpixel_convolution_is_nearest_upsampling_then_the_3x3_convolution(channels_last):
    """In float64 the same map up to the order of summation, borders included (odd, unequal sizes)."""
    g = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(5, 3, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64))
        conv.bias.copy_(torch.randn(3, generator=g, dtype=torch.float64))
    x = torch.randn(2, 5, 7, 4, generator=g, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fused = SubpixelUpsampleConv(conv)
    out = fused(x)
    assert out.shape == (2, 3, 14, 8)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(out, plain(conv)(x), rtol=0, atol=1e-12)


def test_in_bfloat16_the_summed_taps_round_once():
    """bfloat16 weights: the phases' taps are sums of up to four of them, rounded once, so the output is
    within a few bfloat16 roundings of the plain path's (both against float64): each output's largest error
    at most 4 half-ulps of bfloat16 (2^-8 relative each: the output's rounding, and the summed taps' spread
    over the output's scale), and over all outputs no more than twice the plain path's."""
    g = torch.Generator().manual_seed(1)
    conv = nn.Conv2d(64, 32, 3, padding=1).to(torch.bfloat16)
    x = torch.randn(1, 64, 6, 6, generator=g).to(torch.bfloat16)
    exact = plain(copy.deepcopy(conv).double())(x.double())
    fused = SubpixelUpsampleConv(conv)(x).double()
    reference = plain(conv)(x).double()
    scale = exact.abs().max()
    assert (fused - exact).abs().max() <= 4 * 2.0 ** -8 * scale
    assert (fused - exact).norm() <= 2 * (reference - exact).norm() + 1e-12


def test_only_nearest_2x_then_a_3x3_padded_convolution_is_replaced():
    model = nn.Sequential(plain(nn.Conv2d(4, 4, 3, padding=1)),
                          nn.Sequential(nn.Upsample(scale_factor=2.0, mode="bilinear"), nn.Conv2d(4, 4, 3, padding=1)),
                          nn.Sequential(nn.Upsample(scale_factor=2.0), nn.Conv2d(4, 4, 3, padding=0)),
                          nn.Sequential(nn.Upsample(scale_factor=3.0), nn.Conv2d(4, 4, 3, padding=1)))
    assert subpixel_upsampling(model) == 1
    assert isinstance(model[0], SubpixelUpsampleConv)
    assert all(isinstance(m, nn.Sequential) for m in model[1:])
    with pytest.raises(ValueError, match="3x3 convolution of stride 1, padding 1"):
        SubpixelUpsampleConv(nn.Conv2d(4, 4, 3, padding=0))


def test_a_decoder_with_subpixel_upsampling_decodes_the_same_frames():
    """The Wan decoder's every upsampling (2-D and 3-D modes) replaced: in float32 the frames within one
    8-bit level of the plain decoder's, chunk by chunk across a shot."""
    z = torch.randn(48, 6, 4, 4, generator=torch.Generator().manual_seed(0))
    frames = {}
    for subpixel in (False, True):
        decoder = ShotDecoder(vae_from("tiny"), subpixel=subpixel)
        decoder.start_shot()
        frames[subpixel] = torch.cat([decoder.decode(z[:, :2]), decoder.decode(z[:, 2:4]), decoder.decode(z[:, 4:])])
        if subpixel:  # two 3-D upsamplings and one 2-D in the tiny decoder, as in Wan2.2's; none left behind
            assert decoder.upsamplings == sum(isinstance(m, SubpixelUpsampleConv) for m in decoder.vae.modules()) == 3
            assert not any(isinstance(m, nn.Upsample) for m in decoder.vae.decoder.modules())
    assert (frames[True].int() - frames[False].int()).abs().max() <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_subpixel_convolution_on_cuda_in_bfloat16_channels_last():
    """Made from a convolution on the GPU (its taps summed there), compiled as the product runs it."""
    g = torch.Generator("cuda").manual_seed(0)
    conv = nn.Conv2d(64, 32, 3, padding=1, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(2, 64, 12, 20, device="cuda", generator=g).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    exact = plain(copy.deepcopy(conv).double())(x.double())
    fused = torch.compile(SubpixelUpsampleConv(conv))(x)
    assert fused.is_contiguous(memory_format=torch.channels_last)
    assert (fused.double() - exact).abs().max() <= 4 * 2.0 ** -8 * exact.abs().max()
