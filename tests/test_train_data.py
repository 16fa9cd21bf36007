"""Training samples from the latent cache: chunk trimming, shot offsets, per-frame captions, windows,
weighted and keyed draws."""
from __future__ import annotations

import pytest
import torch

from longlive_core.config import ConfigError
from longlive_core.train.data import LatentSamples, generator_for

from .helpers.latent_cache import SMALL, make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"), SMALL, weights={k: 1.0 for k in SMALL} | {"b": 0.0})


def test_shots_trimmed_to_whole_chunks_and_short_samples_left_out(cache):
    data = LatentSamples(cache, "train", chunk=2, shot_offset=8)
    assert data.sample_ids == ["a", "b", "c"] and data.too_short == 1
    assert [data.frames(s) for s in data.sample_ids] == [8, 8, 10]
    val = LatentSamples(cache, "val", chunk=2, shot_offset=8)
    assert val.sample_ids == ["v1", "v2"]


def test_positions_jump_at_each_shot_and_frames_read_their_shot(cache):
    s = LatentSamples(cache, "train", chunk=2, shot_offset=8).load("c", max_frames=64, generator=None)
    assert s.latents.shape == (48, 10, 4, 4)
    assert s.shot_of_frame.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 2, 2]
    assert s.positions.tolist() == [0, 1, 10, 11, 12, 13, 14, 15, 24, 25]
    assert s.text.shape == (3, 6, 32)
    # the shot's latents are its first whole chunks, as cached (shot 1 has offset 1 in the synthetic cache)
    assert torch.allclose(s.latents[:, 2:8].mean(), torch.tensor(1.0), atol=0.2)


def test_window_is_chunk_aligned_and_renumbered(cache):
    data = LatentSamples(cache, "train", chunk=2, shot_offset=8)
    full = data.load("c", max_frames=64, generator=None)
    starts = set()
    for i in range(40):
        w = data.load("c", max_frames=4, generator=generator_for(0, "w", i))
        assert w.latents.shape[1] == 4
        start = next(j for j in range(0, 10, 2) if torch.equal(full.latents[:, j:j + 4], w.latents))
        starts.add(start)
        assert w.positions[0] == 0 and w.shot_of_frame[0] == 0
        assert torch.equal(w.positions, full.positions[start:start + 4] - full.positions[start])
        first_shot = int(full.shot_of_frame[start])
        assert torch.equal(w.shot_of_frame, full.shot_of_frame[start:start + 4] - first_shot)
        assert torch.equal(w.text, full.text[first_shot:first_shot + w.text.shape[0]])
    assert starts == {0, 2, 4, 6}


def test_draws_follow_weights_and_keys(cache):
    data = LatentSamples(cache, "train", chunk=2, shot_offset=8,
                         sample_weights={"a": 1.0, "b": 0.0, "c": 3.0, "short": 1.0})
    picks = [data.draw(generator_for(0, "train", step, 0)) for step in range(400)]
    assert "b" not in picks
    assert 0.65 < picks.count("c") / len(picks) < 0.85
    assert picks == [data.draw(generator_for(0, "train", step, 0)) for step in range(400)]
    assert picks != [data.draw(generator_for(1, "train", step, 0)) for step in range(400)]


def test_missing_index_says_what_to_run(tmp_path):
    with pytest.raises(ConfigError, match="run encode_latents first"):
        LatentSamples(tmp_path, "train", 2, 8)
