"""The fused NVFP4 KV-cache attention (infer/kv_attention.py) against float64 dequantize-then-attend:
its largest error is at most 1.5x that of bf16 SDPA over the same dequantized keys and values; the
NVFP4 and FP8 window kernels give torch's dequantization bit for bit, and the cache reads through them. On
the CPU under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess since the flag is read at
import); on a GPU at the 5B's heads and window. No conftest import: the GPU image runs this file with
--noconftest."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.attention import float64_attention

REPO = Path(__file__).resolve().parents[1]


def check(device: str, heads: int = 2, dim: int = 64, chunks: tuple[int, ...] = (24, 40), own: int = 40,
          blocks: tuple[tuple[int, int], ...] = ((128, 64), (16, 16)), seed: int = 0) -> list[float]:
    """Two cached chunks of different ranges (so their global scales differ) and an offset on the keys
    (as real keys have, and K-smoothing removes only in part); returns each block shape's error ratio."""
    from longlive_core.infer.kv_attention import nvfp4_cache_attention
    from longlive_core.infer.kv_quant import QuantizedChunk

    g = torch.Generator().manual_seed(seed)

    def draw(tokens: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(1, heads, tokens, dim, generator=g) * scale).to(device, torch.bfloat16)

    offset = torch.randn(1, heads, 1, dim, generator=g).to(device) * 2
    q = draw(own)
    past_k = [QuantizedChunk.of((draw(t, 1 + i) + offset).to(torch.bfloat16)) for i, t in enumerate(chunks)]
    past_v = [QuantizedChunk.of(draw(t, 1 + 2 * i)) for i, t in enumerate(chunks)]
    k, v = (draw(own) + offset).to(torch.bfloat16), draw(own)
    keys = torch.cat([c.dequantize(torch.float64) for c in past_k] + [k.double()], dim=2)  # exact: codes x scales
    values = torch.cat([c.dequantize(torch.float64) for c in past_v] + [v.double()], dim=2)
    reference = float64_attention(q, keys, values)
    sdpa = F.scaled_dot_product_attention(q, keys.to(torch.bfloat16), values.to(torch.bfloat16)).double()
    baseline = (sdpa - reference).abs().max().item()
    ratios = []
    for block_m, block_n in blocks:
        fused = nvfp4_cache_attention(q, past_k, past_v, k, v, block_m, block_n)
        assert fused.shape == q.shape and fused.dtype == torch.bfloat16
        error = (fused.double() - reference).abs().max().item()
        assert error <= 1.5 * baseline, f"blocks {block_m}x{block_n}: max error {error:.3g}, bf16 SDPA's {baseline:.3g}"
        ratios.append(error / baseline)
    return ratios


