"""VBench's dimensions that need pretrained weights, computed here from local files only.

- ``imaging_quality``: MUSIQ (pyiqa's architecture, VBench's SPAQ checkpoint ``musiq_spaq_ckpt``)
  on every frame, its longer side brought down to at most 512 px as VBench does by default; a video
  scores the mean over its frames, divided by 100 (VBench's scale, about 0-1).
- ``subject_consistency``: DINO ViT-B/16 features (timm's ViT holding the DINO checkpoint
  ``dino_vitbase16_pretrain``) of every frame, its shorter side resized to 224 px; every frame after
  a shot's first scores the mean of max(0, cosine) to the previous frame and to the shot's first,
  and the video the mean of those. VBench-Long scores a long video by its clips between cuts, so
  the first frame is the shot's, not the video's. timm resamples the positional embeddings to the
  frame's patch grid with plain bicubic interpolation, DINO's own code with a nudged scale factor:
  scores can differ from VBench's in the third decimal.

FVD (``evaluate/fvd.py``) joins them where an I3D file and a folder of real videos are given. A
metric is built from a path (``evaluate.weights``); each result names the file and its content
digest. Weights load with ``weights_only`` or from safetensors, never by unpickling code.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longlive_core.config import ConfigError
from longlive_core.evaluate.fvd import FVD
from longlive_core.iqa.metrics import load_state_dict
from longlive_core.models.weights import weights_identity

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class WeightPaths:
    """params ``evaluate.weights``: local files; null skips the metric (the scores say so)."""
    musiq: str | None = None  # VBench's imaging quality: pyiqa's musiq_spaq_ckpt-358bb6af.pth
    dino: str | None = None  # VBench's subject consistency: dino_vitbase16_pretrain.pth
    i3d: str | None = None  # FVD's network: i3d_torchscript.pt
    fvd_reference: str | None = None  # FVD's real side: a folder of videos

    def validate(self, where: str) -> None:
        for name in ("musiq", "dino", "i3d"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{where}.{name}: {path} is not a file; put the checkpoint there (it is never "
                                  "downloaded at run time) or set null to skip the metric")
        if self.fvd_reference is not None and not Path(self.fvd_reference).is_dir():
            raise ConfigError(f"{where}.fvd_reference: {self.fvd_reference} is not a folder of real videos")


def load_weights(net: torch.nn.Module, path: str, what: str) -> torch.nn.Module:
    missing, unexpected = net.load_state_dict(load_state_dict(path), strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path} does not fit {what}: {len(missing)} missing keys (e.g. {missing[:3]}), "
                          f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    return net.eval()


def musiq_architecture() -> torch.nn.Module:
    """MUSIQ as VBench builds it (one output, pyiqa's defaults), randomly initialised, no download."""
    from pyiqa.archs.musiq_arch import MUSIQ

    return MUSIQ(pretrained=False, pretrained_model_path=None)


def dino_architecture() -> torch.nn.Module:
    """ViT-B/16 with DINO's layout (class token out, no head), any frame size, no download."""
    import timm

    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0, dynamic_img_size=True)


class FrameMetric:
    """Frames of one video at a time: ``start(shot_starts)``, ``add(rgb)`` per frame, ``result()``.
    Frames go to the network ``batch`` at a time."""
    name = ""

    def __init__(self, net: torch.nn.Module, path: str, device: torch.device, batch: int = 8):
        self.net, self.device, self.batch = net.to(device), device, batch
        self.weights = {"path": path, "sha256": weights_identity(path)}
        self.pending: list[np.ndarray] = []
        self.starts: set[int] = set()
        self.frames = 0

    def start(self, shot_starts: list[int]) -> None:
        self.starts, self.frames, self.pending = set(shot_starts) | {0}, 0, []
        self._reset()

    def add(self, rgb: np.ndarray) -> None:
        self.pending.append(rgb)
        if len(self.pending) == self.batch:
            self._flush()

    def result(self) -> float:
        self._flush()
        return self._value()

    @torch.inference_mode()
    def _flush(self) -> None:
        if not self.pending:
            return
        x = torch.from_numpy(np.stack(self.pending)).to(self.device).permute(0, 3, 1, 2)  # (N, 3, H, W) uint8
        first = self.frames
        self.frames += len(self.pending)
        self.pending = []
        self._consume(x, first)

    def _reset(self) -> None:
        raise NotImplementedError

    def _consume(self, x: torch.Tensor, first: int) -> None:
        raise NotImplementedError

    def _value(self) -> float:
        raise NotImplementedError


