"""The quantized KV caches: NVFP4 takes 3.56x and FP8 1.94x fewer bytes per cached token than bf16 at
the 5B model's 24 x 128 heads; K-smoothing leaves attention unchanged in exact arithmetic and cuts the
error of quantized keys that carry a per-channel offset; through the model, a chunk predicted from a
quantized cache stays close to the one from the exact cache (FP8's closer than NVFP4's), and the cache
never holds more than its window."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longlive_core.infer.kv_cache import KVCache, select
from longlive_core.infer.kv_quant import FP8Chunk, KVQuantConfig, QuantizedChunk, dequantize_all
from longlive_core.models.attention import attend
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT


def offset_keys(g: torch.Generator, tokens: int, heads: int = 4, dim: int = 64) -> torch.Tensor:
    """Keys with a per-channel offset shared by every token (as real keys have), 8x their spread."""
    offset = 8 * torch.randn(1, heads, 1, dim, generator=g)
    return offset + torch.randn(1, heads, tokens, dim, generator=g)


def test_bytes_per_token_and_round_trip_at_the_5b_head_shape():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, 880, 128, generator=g).to(torch.bfloat16)
    q = QuantizedChunk.of(x)
    ratio = (24 * 128 * 2) / (q.nbytes / 880)
    assert 3.5 < ratio <= 3.56 + 1e-3, ratio  # the format's limit: 2 bytes against 0.5 + 1/16 per element
    back = q.dequantize(torch.float32)
    assert float((back - x.float()).norm() / x.float().norm()) < 0.12
    two = [q, QuantizedChunk.of(x[:, :, :100])]
    kept = select(two, [(830, 980)])  # the last 150 tokens
    assert [c.tokens for c in kept] == [50, 100]
    assert torch.equal(dequantize_all(kept, torch.float32)[:, :, :50], back[:, :, -50:])


def test_the_fp8_cache_bytes_per_token_round_trip_and_slices():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, 880, 128, generator=g).to(torch.bfloat16)
    q = FP8Chunk.of(x)
    assert (24 * 128 * 2) / (q.nbytes / 880) == pytest.approx(256 / 132)  # 1 byte an element, 4 a row's scale
    back = q.dequantize(torch.float32)
    rel = float((back - x.float()).norm() / x.float().norm())
    assert 0 < rel < 0.03, rel  # E4M3's 3 mantissa bits; NVFP4's round trip is within 0.12
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    kept = select([q, FP8Chunk.of(x[:, :, :100])], [(830, 980)])
    assert [c.tokens for c in kept] == [50, 100]
    assert torch.equal(dequantize_all(kept, torch.float32)[:, :, :50], back[:, :, -50:])
    with pytest.raises(ValueError, match="format is one of"):
        KVQuantConfig(format="int8")


def test_smoothing_is_exact_in_exact_arithmetic_and_cuts_the_error_of_offset_keys():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 64, 64, generator=g, dtype=torch.float64)
    k, v = offset_keys(g, 256).double(), torch.randn(1, 4, 256, 64, generator=g, dtype=torch.float64)
    mean = k[:, :, :64].mean(dim=2, keepdim=True)  # fixed from a first chunk
    exact = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k - mean, v), exact, rtol=1e-12, atol=1e-12)

    def error(keys: torch.Tensor) -> float:
        out = F.scaled_dot_product_attention(q, QuantizedChunk.of(keys.float()).dequantize(torch.float64), v)
        return float((out - exact).norm() / exact.norm())

    plain, smooth = error(k), error(k - mean)
    assert smooth < plain / 3, (plain, smooth)


def test_a_chunk_read_through_a_quantized_cache_stays_close_and_the_window_holds():
    torch.manual_seed(0)
    model = WanDiT(DIT_CONFIGS["tiny"]).eval()
    g = torch.Generator().manual_seed(2)
    chunks, chunk = 4, 2
    clean = torch.randn(1, 48, chunks * chunk, 4, 4, generator=g)
    noisy = torch.randn(1, 48, chunk, 4, 4, generator=g)
    text = torch.randn(1, 5, 32, generator=g)
    outs, sizes = {}, {}
    for name, quant in (("exact", None), ("nvfp4", KVQuantConfig()), ("nvfp4-plain", KVQuantConfig(False)),
                        ("fp8", KVQuantConfig(format="fp8"))):
        cache = KVCache(len(model.blocks), 4, window=3 * chunk, quant=quant)  # two cached chunks + the one read
        model.attention_fn = cache
        try:
            with torch.no_grad():
                for c in range(chunks):
                    part = slice(c * chunk, (c + 1) * chunk)
                    with cache.write(chunk):
                        model(clean[:, :, part], torch.zeros(1), text,
                              frame_positions=torch.arange(part.start, part.stop))
                    assert cache.frames == min((c + 1) * chunk, 2 * chunk)  # never past the window
                positions = torch.arange(chunks * chunk, (chunks + 1) * chunk)
                outs[name] = model(noisy, torch.tensor([500.0]), text, frame_positions=positions)
        finally:
            model.attention_fn = attend
        sizes[name] = cache.nbytes
    rel = {name: float((outs[name] - outs["exact"]).norm() / outs["exact"].norm()) for name in ("nvfp4", "fp8")}
    assert 0 < rel["nvfp4"] < 0.05 and 0 < rel["fp8"] < rel["nvfp4"] / 2, rel
    assert sizes["exact"] / sizes["nvfp4"] > 3.0  # float32 activations here: 4 bytes against 0.56
    assert sizes["exact"] / sizes["fp8"] == pytest.approx(4 / (1 + 4 / 32))  # the tiny model's heads of 32
