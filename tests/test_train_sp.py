"""Balanced sequence parallelism and error recycling, single process: the mask on the post-all-to-all
order against a permute-based reference, windows split into rank parts, the config's refusals, and
the error buffers (buckets, sharding, draws, state). The multi-rank equalities are in
test_train_sp_ranks.py."""
from __future__ import annotations

import pytest
import torch

from longlive_core.config import ConfigError, from_mapping
from longlive_core.models.attention import dense_mask
from longlive_core.train.config import TrainARConfig
from longlive_core.train.data import LatentSamples, generator_for
from longlive_core.train.error_recycling import (
    ErrorBuffer,
    ErrorRecycler,
    ErrorRecyclingConfig,
    InjectionDraws,
    position_bucket,
)
from longlive_core.train.layout import TeacherForcingLayout

from .helpers.latent_cache import make_cache

CPU = torch.device("cpu")


def post_exchange_order(frames: int, tokens_per_frame: int, sp: int) -> torch.Tensor:
    """pi: position in the all-to-all's output -> index in the one-rank sequence [clean; noisy],
    built by laying out each rank's local [clean slice; noisy slice] and concatenating them."""
    local, order = frames // sp, []
    for rank in range(sp):
        for noisy in (0, 1):
            for f in range(rank * local, (rank + 1) * local):
                start = (noisy * frames + f) * tokens_per_frame
                order.extend(range(start, start + tokens_per_frame))
    return torch.tensor(order)


@pytest.mark.parametrize("frames,chunk,tpf,sp", [(8, 2, 3, 2), (12, 2, 2, 3), (8, 1, 2, 4), (16, 4, 1, 2)])
def test_index_map_mask_equals_the_permuted_one_rank_mask(frames, chunk, tpf, sp):
    one = TeacherForcingLayout(frames, chunk, tpf, text_tokens=4)
    split = TeacherForcingLayout(frames, chunk, tpf, text_tokens=4, sp=sp)
    n = 2 * frames * tpf
    pi = post_exchange_order(frames, tpf, sp)
    reference = dense_mask(one.self_mask(), n, n, CPU)[pi][:, pi]  # permute the data's mask instead
    assert torch.equal(dense_mask(split.self_mask(), n, n, CPU), reference)
    assert int(reference.sum()) == split.attended_pairs()


def test_layout_splits_only_into_whole_chunks():
    layout = TeacherForcingLayout(12, 2, 4, 6, sp=3)
    assert layout.local_frames == 4 and layout.frame_range(2) == (8, 12)
    with pytest.raises(ValueError, match="2 sequence-parallel ranks"):
        TeacherForcingLayout(12, 4, 4, 6, sp=2)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("latents"),
                      {"a": ("train", [5, 4]), "b": ("train", [9]), "c": ("train", [3, 6, 2, 8])})


def test_windows_are_whole_multiples_of_sp_chunks_and_parts_make_the_window(cache):
    one = LatentSamples(cache, "train", chunk=2, shot_offset=8)
    three = LatentSamples(cache, "train", chunk=2, shot_offset=8, align=6)
    assert [one.frames(s) for s in one.sample_ids] == [8, 8, 18]
    assert three.sample_ids == ["a", "b", "c"] and three.window("a", 64, None) == (0, 6)
    for i in range(6):
        whole = three.load("c", 12, generator_for(0, "w", i))
        assert whole.latents.shape[1] == whole.window_frames == 12
        parts = [three.load("c", 12, generator_for(0, "w", i), (r, 3)) for r in range(3)]
        assert all(p.window_frames == 12 and p.latents.shape[1] == 4 for p in parts)
        assert torch.equal(torch.cat([p.latents for p in parts], dim=1), whole.latents)
        assert torch.equal(torch.cat([p.positions for p in parts]), whole.positions)
        assert torch.equal(torch.cat([p.shot_of_frame for p in parts]), whole.shot_of_frame)
        assert all(torch.equal(p.text, whole.text) for p in parts)
    with pytest.raises(ValueError, match="chunk"):
        LatentSamples(cache, "train", chunk=2, shot_offset=8, align=5)


@pytest.mark.parametrize("change,message", [
    ({"nproc": 2, "sp": 3}, "must divide nproc"),
    ({"nproc": 4, "sp": 4}, "must divide the 2 attention heads"),
    ({"nproc": 2, "sp": 2, "max_latent_frames": 6}, "multiple of sp x chunk_frames"),
    ({"nproc": 3, "sp": 3, "model": "tiny-6h", "max_latent_frames": 12,
      "error_recycling": {"enabled": True, "position_buckets": 4}}, "position_buckets"),
    ({"error_recycling": {"clean_prob": 1.5}}, "probability"),
])
def test_config_that_cannot_split_is_refused_before_any_work(change, message):
    base = {"chunk_frames": 2, "max_latent_frames": 8}
    with pytest.raises(ConfigError, match=message):
        from_mapping(TrainARConfig, {**base, **change}, "train_ar")
    split = from_mapping(TrainARConfig, {**base, "nproc": 4, "sp": 2}, "train_ar")
    assert split.parallel.dp_size == 2 and split.global_batch == 2 * split.grad_accum


