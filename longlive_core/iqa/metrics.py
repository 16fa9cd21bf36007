"""Image-quality metrics through pyiqa, built fully offline.

``piqe`` needs no weights (the demo's metric). ``maniqa`` (the paper's) is built from one local
checkpoint: pyiqa 0.1.16's MANIQA constructor always asks timm for an ImageNet ViT from the hub,
so the architecture is built with that download switched off and then every weight, the ViT's
included, is loaded from the checkpoint (safetensors, or a state dict read with weights_only).
The metric used is always the one asked for; a missing checkpoint is an error, never a fallback.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from longlive_core.config import ConfigError
from longlive_core.parallel import EXECUTORS

METRICS = ("piqe", "maniqa")


@dataclasses.dataclass(frozen=True)
class IQAConfig:
    metric: str = "piqe"
    maniqa_checkpoint: str | None = None  # e.g. models/maniqa/ckpt_koniq10k.pt
    frames_per_shot: int = 3
    crops: int = 20  # MANIQA's random crops per frame at evaluation (pyiqa uses 20)
    aggregate: str = "mean"  # mean | median | worst (over a shot's frames; worst follows the direction)
    batch_size: int = 16
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | bf16 (MANIQA under bf16 autocast: 5.2x faster on the H200, bench/RESULTS.md)
    executor: str = "local"  # local (processes here) | dask (params `dask`); tasks of batch_size frames
    workers: int = 1  # processes (local) or local-cluster workers (dask); one GPU each where there are some
    thresholds: dict[str, float] = dataclasses.field(default_factory=lambda: {"piqe": 50.0, "maniqa": 0.35})
    motion_width: int = 128  # optical flow runs on frames downscaled to this width
    min_motion: float = 0.0  # pixels per frame at motion_width; 0 keeps static shots
    dedup_hamming: int | None = 12  # bits (of 63) each hashed frame may differ by in near-duplicates; null: off

    def validate(self, where: str) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"{where}.metric must be one of {list(METRICS)}, got {self.metric!r}")
        if self.metric not in self.thresholds:
            raise ConfigError(f"{where}.thresholds has no entry for the metric {self.metric!r}")
        if self.aggregate not in ("mean", "median", "worst"):
            raise ConfigError(f"{where}.aggregate must be mean, median or worst")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{where}.device must be auto, cpu or cuda")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"{where}.precision must be fp32 or bf16, got {self.precision!r}")
        if self.precision == "bf16" and self.metric != "maniqa":
            raise ConfigError(f"{where}.precision bf16 applies to MANIQA's network; {self.metric} is computed in "
                              "fp32 (set precision: fp32)")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor must be one of {list(EXECUTORS)}, got {self.executor!r}")
        for key in ("frames_per_shot", "crops", "batch_size", "motion_width", "workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be >= 1")
        # 63: dedup.HASH_BITS, written out so that the stages reading this config need not import the hashing
        if self.dedup_hamming is not None and not 0 <= self.dedup_hamming <= 63:
            raise ConfigError(f"{where}.dedup_hamming must be between 0 and 63 (bits of a frame's hash), or null to "
                              f"keep near-duplicate shots; got {self.dedup_hamming}")
        if self.metric == "maniqa":
            ckpt = self.maniqa_checkpoint
            if not ckpt or not Path(ckpt).is_file():
                raise ConfigError(
                    f"{where}.maniqa_checkpoint {ckpt!r} is not a file. MANIQA needs its KonIQ weights "
                    "offline: fetch pyiqa's ckpt_koniq10k.pt on a machine with internet, put it under "
                    "models/maniqa/ and set this path (or use metric: piqe, which needs no weights)")

    def score_params(self) -> dict:
        """The params raw scores depend on (thresholds do not: changing them re-scores nothing)."""
        keys = ["metric", "frames_per_shot", "aggregate", "motion_width"]
        if self.metric == "maniqa":
            keys += ["crops", "precision"]  # bf16 moves the scores: they are scored again, not mixed
        return {k: getattr(self, k) for k in keys}


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle code
    for key in ("params", "state_dict", "model"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    return {k.removeprefix("module."): v for k, v in state.items()}


def maniqa_architecture(crops: int) -> torch.nn.Module:
    """MANIQA in pyiqa's KonIQ configuration (scale 0.8), randomly initialised, no download."""
    import timm
    from pyiqa.archs import maniqa_arch

    create = timm.create_model

    def offline_create(name, pretrained=False, **kw):
        return create(name, pretrained=False, **kw)

    with mock.patch.object(maniqa_arch.timm, "create_model", offline_create):
        return maniqa_arch.MANIQA(pretrained=False, pretrained_model_path=None, test_sample=crops, scale=0.8)


def build_maniqa(checkpoint: str | Path, crops: int) -> torch.nn.Module:
    net = maniqa_architecture(crops)
    missing, unexpected = net.load_state_dict(load_state_dict(checkpoint), strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not fit MANIQA: {len(missing)} missing keys (e.g. {missing[:3]}), "
                         f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    return net.eval()


def lower_is_better(metric: str) -> bool:
    """The metric's direction, as pyiqa records it (PIQE: lower is better; MANIQA: higher)."""
    import pyiqa

    return bool(pyiqa.default_model_configs.DEFAULT_CONFIGS[metric].get("lower_better", False))


def keeps(score: float, threshold: float, lower_better: bool) -> bool:
    return score <= threshold if lower_better else score >= threshold


class QualityMetric:
    """Scores RGB uint8 frames (N, H, W, 3); ``lower_better`` says the metric's direction.

    A frame it cannot score is NaN: one the metric gives no finite score (PIQE divides by the
    frame's brightest pixel, so a black frame is 0/0), and any uniform frame, which has no quality
    to measure (PIQE falls back to its constant, 100, with no block to judge; MANIQA would judge
    an empty picture). Fades from and to black hold such frames; the shot's score leaves them out.
    """

    def __init__(self, cfg: IQAConfig, device: torch.device):
        import pyiqa

        self.name, self.device, self.batch_size = cfg.metric, device, cfg.batch_size
        self.autocast = cfg.precision == "bf16"
        self.lower_better = lower_is_better(cfg.metric)
        if cfg.metric == "maniqa":
            self.net = build_maniqa(cfg.maniqa_checkpoint, cfg.crops).to(device)  # type: ignore[arg-type]
        else:
            self.net = pyiqa.create_metric(cfg.metric, device=device, as_loss=False)

    @torch.inference_mode()
    def __call__(self, frames: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(frames), self.batch_size):
            x = torch.from_numpy(frames[i:i + self.batch_size]).to(self.device)
            x = x.permute(0, 3, 1, 2).float().div_(255.0)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                y = self.net(x)
            out.append(y.reshape(-1).float().cpu().numpy())
        scores = np.concatenate(out) if out else np.zeros(0, np.float32)
        uniform = (frames == frames[:, :1, :1, :]).all(axis=(1, 2, 3))
        return np.where(np.isfinite(scores) & ~uniform, scores, np.float32(np.nan))

