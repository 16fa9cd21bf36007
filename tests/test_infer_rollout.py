"""The chunk-by-chunk KV cache against teacher-forcing training: a noisy chunk predicted with the cache
of the clean chunks before it equals its prediction inside the [clean; noisy] training sequence (the
same model, the same mask semantics), with and without a rolling window; and the few-step rollout."""
from __future__ import annotations

import pytest
import torch

from longlive_core.infer.kv_cache import KVCache
from longlive_core.infer.rollout import RolloutConfig, rollout
from longlive_core.models.attention import attend
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.wan_dit import WanDiT
from longlive_core.train.layout import TeacherForcingLayout, balanced_roles

CHUNK, H, W, TEXT = 2, 4, 4, 5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WanDiT(DIT_CONFIGS["tiny"]).eval()


def inputs(chunks: int):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, 48, chunks * CHUNK, H, W, generator=g)
    noisy = torch.randn(1, 48, chunks * CHUNK, H, W, generator=g)
    t = torch.rand(1, chunks, generator=g) * 1000
    text = torch.randn(1, TEXT, 32, generator=g)
    return x0, noisy, t, text


def windowed_mask(layout: TeacherForcingLayout, window_chunks: int):
    """The teacher-forcing mask restricted to the clean chunks of the last ``window_chunks`` before
    a chunk: what a cache of that many chunks holds."""
    roles = balanced_roles(layout.frames, layout.chunk, layout.tokens_per_frame)

    def mask_mod(b, h, q_idx, kv_idx):
        qc, qn = roles(q_idx)
        kc, kn = roles(kv_idx)
        recent = kc >= qc - window_chunks
        clean_q = ~qn & ~kn & (kc <= qc) & recent
        noisy_q = qn & ((kn & (kc == qc)) | (~kn & (kc < qc) & recent))
        return clean_q | noisy_q

    return mask_mod


@pytest.mark.parametrize("window_chunks", [None, 1])
def test_cached_chunk_equals_its_teacher_forcing_prediction(model, window_chunks):
    chunks = 4
    x0, noisy, t, text = inputs(chunks)
    layout = TeacherForcingLayout(chunks * CHUNK, CHUNK, (H // 2) * (W // 2), TEXT)
    mask = layout.self_mask() if window_chunks is None else windowed_mask(layout, window_chunks)
    positions = torch.arange(chunks * CHUNK)
    with torch.no_grad():
        full = model(layout.sequence(x0, noisy), layout.timesteps(t), text,
                     frame_positions=layout.frame_positions(positions), mask_mod=mask)
        cache = KVCache(len(model.blocks), layout.tokens_per_frame,  # the window counts the chunk itself
                        None if window_chunks is None else (window_chunks + 1) * CHUNK)
        model.attention_fn = cache
        try:
            for c in range(chunks):
                part = slice(c * CHUNK, (c + 1) * CHUNK)
                pred = model(noisy[:, :, part], t[:, c], text, frame_positions=positions[part])
                expected = layout.noisy_part(full)[:, :, part]
                torch.testing.assert_close(pred, expected, rtol=1e-4, atol=1e-5, msg=f"chunk {c}")
                with cache.write(CHUNK):
                    model(x0[:, :, part], torch.zeros(1), text, frame_positions=positions[part])
                held = (c + 1) * CHUNK if window_chunks is None else min((c + 1) * CHUNK, window_chunks * CHUNK)
                assert cache.frames == held
        finally:
            model.attention_fn = attend


def test_rollout_is_keyed_bounded_and_refuses_bad_steps(model):
    _, noise, _, text = inputs(3)
    cfg = RolloutConfig(chunk_frames=CHUNK, steps=(1000, 750, 500, 0), window=2 * CHUNK)
    a = rollout(model, noise, text, cfg, torch.Generator().manual_seed(3))
    b = rollout(model, noise, text, cfg, torch.Generator().manual_seed(3))
    c = rollout(model, noise, text, cfg, torch.Generator().manual_seed(4))
    assert a.shape == noise.shape and torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert model.attention_fn is attend  # the model is left as it was
    one_step = rollout(model, noise[:, :, :CHUNK], text, RolloutConfig(CHUNK, (1000, 0), None))
    with torch.no_grad():  # one step from pure noise: x0 = x - v
        v = model(noise[:, :, :CHUNK], torch.full((1,), 1000.0), text, frame_positions=torch.arange(CHUNK))
    torch.testing.assert_close(one_step, noise[:, :, :CHUNK] - v)
    for steps in ((1000, 500), (500, 800, 0), (0,)):
        with pytest.raises(ValueError, match="descend"):
            RolloutConfig(CHUNK, steps)


def test_a_rollout_keeps_the_sinks_and_starts_shots_as_inference_does(model, monkeypatch):
    """Six chunks, the second shot from the third: every chunk reads at most the window (itself
    included), the shot sink moves to the new shot's first frames, and that changes what the last
    chunks read (so the rollout differs from a one-shot one)."""
    import longlive_core.infer.rollout as rollout_module

    seen: list[tuple] = []  # (held frames, global sink, shot sink) as each forward of layer 0 began
    shot_starts: list[int] = []

    class Recording(KVCache):
        def for_layer(self, index):
            if index == 0:
                seen.append((self.frames, self.writing, (self.global_sink.start, self.global_sink.length),
                             (self.shot_sink.start, self.shot_sink.length)))
            return super().for_layer(index)

        def start_shot(self):
            shot_starts.append(self.video_frames)
            super().start_shot()

    monkeypatch.setattr(rollout_module, "KVCache", Recording)
    _, noise, _, text = inputs(6)
    cfg = RolloutConfig(CHUNK, (1000, 500, 0), window=4 * CHUNK, global_sink=CHUNK, shot_sink=CHUNK)
    shots = [0, 0, 1, 1, 1, 1]
    two_shots = rollout(model, noise, text, cfg, torch.Generator().manual_seed(3), shots=shots)
    assert shot_starts == [2 * CHUNK]
    denoising = [s for s in seen if not s[1]]
    assert [held for held, *_ in denoising[::2]] == [0, 2, 4, 6, 6, 6]  # two steps a chunk; + itself <= 8
    assert all(held + CHUNK <= cfg.window for held, *_ in seen)
    # after chunk 4 was written: the global sink (frames 0, 1), shot 1's sink (4, 5), then 8, 9
    assert denoising[-1][2:] == ((0, CHUNK), (2, CHUNK))
    seen.clear()
    one_shot = rollout(model, noise, text, cfg, torch.Generator().manual_seed(3))
    torch.testing.assert_close(one_shot[:, :, :4 * CHUNK], two_shots[:, :, :4 * CHUNK], rtol=0, atol=0)
    assert not torch.equal(one_shot[:, :, 5 * CHUNK:], two_shots[:, :, 5 * CHUNK:])
    with pytest.raises(ValueError, match="at least 6"):
        RolloutConfig(CHUNK, (1000, 0), window=5, global_sink=2, shot_sink=2)
