import numpy as np
import pandas as pd
import pytest
import torch

from longlive_core.config import ConfigError, from_mapping
from longlive_core.iqa.metrics import (
    IQAConfig,
    QualityMetric,
    build_maniqa,
    keeps,
    load_state_dict,
    maniqa_architecture,
)
from longlive_core.iqa.motion import motion_score
from longlive_core.iqa.score import _aggregate, sample_positions, score_shots
from longlive_core.parallel import make_executor
from longlive_core.shots.clips import clip_frames_at, read_clip
from longlive_core.video.synth import ShotSpec, render_shot

from .helpers.shot_clips import write_shots


def test_sample_positions_leave_room_for_the_motion_pair():
    assert sample_positions(1, 3) == [0]
    assert sample_positions(2, 3) == [0]
    assert sample_positions(25, 3) == [0, 12, 23]
    assert max(sample_positions(100, 7)) == 98


def test_aggregate_worst_follows_the_direction():
    v = np.array([1.0, 5.0, 3.0])
    assert _aggregate(v, "mean", True) == 3.0 and _aggregate(v, "median", True) == 3.0
    assert _aggregate(v, "worst", True) == 5.0 and _aggregate(v, "worst", False) == 1.0


def test_aggregate_leaves_out_the_frames_the_metric_could_not_score():
    v = np.array([np.nan, 1.0, 5.0, np.nan])
    assert _aggregate(v, "mean", True) == 3.0 and _aggregate(v, "worst", True) == 5.0
    assert _aggregate(v, "worst", False) == 1.0 and _aggregate(v, "median", False) == 3.0
    assert np.isnan(_aggregate(np.array([np.nan, np.nan]), "mean", True))


def test_motion_score_separates_static_from_moving():
    frames = list(render_shot(ShotSpec(6, 0.3, "square", 1), 160, 96))
    moving = motion_score([(frames[0], frames[1]), (frames[3], frames[4])], 128)
    static = motion_score([(frames[0], frames[0].copy())], 128)
    assert static < 0.01 < moving


def test_maniqa_without_weights_is_an_error_that_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="maniqa_checkpoint .*nope.pt' is not a file.*ckpt_koniq10k.pt"):
        from_mapping(IQAConfig, {"metric": "maniqa", "maniqa_checkpoint": str(tmp_path / "nope.pt")}, "iqa_filter")
    with pytest.raises(ConfigError, match="thresholds has no entry"):
        from_mapping(IQAConfig, {"metric": "piqe", "thresholds": {"maniqa": 0.3}}, "iqa_filter")


def test_piqe_direction_comes_from_pyiqa():
    metric = QualityMetric(IQAConfig(), torch.device("cpu"))
    assert metric.lower_better and keeps(40.0, 50.0, True) and not keeps(60.0, 50.0, True)
    scores = metric(np.random.default_rng(0).integers(0, 255, (2, 96, 128, 3), dtype=np.uint8))
    assert scores.shape == (2,) and np.all((scores >= 0) & (scores <= 100))


def test_a_uniform_frame_is_one_the_metric_cannot_score():
    """PIQE divides by a frame's brightest pixel (0/0 on black) and has no block to judge on any uniform
    frame; both are NaN, whatever the frames batched with them."""
    metric = QualityMetric(IQAConfig(), torch.device("cpu"))
    textured = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    black, grey = np.zeros_like(textured), np.full_like(textured, 128)
    scores = metric(np.stack([black, textured, grey]))
    assert np.isnan(scores[0]) and np.isnan(scores[2]) and 0 <= scores[1] <= 100
    assert scores[1] == metric(textured[None])[0]


def fade_in(frames: list[np.ndarray], over: int) -> list[np.ndarray]:
    return [(f * min(1.0, i / over)).astype(np.uint8) for i, f in enumerate(frames)]


def test_a_fade_from_black_is_scored_on_its_scorable_frames_and_a_black_shot_is_rejected_as_unscorable(tmp_path):
    content = list(render_shot(ShotSpec(13, 0.3, "circle", 1), 160, 96))
    shots, clips = write_shots(tmp_path, {"fades/in.mp4": [fade_in(content, 4), [np.zeros_like(content[0])] * 13]})
    cfg = from_mapping(IQAConfig, {"thresholds": {"piqe": 100.0}}, "iqa_filter")
    out = score_shots(shots, clips, cfg, tmp_path / "state", make_executor("local", 1))
    fade, black = out.scores.itertuples(index=False)
    assert sample_positions(13, 3) == [0, 6, 11]  # the fade's first sampled frame is its black one
    frames = clip_frames_at(read_clip(clips, fade.clip_shard, fade.clip_member), [6, 11])
    expected = QualityMetric(cfg, torch.device("cpu"))(np.stack([frames[6], frames[11]])).mean()
    assert (fade.iqa_frames, fade.iqa_unscorable) == (3, 1)
    assert fade.iqa_score == pytest.approx(float(expected), rel=1e-6) and fade.kept and fade.reject_reason == ""
    assert (black.iqa_frames, black.iqa_unscorable) == (3, 3) and np.isnan(black.iqa_score) and not black.kept
    assert black.reject_reason == ("unscorable: piqe could score none of the shot's 3 sampled frames (a uniform "
                                   "frame, such as a black one, has no quality to measure)")
    assert out.counts["rejected_unscorable"] == 1 and out.counts["rejected_quality"] == 0
    assert out.counts["unscorable_frames"] == 4 and out.counts["iqa_score_mean"] == fade.iqa_score
    again = score_shots(shots, clips, cfg, tmp_path / "state", make_executor("local", 1))
    assert again.counts["scored"] == 0  # the counts of unscorable frames come back from the cache
    pd.testing.assert_frame_equal(again.scores, out.scores)


