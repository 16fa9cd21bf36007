"""evaluate's metrics on crafted videos whose answer is known, the verdict, and the registry lookup."""
from __future__ import annotations

import json

import numpy as np
import pytest

from longlive_core.evaluate.metrics import VideoStats, shot_switch
from longlive_core.evaluate.verdict import verdict
from longlive_core.shots.detect import ShotsConfig, detect_cuts
from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig
from longlive_core.video.synth import ShotSpec, VideoSpec, render_shot, write_video

W, H = 96, 64


def shot(frames: int, hue: float, seed: int) -> list[np.ndarray]:
    return list(render_shot(ShotSpec(frames, hue, "circle", seed), W, H))


def stats_of(frames: list[np.ndarray], starts: list[int]) -> VideoStats:
    stats = VideoStats(starts)
    for f in frames:
        stats.add(f)
    return stats


def test_temporal_flickering_is_vbenchs_formula_and_falls_for_a_flickering_video():
    grey = np.full((H, W, 3), 100, np.uint8)
    brighter = np.full((H, W, 3), 110, np.uint8)
    assert stats_of([grey, brighter, grey], [0]).temporal_flickering() == pytest.approx((255 - 10) / 255)
    steady = shot(24, 0.3, 1)
    flicker = [np.clip(f.astype(int) + (25 if i % 2 else 0), 0, 255).astype(np.uint8) for i, f in enumerate(steady)]
    assert stats_of(flicker, [0]).temporal_flickering() < stats_of(steady, [0]).temporal_flickering() - 0.05
    # a cut between shots is not flicker: the pair across it is left out
    two = shot(12, 0.1, 1) + shot(12, 0.6, 2)
    assert stats_of(two, [0, 12]).temporal_flickering() > stats_of(two, [0]).temporal_flickering()


def test_within_shot_consistency_falls_when_a_shot_drifts_into_noise():
    steady = shot(24, 0.3, 1)
    rng = np.random.default_rng(0)
    drifting = steady[:12] + [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(12)]
    good, bad = stats_of(steady, [0]).within_shot_consistency(), stats_of(drifting, [0]).within_shot_consistency()
    assert good > 0.8 and bad < good - 0.2


def test_shot_switch_scores_cuts_in_the_asked_place_and_penalises_missing_and_unasked_ones(tmp_path):
    path = tmp_path / "two_cuts.mp4"
    write_video(path, VideoSpec("two_cuts.mp4", (ShotSpec(30, 0.05, "circle", 1), ShotSpec(30, 0.55, "square", 2),
                                                 ShotSpec(30, 0.3, "circle", 3))), 24, W, H)
    cuts = detect_cuts(path, ShotsConfig(min_scene_len=4, min_shot_s=0.5), 24.0).cuts
    assert cuts == [30, 60]
    assert shot_switch(cuts, [30, 60], 4)["accuracy"] == 1.0
    assert shot_switch(cuts, [31, 58], 4)["accuracy"] == 1.0  # within the tolerance
    wrong = shot_switch(cuts, [45], 4)  # asked in the middle of a shot: a miss and two unasked cuts
    assert (wrong["hits"], wrong["missed"], wrong["unasked"], wrong["accuracy"]) == (0, 1, 2, 0.0)
    assert shot_switch(cuts, [30], 4)["accuracy"] == 0.5  # the right cut, and one nobody asked for
    assert shot_switch([], [], 4)["accuracy"] == 1.0


def test_the_verdict_passes_within_the_margins_fails_outside_and_passes_with_no_champion():
    margins = {"temporal_flickering": 0.01, "shot_switch_accuracy": 0.1}
    champion = {"temporal_flickering": 0.95, "shot_switch_accuracy": 0.8}
    close = verdict({"temporal_flickering": 0.945, "shot_switch_accuracy": 0.75}, champion, margins, "m v1", "-")
    assert close["passed"] and close["champion"] == "m v1"
    worse = verdict({"temporal_flickering": 0.95, "shot_switch_accuracy": 0.6}, champion, margins, "m v1", "-")
    assert not worse["passed"] and any("shot_switch_accuracy" in r and "worse" in r for r in worse["reasons"])
    none = verdict({"temporal_flickering": 0.1}, None, margins, "-", "no champion registered as m")
    assert none["passed"] and none["reasons"] == ["no champion registered as m: nothing to compare with"]


def test_the_champion_alias_is_read_from_the_mlflow_registry(tmp_path):
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    with StageRun(cfg, "evaluate", repo_root=tmp_path) as run:
        assert run.registered_alias("longlive-2.0", "champion") == (None, None)  # no such model yet
        run.log_metrics({"temporal_flickering": 0.93})
        client = run._client
        client.create_registered_model("longlive-2.0")
        version = client.create_model_version("longlive-2.0", "runs:/x/bundle", run_id=run.run_id)
        assert run.registered_alias("longlive-2.0", "champion") == (None, None)  # no alias yet
        client.set_registered_model_alias("longlive-2.0", "champion", version.version)
        assert run.registered_alias("longlive-2.0", "champion") == ("1", {"temporal_flickering": 0.93})
        assert run.active


def test_vbench_aggregation_on_crafted_results(tmp_path):
    from longlive_core.evaluate.vbench import DIMENSIONS, VBenchResultError, aggregate, read_results

    top = {n: d.high for n, d in DIMENSIONS.items()}
    assert aggregate(top)["total"] == pytest.approx(1.0)
    assert aggregate({n: d.low for n, d in DIMENSIONS.items()})["total"] == pytest.approx(0.0)
    # by hand: quality dimensions at half their range but dynamic degree at its top (weight 0.5),
    # semantic ones at a quarter: Quality = (6 x 0.5 + 0.5 x 1) / 6.5, Semantic = 0.25
    crafted = {n: d.low + (0.5 if d.group == "quality" else 0.25) * (d.high - d.low) for n, d in DIMENSIONS.items()}
    crafted["dynamic_degree"] = 1.0
    out = aggregate(crafted)
    assert out["quality"] == pytest.approx(3.5 / 6.5) and out["semantic"] == pytest.approx(0.25)
    assert out["total"] == pytest.approx((4 * 3.5 / 6.5 + 0.25) / 5) and out["missing"] == []
    # VBench's result files, split in two as separate runs write them; one dimension missing
    quality = {n: [v, []] for n, v in crafted.items() if DIMENSIONS[n].group == "quality"}
    semantic = {n: [v, []] for n, v in crafted.items() if DIMENSIONS[n].group == "semantic" and n != "scene"}
    (tmp_path / "a_eval_results.json").write_text(json.dumps(quality))
    (tmp_path / "b_eval_results.json").write_text(json.dumps(semantic))
    partial = aggregate(read_results(sorted(tmp_path.glob("*.json"))))
    assert partial["quality"] == pytest.approx(out["quality"])
    assert partial["semantic"] is None and partial["total"] is None and partial["missing"] == ["scene"]
    (tmp_path / "c_eval_results.json").write_text(json.dumps({"sharpness": [0.5, []]}))
    with pytest.raises(VBenchResultError, match="'sharpness' is not a VBench dimension"):
        read_results([tmp_path / "c_eval_results.json"])
