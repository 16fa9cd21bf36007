"""The multi-shot attention sink: which frames the KV cache keeps across shots and prompt changes."""
from __future__ import annotations

import pytest
import torch

from longlive_core.infer.kv_cache import KVCache, PlainWindow, SinkConfig
from longlive_core.infer.kv_quant import KVQuantConfig

CHUNK = 2


def held(cache: KVCache) -> list[int]:
    """The video frames the cache holds, in cache order (each key carries its frame number in binary,
    which NVFP4 and FP8 hold exactly)."""
    keys = torch.cat([c.dequantize(torch.float32) for c in cache.keys[0]], dim=2)[0, 0]
    return [int((row.round() * 2 ** torch.arange(16)).sum()) for row in keys]


def write(cache: KVCache, first: int) -> int:
    """One chunk of frames first, first + 1 through layer 0's attention; returns the keys it read."""
    frames = torch.arange(first, first + CHUNK)
    k = ((frames[:, None] >> torch.arange(16)) & 1).float()[None, None]
    seen = {}
    with cache.write(CHUNK):
        attn = cache.for_layer(0)
        seen["keys"] = sum(c.tokens for c in attn.past_k) + CHUNK
        attn(torch.zeros(1, 1, CHUNK, 16), k.contiguous(), k.contiguous(), None)
    return seen["keys"]


@pytest.mark.parametrize("quant", [None, KVQuantConfig(smooth_keys=False),
                                   KVQuantConfig(smooth_keys=False, format="fp8")])
def test_sinks_are_pointers_that_follow_shots_and_ignore_prompt_changes(quant):
    cache = KVCache(1, 1, window=10, quant=quant, sink=SinkConfig(global_frames=2, shot_frames=2))
    for first in range(0, 10, CHUNK):  # shot 0: frames 0..9
        assert write(cache, first) <= 10
    assert held(cache) == [0, 1, 4, 5, 6, 7, 8, 9]
    assert (cache.global_sink.start, cache.global_sink.length) == (0, 2)

    cache.start_shot()  # shot 1 begins at frame 10
    write(cache, 10)
    assert held(cache) == [0, 1, 6, 7, 8, 9, 10, 11]
    assert held(cache)[cache.shot_sink.start:cache.shot_sink.stop] == [10, 11]
    write(cache, 12)
    assert held(cache) == [0, 1, 8, 9, 10, 11, 12, 13]
    write(cache, 14)  # a '+' line: the prompt changes, the shot and its sink stay
    assert held(cache) == [0, 1, 10, 11, 12, 13, 14, 15]
    assert held(cache)[cache.shot_sink.start:cache.shot_sink.stop] == [10, 11]

    cache.start_shot()  # shot 2: shot 1's sink ages out like any frame
    write(cache, 16)
    assert held(cache) == [0, 1, 12, 13, 14, 15, 16, 17]
    assert held(cache)[cache.shot_sink.start:cache.shot_sink.stop] == [16, 17]
    for first in range(18, 40, CHUNK):
        assert write(cache, first) <= 10
        assert cache.frames <= 8
    assert held(cache) == [0, 1, 16, 17, 36, 37, 38, 39]
    assert cache.nbytes == sum(c.nbytes for c in cache.keys[0] + cache.values[0])


def test_without_sinks_the_window_rolls_and_a_window_too_small_for_the_sinks_is_refused():
    cache = KVCache(1, 1, window=6)
    for first in range(0, 12, CHUNK):
        write(cache, first)
    assert held(cache) == [8, 9, 10, 11]
    small = KVCache(1, 1, window=5, sink=SinkConfig(2, 2))
    with pytest.raises(ValueError, match="at least 6"):
        write(small, 0)