@pytest.mark.slow
def test_maniqa_loads_offline_from_one_checkpoint(tmp_path):
    """A randomly initialised MANIQA written to disk, loaded back through the offline path."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = maniqa_architecture(1).eval()
    ckpt = tmp_path / "maniqa.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(ckpt))
    pt = tmp_path / "maniqa.pt"
    torch.save({"params": ref.state_dict()}, pt)
    assert load_state_dict(pt).keys() == load_state_dict(ckpt).keys()

    cfg = from_mapping(IQAConfig, {"metric": "maniqa", "maniqa_checkpoint": str(ckpt), "crops": 1}, "iqa_filter")
    metric = QualityMetric(cfg, torch.device("cpu"))
    assert metric.lower_better is False
    frame = np.random.default_rng(1).integers(0, 255, (1, 96, 128, 3), dtype=np.uint8)
    with torch.inference_mode():
        x = torch.from_numpy(frame).permute(0, 3, 1, 2).float() / 255
        torch.manual_seed(2)
        expected = ref(x).reshape(-1).numpy()
    torch.manual_seed(2)
    got = metric(frame)
    np.testing.assert_allclose(got, expected, rtol=1e-5)  # the same weights: the same score
    bad = tmp_path / "bad.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2)}, str(bad))
    with pytest.raises(ValueError, match="does not fit MANIQA"):
        build_maniqa(bad, 1)


def test_scores_every_shot_once_and_thresholds_recut_without_rescoring(demo_shots, tmp_path):
    shots, clips = demo_shots
    cfg = from_mapping(IQAConfig, {}, "iqa_filter")
    inline = make_executor("local", 1)
    out = score_shots(shots, clips, cfg, tmp_path / "state", inline)
    s = out.scores
    assert len(s) == len(shots) and out.counts["scored"] == len(shots)  # every usable shot, exactly once
    pd.testing.assert_frame_equal(s[shots.columns], shots)
    assert (s["iqa_metric"] == "piqe").all() and s["motion_score"].gt(0).all()
    assert (s["kept"] == (s["iqa_score"] <= 50.0)).all()
    median = float(s["iqa_score"].median())
    strict = from_mapping(IQAConfig, {"thresholds": {"piqe": median}, "min_motion": 0.0}, "iqa_filter")
    again = score_shots(shots, clips, strict, tmp_path / "state", inline)
    assert again.counts["scored"] == 0
    assert (again.scores["kept"] == (again.scores["iqa_score"] <= median)).all()
    assert again.scores.loc[~again.scores["kept"], "reject_reason"].str.startswith("quality: piqe").all()
    moving = from_mapping(IQAConfig, {"thresholds": {"piqe": 100.0}, "min_motion": 1e6}, "iqa_filter")
    static = score_shots(shots, clips, moving, tmp_path / "state", inline)
    assert static.counts["scored"] == 0 and static.counts["rejected_static"] == len(shots)
    everything = from_mapping(IQAConfig, {"thresholds": {"piqe": 100.0}}, "iqa_filter")
    kept_all = score_shots(shots, clips, everything, tmp_path / "state", inline)
    assert kept_all.counts["scored"] == 0 and kept_all.scores["kept"].all()  # the demo's shots are no copies
    assert kept_all.counts["duplicate_groups"] == 0 and kept_all.counts["unscorable_frames"] == 0
    more = from_mapping(IQAConfig, {"frames_per_shot": 2}, "iqa_filter")
    assert score_shots(shots, clips, more, tmp_path / "state", inline).counts["scored"] == len(shots)


def test_maniqa_under_bf16_autocast_tracks_fp32_and_is_scored_apart(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ckpt = tmp_path / "maniqa.safetensors"
    save_file({k: v.contiguous() for k, v in maniqa_architecture(1).state_dict().items()}, str(ckpt))
    base = {"metric": "maniqa", "maniqa_checkpoint": str(ckpt), "crops": 1}
    fp32 = from_mapping(IQAConfig, base, "iqa_filter")
    bf16 = from_mapping(IQAConfig, {**base, "precision": "bf16"}, "iqa_filter")
    # one frame: on a CPU without AVX-512 bf16 is emulated and MANIQA's bf16 pass took ~50 s a frame (237 s for 4)
    frames = np.random.default_rng(3).integers(0, 255, (1, 96, 128, 3), dtype=np.uint8)
    scores = {}
    for name, cfg in (("fp32", fp32), ("bf16", bf16)):
        torch.manual_seed(2)
        scores[name] = QualityMetric(cfg, torch.device("cpu"))(frames)
    assert not np.array_equal(scores["bf16"], scores["fp32"])  # autocast did run in bf16
    np.testing.assert_allclose(scores["bf16"], scores["fp32"], atol=0.02)
    assert fp32.score_params() != bf16.score_params()  # cached fp32 scores are not reused for bf16
    with pytest.raises(ConfigError, match="precision bf16 applies to MANIQA"):
        from_mapping(IQAConfig, {"metric": "piqe", "precision": "bf16"}, "iqa_filter")