def in_the_interpreter(code: str) -> None:
    """``code`` in a fresh Python with TRITON_INTERPRET=1 (read when Triton is imported)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself (and the GPU "
                    "image's Triton has another interpreter)")
def test_the_fused_read_is_as_close_as_bf16_sdpa_in_the_interpreter():
    in_the_interpreter("from tests.test_infer_kv_attention import check; print(check('cpu'))")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_fused_read_is_as_close_as_bf16_sdpa_on_the_gpu():
    # the 5B's 24 heads of 128; a window of 32 latent frames at 880 tokens each: 3 cached chunks and the chunk
    print(check("cuda", heads=24, dim=128, chunks=(7040, 7040, 7040), own=7040, blocks=((128, 64),)))


def same_window_as_torch(kernel, chunks: list, own: torch.Tensor, block_n: int) -> bool:
    """Whether ``kernel``'s window over ``chunks`` and ``own`` is bit for bit torch's dequantize-and-concatenate:
    ``own`` as it is and less a K-smoothing mean, laid out contiguously and as the model makes it ((B, L, H, D)
    transposed)."""
    from longlive_core.infer.kv_attention import smoothed

    past = [c.dequantize(torch.bfloat16) for c in chunks]
    mean = own.float().mean(dim=(0, 2), keepdim=True) + 0.37  # (1, H, 1, D): each chunk's keys less it
    strided = own.transpose(1, 2).contiguous().transpose(1, 2)
    return all(torch.equal(kernel(chunks, x, block_n, shift).view(torch.int16),  # bits: -0.0 is not +0.0
                           torch.cat(past + [smoothed(x, shift)], dim=2).view(torch.int16))
               for x in (own, strided) for shift in (None, mean))


def every_code_and_scale(heads: int, dim: int, device: str, encode_scale: float = 0.3):
    """A chunk whose blocks hold all 16 codes each, under every finite non-negative E4M3 scale (subnormal
    ones and zero among them), over an S_enc that makes the quotients round."""
    from longlive_core.infer.kv_quant import QuantizedChunk

    blocks = dim // 16
    tokens = -(-127 // (heads * blocks))
    scales = (torch.arange(heads * tokens * blocks) % 127).to(torch.uint8)  # 0x7f is NaN
    block = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # codes 0..15
    codes = block.repeat(heads * tokens * blocks)
    return QuantizedChunk(codes.view(1, heads, tokens, dim // 2).to(device),
                          scales.view(torch.float8_e4m3fn).view(1, heads, tokens, blocks).to(device),
                          torch.tensor(encode_scale, device=device))


def window_matches(device: str, heads: int = 2, dim: int = 32, tokens: tuple[int, ...] = (24, 40, 7), own: int = 9,
                   block_n: int = 16) -> bool:
    """``dequantized_window`` against the torch path: chunks of different ranges (global scales),
    with and without Four-Over-Six scales, lengths that are no multiple of the block; channels spread
    over four decades and tokens of zeros (block scales of zero); and every code under every scale
    (``every_code_and_scale``)."""
    from longlive_core.infer.kv_attention import dequantized_window
    from longlive_core.infer.kv_quant import QuantizedChunk

    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(0, -4, dim)
    drawn = [torch.randn(1, heads, t, dim, generator=g) * (1 + 3 * i) * (spread if i % 2 else 1.0)
             for i, t in enumerate(tokens)]
    drawn[0][:, :, :3] = 0.0
    chunks = [QuantizedChunk.of(x.to(device, torch.bfloat16), "mse" if i % 2 else None) for i, x in enumerate(drawn)]
    chunks.append(every_code_and_scale(heads, dim, device))
    mine = torch.randn(1, heads, own, dim, generator=g).to(device, torch.bfloat16)
    return same_window_as_torch(dequantized_window, chunks, mine, block_n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself")
def test_the_window_kernel_dequantizes_bit_for_bit_as_torch_in_the_interpreter():
    in_the_interpreter("from tests.test_infer_kv_attention import window_matches; assert window_matches('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_window_kernel_dequantizes_bit_for_bit_as_torch_on_the_gpu(monkeypatch):
    from longlive_core.quant import triton_launch

    monkeypatch.setattr(triton_launch, "VERIFY", True)  # every cached launch (misses, then hits) is Triton's pick
    assert window_matches("cuda", heads=24, dim=128, tokens=(7040, 7040, 7040), own=7040, block_n=64)


def fp8_window_matches(device: str, heads: int = 2, dim: int = 32, tokens: tuple[int, ...] = (24, 40, 0, 7),
                      own: int = 9, block_n: int = 16) -> bool:
    """``dequantized_fp8_window`` against the torch path: chunks of different ranges, channels spread over
    five decades (subnormal codes among them), an empty chunk, lengths that are no multiple of the block."""
    from longlive_core.infer.kv_attention import dequantized_fp8_window
    from longlive_core.infer.kv_quant import FP8Chunk

    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(0, -5, dim)
    chunks = [FP8Chunk.of((torch.randn(1, heads, t, dim, generator=g) * spread * 10.0 ** (i - 1)).to(device,
                                                                                                  torch.bfloat16))
              for i, t in enumerate(tokens)]
    bits = chunks[0].codes.view(torch.uint8).int()
    assert (((bits >> 3) & 15) == 0).logical_and((bits & 7) != 0).any()  # subnormal E4M3 codes
    mine = torch.randn(1, heads, own, dim, generator=g).to(device, torch.bfloat16)
    return same_window_as_torch(dequantized_fp8_window, chunks, mine, block_n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below runs the kernel itself")
def test_the_fp8_window_kernel_dequantizes_bit_for_bit_as_torch_in_the_interpreter():
    in_the_interpreter("from tests.test_infer_kv_attention import fp8_window_matches; assert fp8_window_matches('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_fp8_window_kernel_dequantizes_bit_for_bit_as_torch_on_the_gpu(monkeypatch):
    from longlive_core.quant import triton_launch

    monkeypatch.setattr(triton_launch, "VERIFY", True)  # every cached launch (misses, then hits) is Triton's pick
    assert fp8_window_matches("cuda", heads=24, dim=128, tokens=(7040, 7040, 0, 7040), own=7040, block_n=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
@pytest.mark.parametrize("kind, kernel", [("nvfp4", "dequantized_window"), ("fp8", "dequantized_fp8_window")])
def test_the_cache_reads_a_quantized_window_through_its_kernel_on_the_gpu(monkeypatch, kind, kernel):
    from longlive_core.infer import kv_attention
    from longlive_core.infer.kv_quant import KVQuantConfig

    calls, real = [], getattr(kv_attention, kernel)
    monkeypatch.setattr(kv_attention, kernel, lambda *a: calls.append(1) or real(*a))
    chunk = KVQuantConfig(format=kind).chunk(torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16))
    own = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(kv_attention.window([chunk], own), torch.cat([chunk.dequantize(torch.bfloat16), own], dim=2))
    assert calls == [1]


def test_a_window_off_the_gpu_is_read_by_torch():
    from longlive_core.infer.kv_attention import window
    from longlive_core.infer.kv_quant import QuantizedChunk

    chunk = QuantizedChunk.of(torch.randn(1, 2, 16, 32, dtype=torch.bfloat16))
    own = torch.randn(1, 2, 8, 32, dtype=torch.bfloat16)
    assert torch.equal(window([chunk], own), torch.cat([chunk.dequantize(torch.bfloat16), own], dim=2))
    assert torch.equal(window([], own), own)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_the_bf16_cache_read_in_place_is_sdpa_over_the_concatenation_on_the_gpu():
    """The BF16 cache's buffer view (``kv_cache.PlainWindow``, the 5B's heads, a full paper window) gives
    SDPA's output over [cache; own] concatenated, bit for bit: the same values through the same kernel."""
    from longlive_core.infer.kv_cache import KVCache

    torch.manual_seed(0)
    tokens, heads, dim = 880, 24, 128
    cache = KVCache(1, tokens, window=32)

    def draw(frames: int) -> torch.Tensor:
        return torch.randn(1, heads, frames * tokens, dim, device="cuda", dtype=torch.bfloat16)

    held_k = held_v = None
    for _ in range(4):  # 32 frames written in chunks of 8: the window fills and rolls
        k, v = draw(8), draw(8)
        with cache.write(8):
            cache.for_layer(0)(draw(8), k, v, None)
        held_k = k if held_k is None else torch.cat([held_k, k], 2)[:, :, -24 * tokens:]
        held_v = v if held_v is None else torch.cat([held_v, v], 2)[:, :, -24 * tokens:]
    q, k, v = draw(8), draw(8), draw(8)
    attn = cache.for_layer(0)
    assert attn._in_place(q, k, v)
    expected = F.scaled_dot_product_attention(q, torch.cat([held_k, k], 2), torch.cat([held_v, v], 2))
    assert torch.equal(attn(q, k, v, None), expected)