class ImagingQuality(FrameMetric):
    name = "imaging_quality"

    def _reset(self) -> None:
        self.total, self.count = 0.0, 0

    def _consume(self, x: torch.Tensor, first: int) -> None:
        h, w = x.shape[-2:]
        if max(h, w) > 512:
            scale = 512.0 / max(h, w)
            x = F.interpolate(x.float(), size=(int(scale * h), int(scale * w)), mode="bilinear",
                              align_corners=False).round().clamp(0, 255)  # VBench resizes the uint8 frames
        scores = self.net(x.float() / 255.0).reshape(-1)
        self.total += float(scores.double().sum())
        self.count += len(scores)

    def _value(self) -> float:
        if not self.count:
            raise ValueError("imaging quality needs at least one frame")
        return self.total / self.count / 100.0


class SubjectConsistency(FrameMetric):
    name = "subject_consistency"

    def _reset(self) -> None:
        self.first = self.previous = None
        self.total, self.count = 0.0, 0

    def _consume(self, x: torch.Tensor, first: int) -> None:
        h, w = x.shape[-2:]
        size = (224, max(1, int(224 * w / h))) if h <= w else (max(1, int(224 * h / w)), 224)
        x = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False).round().clamp(0, 255) / 255.0
        mean = torch.tensor(IMAGENET_MEAN, device=x.device)[:, None, None]
        std = torch.tensor(IMAGENET_STD, device=x.device)[:, None, None]
        x = (x - mean) / std
        x = x[..., : x.shape[-2] // 16 * 16, : x.shape[-1] // 16 * 16]  # DINO's stride-16 patches drop the rest
        features = F.normalize(self.net(x).float(), dim=-1)
        for i, f in enumerate(features):
            if first + i in self.starts:
                self.first = f
            else:
                to_previous = max(0.0, float(f @ self.previous))
                to_first = max(0.0, float(f @ self.first))
                self.total += 0.5 * (to_previous + to_first)
                self.count += 1
            self.previous = f

    def _value(self) -> float:
        if not self.count:
            raise ValueError("subject consistency needs a shot of at least two frames")
        return self.total / self.count


def build_metrics(paths: WeightPaths, device: torch.device) -> tuple[list[FrameMetric], FVD | None, dict[str, str]]:
    """The per-video metrics whose weights are configured, FVD where its network and reference are,
    and a reason for each one skipped."""
    metrics: list[FrameMetric] = []
    skipped: dict[str, str] = {}
    fvd = None
    if paths.i3d is None or paths.fvd_reference is None:
        missing = " and ".join(f"evaluate.weights.{k}" for k in ("i3d", "fvd_reference") if getattr(paths, k) is None)
        skipped["fvd"] = f"no weights or reference: {missing} null (give the local paths)"
    else:
        fvd = FVD(paths.i3d, paths.fvd_reference, device)
    for key, arch, cls in (("musiq", musiq_architecture, ImagingQuality), ("dino", dino_architecture,
                                                                             SubjectConsistency)):
        name, path = cls.name, getattr(paths, key)
        if path is None:
            skipped[name] = f"no weights: evaluate.weights.{key} is null (give the local checkpoint's path)"
            continue
        metrics.append(cls(load_weights(arch(), path, name), path, device))
    return metrics, fvd, skipped
