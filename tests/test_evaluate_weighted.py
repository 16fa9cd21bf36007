"""VBench's weighted dimensions from local checkpoints: MUSIQ's imaging quality and DINO's subject
consistency load offline (random weights stand in for the real ones), compute what their formulas
say frame by frame, restart at every shot, and refuse a checkpoint of another network."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from longlive_core.config import ConfigError, from_mapping
from longlive_core.evaluate.weighted import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    WeightPaths,
    build_metrics,
    dino_architecture,
    musiq_architecture,
)

pytestmark = pytest.mark.slow


def saved(net: torch.nn.Module, path) -> str:
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return str(path)


def frames(n: int, seed: int, size=(48, 80)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
    return [np.clip(base.astype(int) + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8) for _ in range(n)]


def test_imaging_quality_is_musiqs_mean_over_frames_over_100(tmp_path):
    torch.manual_seed(0)
    ref = musiq_architecture().eval()
    paths = from_mapping(WeightPaths, {"musiq": saved(ref, tmp_path / "musiq.safetensors")}, "evaluate.weights")
    [metric], _, skipped = build_metrics(paths, torch.device("cpu"))
    assert metric.name == "imaging_quality" and "subject_consistency" in skipped
    video = frames(5, 1)
    metric.start([0])
    for rgb in video:
        metric.add(rgb)
    with torch.inference_mode():
        x = torch.from_numpy(np.stack(video)).permute(0, 3, 1, 2).float() / 255.0
        expected = float(ref(x).mean()) / 100.0
    assert metric.result() == pytest.approx(expected, rel=1e-5)
    assert metric.weights["path"].endswith("musiq.safetensors") and len(metric.weights["sha256"]) > 8


def test_subject_consistency_follows_vbenchs_formula_shot_by_shot(tmp_path):
    torch.manual_seed(0)
    ref = dino_architecture().eval()
    paths = from_mapping(WeightPaths, {"dino": saved(ref, tmp_path / "dino.safetensors")}, "evaluate.weights")
    [metric], _, _ = build_metrics(paths, torch.device("cpu"))
    still = frames(1, 2) * 3  # one frame three times: every similarity is 1
    metric.start([0])
    for rgb in still:
        metric.add(rgb)
    assert metric.result() == pytest.approx(1.0, abs=1e-5)

    shots = [frames(3, 3), frames(3, 4)]  # two shots: the second's frames compare with its own first
    metric.start([0, 3])
    for rgb in shots[0] + shots[1]:
        metric.add(rgb)
    got = metric.result()

    def features(rgb):
        x = torch.from_numpy(rgb).permute(2, 0, 1)[None].float()
        x = torch.nn.functional.interpolate(x, size=(224, 373), mode="bilinear", align_corners=False)
        x = x.round().clamp(0, 255) / 255.0
        x = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
        with torch.inference_mode():
            return torch.nn.functional.normalize(ref(x[..., :224, :368]), dim=-1)[0]

    sims = []
    for shot in shots:
        f = [features(rgb) for rgb in shot]
        sims += [0.5 * (max(0.0, float(f[i] @ f[i - 1])) + max(0.0, float(f[i] @ f[0]))) for i in range(1, len(f))]
    assert got == pytest.approx(sum(sims) / len(sims), rel=1e-5)


def test_missing_or_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        from_mapping(WeightPaths, {"dino": str(tmp_path / "nope.pth")}, "evaluate.weights")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2)}, str(foreign))
    with pytest.raises(ConfigError, match="does not fit imaging_quality"):
        build_metrics(WeightPaths(musiq=str(foreign)), torch.device("cpu"))
    metrics, fvd, skipped = build_metrics(WeightPaths(), torch.device("cpu"))
    assert not metrics and fvd is None and set(skipped) == {"imaging_quality", "subject_consistency", "fvd"}
    assert "evaluate.weights.dino is null" in skipped["subject_consistency"]


def test_the_evaluate_stage_feeds_a_videos_frames_to_the_weighted_metrics(tmp_path):
    from longlive_core.evaluate.config import EvaluateConfig
    from longlive_core.evaluate.suite import score_video
    from longlive_core.shots.detect import ShotsConfig
    from longlive_core.video.synth import encode_frames

    torch.manual_seed(0)
    paths = WeightPaths(musiq=saved(musiq_architecture(), tmp_path / "m.safetensors"),
                        dino=saved(dino_architecture(), tmp_path / "d.safetensors"))
    metrics, _, skipped = build_metrics(paths, torch.device("cpu"))
    video = tmp_path / "v.mp4"
    encode_frames(video, frames(4, 5) + frames(4, 6), fps=24, width=80, height=48, crf=0)
    side = {"frames": 8, "fps": 24.0, "denoise_fps": 1.0, "end_to_end_fps": 1.0,
            "shots": [{"video_frames": 4, "prompts": ["a"]}, {"video_frames": 4, "prompts": ["b"]}]}
    scores = score_video(video, side, from_mapping(EvaluateConfig, {"suite": {"x": "a\n"}}, "evaluate"),
                         from_mapping(ShotsConfig, {}, "shots"), tmp_path / "sheet.png", metrics)
    assert set(skipped) == {"fvd"} and 0 < scores["subject_consistency"] <= 1 and np.isfinite(scores["imaging_quality"])
