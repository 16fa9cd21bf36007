"""evaluate's metrics on crafted videos whose answer is known, the verdict, and the registry lookup."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from longlive_core.config import ConfigError
from longlive_core.evaluate.config import VERDICT_METRICS, EvaluateConfig
from longlive_core.evaluate.metrics import VideoStats, shot_switch
from longlive_core.evaluate.suite import score_video, suite_settings
from longlive_core.evaluate.verdict import (
    DEFAULT_MARGINS,
    SETTINGS_TAG,
    Champion,
    RegistryRead,
    VerdictRules,
    needs_rescoring,
    verdict,
)
from longlive_core.shots.detect import ShotsConfig, detect_cuts
from longlive_core.tracking.mlflow_run import RegistryError, StageRun, TrackingConfig
from longlive_core.video.synth import ShotSpec, VideoSpec, encode_frames, render_shot, write_video

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


SETTINGS = {"suite": "s", "seed": 0, "steps": [1000, 0], "kv": "bf16", "window": 6, "global_sink": 2,
            "shot_sink": 2, "recipe": "bf16", "kv_quant": None, "attention": "sdpa", "vae_dtype": "float32",
            "prompt_enhancement": None, "fvd_reference": None}
# what a CPU run of the tiny AR folder records beside its sampling (its sidecar's)
RAN_ON_CPU = {"recipe": "bf16", "kv_quant": None, "attention": "sdpa", "vae_dtype": "float32"}


def rules(**changes) -> VerdictRules:
    cfg = dataclasses.replace(EvaluateConfig(suite={"a": "x"}), **changes)
    cfg.validate("evaluate")
    return cfg.verdict_rules()


def champion(**scores) -> RegistryRead:
    return RegistryRead(Champion("m v1", scores, SETTINGS))


def test_the_verdict_passes_within_the_margins_fails_outside_and_passes_with_no_champion():
    margins = {"temporal_flickering": 0.01, "shot_switch_accuracy": 0.1}
    theirs = champion(temporal_flickering=0.95, shot_switch_accuracy=0.8)
    ours = {"temporal_flickering": 0.945, "shot_switch_accuracy": 0.75, "motion": 1.0}
    close = verdict(ours, SETTINGS, theirs, rules(margins=margins))
    assert close["passed"] and close["champion"] == "m v1"
    worse = verdict({**ours, "shot_switch_accuracy": 0.6}, SETTINGS, theirs, rules(margins=margins))
    assert not worse["passed"] and any("shot_switch_accuracy" in r and "worse" in r for r in worse["reasons"])
    none = verdict(ours, SETTINGS, RegistryRead(), rules(registered_model="m"))
    assert none["passed"] and none["reasons"][-1] == "no champion registered as m: nothing to compare with"
    # FVD is lower-is-better, its margin in its own unit
    fvd = champion(fvd=100.0)
    assert verdict({"fvd": 120.0, "motion": 1.0}, SETTINGS, fvd, rules())["passed"]  # within the default 25
    assert not verdict({"fvd": 130.0, "motion": 1.0}, SETTINGS, fvd, rules())["passed"]
    assert verdict({"fvd": 60.0, "motion": 1.0}, SETTINGS, fvd, rules())["passed"]


def test_vbenchs_dynamic_degree_joins_the_verdict_where_its_weights_ran():
    from longlive_core.evaluate.suite import vbench_verdict_scores

    ran = {"scores": {"dynamic_degree": 0.5, "temporal_flickering": 0.97}, "aggregate": {"total": None}}
    assert vbench_verdict_scores(ran) == {"dynamic_degree": 0.5}
    assert vbench_verdict_scores({"scores": {}, "aggregate": None}) == {}  # no RAFT weights: not scored
    theirs = champion(dynamic_degree=1.0)
    assert not verdict({"dynamic_degree": 0.5, "motion": 1.0}, SETTINGS, theirs, rules())["passed"]  # one went still
    assert verdict({"dynamic_degree": 0.95, "motion": 1.0}, SETTINGS, theirs, rules())["passed"]


def test_a_registry_that_cannot_be_read_fails_the_verdict_and_never_reads_as_no_champion(tmp_path):
    """Tracking off, or a store that cannot be opened (it fails at once: no network timeout)."""
    ours = {"temporal_flickering": 0.99, "motion": 1.0}
    (tmp_path / "a-file").write_text("not a folder")
    for cfg in (TrackingConfig(enabled=False),
                TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/a-file/mlflow.db")):
        with StageRun(cfg, "evaluate", repo_root=tmp_path) as run:
            with pytest.raises(RegistryError) as caught:
                run.registered_alias("longlive-2.0", "champion")
        judged = verdict(ours, SETTINGS, RegistryRead(failure=str(caught.value)), rules())
        assert not judged["passed"] and judged["champion"] is None
        assert "the MLflow registry could not be read" in judged["reasons"][-1]


def test_a_frozen_video_fails_on_the_motion_floor_whatever_the_champion(tmp_path):
    """66 grey frames in two shots: perfect flicker and consistency, and no motion."""
    grey = [np.full((H, W, 3), 120, np.uint8)] * 66
    path = tmp_path / "frozen.mp4"
    encode_frames(path, grey, 24, W, H)
    side = {"frames": 66, "fps": 24.0, "denoise_fps": 1.0, "end_to_end_fps": 1.0,
            "shots": [{"video_frames": 33, "prompts": ["a"]}, {"video_frames": 33, "prompts": ["b"]}]}
    cfg = EvaluateConfig(suite={"a": "x"})
    scores = score_video(path, side, cfg, ShotsConfig(), tmp_path / "sheet.png", [])
    assert scores["temporal_flickering"] == 1.0 and scores["within_shot_consistency"] == 1.0
    assert scores["motion"] < 1e-3
    against = champion(temporal_flickering=0.97, within_shot_consistency=0.80, shot_switch_accuracy=0.0)
    for registry in (against, RegistryRead()):  # a first release is held to the floor too
        judged = verdict({k: scores[k] for k in (*VERDICT_METRICS, "motion")}, SETTINGS, registry,
                         rules(min_motion=0.01))
        assert not judged["passed"] and "a still video" in judged["reasons"][0]
    moving = shot(24, 0.2, 1)
    encode_frames(tmp_path / "moving.mp4", moving, 24, W, H)
    side_moving = {**side, "frames": 24, "shots": [{"video_frames": 24, "prompts": ["a"]}]}
    assert score_video(tmp_path / "moving.mp4", side_moving, cfg, ShotsConfig(), tmp_path / "s.png", [])[
        "motion"] > 0.01


def test_margins_merge_over_the_defaults_and_a_metric_one_side_lacks_fails_unless_optional():
    partial = rules(margins={"temporal_flickering": 0.2})
    assert partial.margins["temporal_flickering"] == 0.2
    assert partial.margins["within_shot_consistency"] == DEFAULT_MARGINS["within_shot_consistency"]
    ours = {"temporal_flickering": 0.9, "within_shot_consistency": 0.5, "motion": 1.0}
    # within_shot_consistency is still compared with its default margin though the user gave one margin
    judged = verdict(ours, SETTINGS, champion(temporal_flickering=0.95, within_shot_consistency=0.8), partial)
    assert not judged["passed"] and any(r.startswith("within_shot_consistency") and "worse" in r
                                        for r in judged["reasons"])
    lacking = champion(temporal_flickering=0.9, within_shot_consistency=0.5)  # no imaging quality then
    ours_iq = {**ours, "imaging_quality": 0.6}
    judged = verdict(ours_iq, SETTINGS, lacking, rules())
    assert not judged["passed"] and "imaging_quality: the champion has no score: cannot be compared" in " ".join(
        judged["reasons"])
    assert verdict(ours_iq, SETTINGS, lacking, rules(optional_metrics=("imaging_quality",)))["passed"]
    with pytest.raises(ConfigError, match="unknown metric"):
        rules(margins={"sharpness": 0.1})


def test_scores_made_under_other_settings_are_not_compared_unless_the_champion_is_rescored():
    theirs = RegistryRead(Champion("m v1", {"temporal_flickering": 0.5}, {**SETTINGS, "steps": [1000, 500, 0]}))
    judged = verdict({"temporal_flickering": 0.9, "motion": 1.0}, SETTINGS, theirs, rules())
    assert not judged["passed"] and "other settings (steps)" in judged["reasons"][-1]
    # the cache's quantization and the attention kernel change the frames: scores under others are not compared
    nvfp4 = {**SETTINGS, "kv": "nvfp4", "kv_quant": {"smooth_keys": True, "four_over_six": None, "format": "nvfp4"}}
    four_over_six = RegistryRead(Champion("m v1", {"temporal_flickering": 0.5},
                                          {**nvfp4, "kv_quant": {**nvfp4["kv_quant"], "four_over_six": "mse"}}))
    judged = verdict({"temporal_flickering": 0.9, "motion": 1.0}, nvfp4, four_over_six, rules())
    assert not judged["passed"] and "other settings (kv_quant)" in judged["reasons"][-1]
    fp8 = RegistryRead(Champion("m v1", {"temporal_flickering": 0.5}, {**SETTINGS, "attention": "fp8"}))
    assert "other settings (attention)" in verdict({"temporal_flickering": 0.9, "motion": 1.0}, SETTINGS, fp8,
                                                   rules())["reasons"][-1]
    before = {k: v for k, v in nvfp4.items() if k not in ("recipe", "kv_quant", "attention", "vae_dtype")}
    assert needs_rescoring({"temporal_flickering": 0.9}, nvfp4, Champion("m v1", {"temporal_flickering": 0.5}, before),
                           rules())  # recorded before these settings were
    old = RegistryRead(Champion("m v1", {"temporal_flickering": 0.5}, None))  # recorded before settings were
    assert not verdict({"temporal_flickering": 0.9, "motion": 1.0}, SETTINGS, old, rules())["passed"]
    assert needs_rescoring({"temporal_flickering": 0.9}, SETTINGS, old.champion, rules())
    assert not needs_rescoring({"temporal_flickering": 0.9}, SETTINGS, champion(temporal_flickering=0.5).champion,
                               rules())


def test_the_champion_alias_is_read_from_the_mlflow_registry(tmp_path):
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    with StageRun(cfg, "evaluate", repo_root=tmp_path) as run:
        assert run.registered_alias("longlive-2.0", "champion") is None  # no such model yet
        run.log_metrics({"temporal_flickering": 0.93})
        run.set_tags({SETTINGS_TAG: json.dumps(SETTINGS)})
        client = run._client
        client.create_registered_model("longlive-2.0")
        version = client.create_model_version("longlive-2.0", "runs:/x/bundle", run_id=run.run_id)
        assert run.registered_alias("longlive-2.0", "champion") is None  # no alias yet
        client.set_registered_model_alias("longlive-2.0", "champion", version.version)
        found = run.registered_alias("longlive-2.0", "champion")
        assert (found.version, found.metrics, json.loads(found.tags[SETTINGS_TAG])) == (
            "1", {"temporal_flickering": 0.93}, SETTINGS)
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


def test_a_champion_scored_under_other_settings_is_fetched_and_scored_again_under_these(tmp_path):
    """evaluate.rescore_champion: the champion's registered bundle is downloaded and its model
    scored by the candidate's own suite and settings, so the two are compared like for like."""
    import shutil

    from longlive_core.infer.engine import GenerateConfig
    from tasks import evaluate as stage

    from .helpers.ar_model import make_ar_model

    make_ar_model(tmp_path / "bundle" / "model", chunk_frames=2)
    cfg = EvaluateConfig(suite={"one": "0.4\ta red kite\n"}, rescore_champion=True, min_motion=0.0)
    generate = GenerateConfig(device="cpu", default_duration_s=0.4)  # the champion's folder would sample otherwise
    p = stage.Prepared(cfg, generate, ShotsConfig())
    # the candidate's
    ran = {"steps": [1000, 946, 854, 681, 0], "window": 6, "global_sink": 2, "shot_sink": 2, **RAN_ON_CPU}
    settings = suite_settings(cfg, generate, ran, None)
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    with StageRun(tracking, "package", repo_root=tmp_path) as run:  # the champion, as package registered it
        run.log_metrics({"temporal_flickering": 0.5})
        run.set_tags({SETTINGS_TAG: json.dumps({**settings, "steps": [1000, 0]})})
        assert run.register("longlive-2.0", tmp_path / "bundle", ["champion"], {}, "identity-1")
    shutil.rmtree(tmp_path / "bundle")  # only the registry's copy is left
    candidate = {"aggregate": {"temporal_flickering": 0.9, "motion": 1.0}, "settings": settings}
    with StageRun(tracking, "evaluate", repo_root=tmp_path) as run:
        registry = stage.read_champion(run, p, candidate, "cpu")
        assert registry.champion.rescored and registry.champion.settings == settings
        assert 0 < registry.champion.scores["temporal_flickering"] <= 1 and "motion" not in registry.champion.scores
        judged = verdict(candidate["aggregate"], settings, registry, cfg.verdict_rules())
        assert judged["champion"] == "longlive-2.0 v1 (rescored here)"
        without = stage.read_champion(run, stage.Prepared(dataclasses.replace(cfg, rescore_champion=False), generate,
                                                          ShotsConfig()), candidate, "cpu")
        assert not without.champion.rescored
        assert not verdict(candidate["aggregate"], settings, without, cfg.verdict_rules())["passed"]


def test_prompt_enhancement_is_part_of_the_settings_a_verdict_compares():
    from longlive_core.infer.engine import GenerateConfig
    from longlive_core.infer.enhance import template_digest

    cfg = EvaluateConfig(suite={"one": "0.4\ta red kite\n"})
    ran = {"steps": [1000, 0], "window": 6, "global_sink": 2, "shot_sink": 2, **RAN_ON_CPU}
    plain = suite_settings(cfg, GenerateConfig(), ran, None)
    enhanced = suite_settings(cfg, GenerateConfig(enhance=True, enhance_examples=2), ran, None)
    assert plain["prompt_enhancement"] is None
    assert enhanced["prompt_enhancement"] == {"model": "tiny", "template": template_digest(), "examples": 2,
                                              "max_new_tokens": 512}