def test_each_chunk_reads_the_window_its_own_frames_and_sinks_included():
    """Production's numbers (window 32, sinks 8 + 8, chunks of 8; here in units of 2 frames: window 8,
    sinks 2 + 2, chunks of 2): every chunk reads at most the window, itself among it, and from the
    fourth chunk on exactly the window: the global sink, the shot sink, the newest frames, itself."""
    cache = KVCache(1, 1, window=8, sink=SinkConfig(global_frames=2, shot_frames=2))
    read = []
    for first in range(0, 12, CHUNK):  # shot 0: frames 0..11
        before = held(cache) if cache.frames else []
        assert write(cache, first) == len(before) + CHUNK
        read.append(before + [first, first + 1])
    assert [len(r) for r in read] == [2, 4, 6, 8, 8, 8]
    assert read[5] == [0, 1, 6, 7, 8, 9, 10, 11]  # the global (= shot 0's) sink, the newest, itself
    cache.start_shot()
    for first in (12, 14, 16):  # shot 1
        before = held(cache)
        write(cache, first)
        read.append(before + [first, first + 1])
    assert read[6] == [0, 1, 8, 9, 10, 11, 12, 13]
    assert read[7] == [0, 1, 10, 11, 12, 13, 14, 15]  # shot 1's sink is 12, 13
    assert read[8] == [0, 1, 12, 13, 14, 15, 16, 17]
    assert max(len(r) for r in read) == 8


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("window", [6, None])
def test_a_bf16_cache_reads_its_buffer_in_place_and_an_older_window_reads_what_it_read(window, monkeypatch):
    """Each read attends over [cache; own] without copying the cache: the chunk's own rows go into the
    room after the held ones (the view shares the buffer), with the output of attention over the
    concatenation, and a write pass that read in place keeps them there without a second copy. A
    window held from before later writes (activation checkpointing's recomputation of a denoising
    pass) reads the same rows as before and leaves the cache as it is, and a read that gradients flow
    through concatenates."""
    torch.manual_seed(0)
    cache = KVCache(1, 3, window=window)
    held_k = held_v = torch.empty(1, 2, 0, 8)
    for c in range(5):
        noisy = [torch.randn(1, 2, 6, 8) for _ in range(3)]  # a denoising pass: it reads, writes nothing
        attn = cache.for_layer(0)
        out = attn(*noisy, None)
        assert torch.equal(out, _sdpa(noisy[0], torch.cat([held_k, noisy[1]], 2), torch.cat([held_v, noisy[2]], 2)))
        if c == 3:
            old, old_noisy, old_out = attn, noisy, out
        if c and window is not None:  # a view of the buffer (with no window the buffer doubles as it
            # fills, and a read it has no room for concatenates)
            past = attn.past_k[0]
            assert past.fits(noisy[1])
            assert past.with_own(noisy[1]).untyped_storage().data_ptr() == past.rows.untyped_storage().data_ptr()
        q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
        copies = []
        with monkeypatch.context() as m, cache.write(2):  # the clean chunk at t = 0: read, then written
            m.setattr(PlainWindow, "with_own", lambda self, own, real=PlainWindow.with_own, seen=copies:
                      seen.append(own) or real(self, own))
            out = cache.for_layer(0)(q, k, v, None)
        assert [x is k or x is v for x in copies] == [True] * len(copies) and len(copies) in (0, 2)
        if c == 1:  # room after the held rows and none dropped: read, and then kept, in place
            assert len(copies) == 2
        assert torch.equal(out, _sdpa(q, torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)))
        held_k, held_v = torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)
        if window is not None:
            held_k, held_v = held_k[:, :, -(window - 2) * 3:], held_v[:, :, -(window - 2) * 3:]
        assert torch.equal(cache.keys[0][0].data, held_k) and torch.equal(cache.values[0][0].data, held_v)
    # chunk 3's denoising pass, two writes later: the rows it read, and the cache untouched
    assert torch.equal(old(*old_noisy, None), old_out)
    assert torch.equal(cache.keys[0][0].data, held_k) and torch.equal(cache.values[0][0].data, held_v)
    # gradients through the queries alone, or the chunk's own keys: concatenated (the backward keeps the
    # keys and values it read), so a later read's use of the room leaves them as they were
    for grad in ("q", "k"):
        q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=name == grad) for name in "qkv")
        out = cache.for_layer(0)(q, k, v, None)
        with torch.no_grad():
            cache.for_layer(0)(*(torch.randn(1, 2, 6, 8) for _ in range(3)), None)
        out.sum().backward()
        assert (q if grad == "q" else k).grad is not None and torch.equal(cache.keys[0][0].data, held_k)


@pytest.mark.parametrize("quant", [None, KVQuantConfig(smooth_keys=False)])
def test_a_write_pass_must_append_the_chunk_once_in_every_layer(quant):
    cache = KVCache(2, 1, window=8, quant=quant)
    x = torch.zeros(1, 1, CHUNK, 16)
    for _ in range(2):  # a full pass, then one more so each layer holds something
        with cache.write(CHUNK):
            for layer in range(2):
                cache.for_layer(layer)(x, x, x, None)
    with pytest.raises(RuntimeError, match=r"every layer once; the layers ran \[1, 0\] times"), cache.write(CHUNK):
        cache.for_layer(0)(x, x, x, None)
    cache = KVCache(2, 1, window=8, quant=quant)
    with pytest.raises(RuntimeError, match="layer 0 ran twice"), cache.write(CHUNK):
        cache.for_layer(0)(x, x, x, None)
        cache.for_layer(0)(x, x, x, None)
    cache = KVCache(2, 1, window=8, quant=quant)
    with pytest.raises(ValueError, match="appends 2 tokens a layer; layer 0 got 3"), cache.write(CHUNK):
        cache.for_layer(0)(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), None)


@pytest.mark.parametrize("window, writes", [(8, 6), (None, 5), (12, 4), (6, 1)])
def test_largest_buffer_is_the_largest_a_bf16_cache_takes(window, writes):
    """distill_dmd's planner counts a rollout's cache by ``largest_buffer``: the rows a layer's buffer
    really takes at its largest, its window filled or not."""
    from longlive_core.infer.kv_cache import largest_buffer

    cache, most = KVCache(1, 3, window=window, sink=SinkConfig(global_frames=2) if window else None), 0
    for _ in range(writes):
        x = torch.zeros(1, 1, CHUNK * 3, 4)
        with cache.write(CHUNK):
            cache.for_layer(0)(x, x, x, None)
        most = max(most, cache.keys[0][0].rows.shape[2])
    assert largest_buffer(writes, CHUNK * 3, None if window is None else window * 3) == most
    if window is not None and writes * CHUNK > window - CHUNK:  # a full window: room for one chunk's reads
        assert most == window * 3