def test_position_buckets_of_a_rank_hold_exactly_its_chunks():
    """With buckets a multiple of P, every chunk a rank holds falls in that rank's buckets, whatever
    the window length (a whole number of P chunks)."""
    for sp, buckets in ((1, 4), (2, 4), (3, 6), (2, 8)):
        for chunks in range(sp, 8 * sp + 1, sp):
            for rank in range(sp):
                own = range(rank * buckets // sp, (rank + 1) * buckets // sp)
                local = chunks // sp
                assert all(position_bucket(c, chunks, buckets) in own for c in range(rank * local, (rank + 1) * local))


def test_buffer_fills_then_overwrites_the_drawn_slot_and_samples_by_draw():
    buf = ErrorBuffer(range(2, 4), timestep_buckets=5, capacity=3, dtype=torch.float32)
    for i in range(3):
        buf.add(2, 1, torch.full((2,), float(i)), slot_draw=0.0)
    assert len(buf) == 3 and buf.sample(2, 1, 0.99).tolist() == [2.0, 2.0]
    buf.add(2, 1, torch.full((2,), 9.0), slot_draw=0.5)  # full: slot int(0.5 * 3) = 1 is replaced
    assert [float(e[0]) for e in buf.entries[(2, 1)]] == [0.0, 9.0, 2.0]
    assert buf.sample(2, 0, 0.3) is None and buf.sample_position(3, 0.3) is None
    buf.add(2, 4, torch.full((2,), 7.0), slot_draw=0.0)
    pooled = [float(buf.sample_position(2, u)[0]) for u in (0.0, 0.3, 0.6, 0.9)]
    assert pooled == [0.0, 9.0, 2.0, 7.0]  # timestep 1's entries, then timestep 4's
    with pytest.raises(ValueError, match="not one of this rank's"):
        buf.add(0, 1, torch.zeros(2), 0.0)
    again = ErrorBuffer(range(2, 4), 5, 3, torch.float32)
    again.load_state_dict(buf.state_dict("latent"), "latent")
    assert again.entries.keys() == buf.entries.keys()
    assert all(torch.equal(torch.stack(again.entries[k]), torch.stack(buf.entries[k])) for k in buf.entries)
    assert buf.total_capacity == 2 * 5 * 3


def test_injection_probabilities_and_modulation():
    cfg = ErrorRecyclingConfig(enabled=True, clean_prob=0.2, context_prob=0.9, latent_prob=0.5, noise_prob=0.1,
                               modulate=0.3)
    draws = [InjectionDraws.draw(cfg, 4, generator_for(0, "er", i)) for i in range(4000)]
    rate = {k: sum(getattr(d, k) for d in draws) / len(draws) for k in ("clean", "context", "latent", "noise")}
    assert rate["clean"] == pytest.approx(0.2, abs=0.03)
    assert rate["context"] == pytest.approx(0.8 * 0.9, abs=0.03)
    assert rate["latent"] == pytest.approx(0.8 * 0.5, abs=0.03)
    assert rate["noise"] == pytest.approx(0.8 * 0.1, abs=0.02)
    assert not any(d.clean and (d.context or d.latent or d.noise) for d in draws)
    scales = torch.stack([d.scale for d in draws])
    assert 0.7 <= float(scales.min()) < 0.71 and 1.29 < float(scales.max()) <= 1.3


def test_recycler_records_its_chunks_and_injects_scaled_entries():
    """A rank of 2 holds position buckets 2..3 of 4; the errors it records land in the bucket of their
    chunk and timestep, and an injection adds the drawn entry times the drawn factor."""
    cfg = ErrorRecyclingConfig(enabled=True, timestep_buckets=10, position_buckets=4, entries_per_bucket=4,
                               store_dtype="float32")
    r = ErrorRecycler(cfg, sp_rank=1, sp=2, num_train_timesteps=1000)
    latent = torch.arange(2 * 4 * 1.0).view(1, 1, 4, 2, 1)  # chunks 2 and 3 of 4, 2 frames each
    r.record(("train", 0, 0), [2, 3], 4, [150, 980], 2, latent, -latent, seed=0)
    r.commit(0)
    assert set(r.latent.entries) == {(2, 1), (3, 9)} and set(r.noise.entries) == {(2, 1), (3, 9)}
    assert torch.equal(r.latent.entries[(3, 9)][0], latent[0, :, 2:4])
    draws = InjectionDraws(False, True, True, False, torch.zeros(3, 4), torch.full((3, 4), 2.0))
    ctx, lat, noise = r.inject(draws, 1, [2, 3], 4, [150, 500], 2, torch.zeros(1, 1, 4, 2, 1))
    assert noise is None
    assert torch.equal(ctx, 2 * latent)  # context: any timestep of the chunk's position
    assert torch.equal(lat[:, :, :2], 2 * latent[:, :, :2]) and not lat[:, :, 2:].any()  # (3, 5) is empty
    assert r.take_injection_counts() == {"context": 2, "latent": 1, "noise": 0}
