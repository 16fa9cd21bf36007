"""Fréchet Video Distance against a folder of real videos, with an I3D network from a local file.

The I3D is the TorchScript file the common FVD implementations share (``i3d_torchscript.pt``,
Kinetics-400): called as ``detector(videos, rescale=False, resize=False, return_features=True)`` on
(B, 3, 16, 224, 224) clips in [-1, 1], it returns one feature row per clip. Videos are cut into
16-frame clips inside each shot (a cut is not motion; a shot's tail shorter than a clip is left
out), every frame resized to 224 x 224. FVD = |mu_g - mu_r|^2 + Tr(S_g + S_r - 2 (S_g S_r)^(1/2)) over
the clips' features, generated against real. A TorchScript file holds TorchScript code and tensors,
loaded by torch.jit (no Python pickle). FVD needs hundreds of clips on each side to mean much: the
scores say how many went in.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longlive_core.config import ConfigError
from longlive_core.models.weights import weights_identity

CLIP_FRAMES, SIZE = 16, 224


def frechet_distance(generated: np.ndarray, real: np.ndarray) -> float:
    """Between Gaussians fitted to two sets of feature rows (N, D), each of at least 2 rows."""
    from scipy import linalg

    if len(generated) < 2 or len(real) < 2:
        raise ValueError(f"FVD needs at least 2 clips a side; got {len(generated)} generated, {len(real)} real")
    mu_g, mu_r = generated.mean(0), real.mean(0)
    s_g, s_r = np.cov(generated, rowvar=False), np.cov(real, rowvar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", linalg.LinAlgWarning)  # fewer clips than features: singular, handled below
        root = linalg.sqrtm(s_g @ s_r)
        if not np.isfinite(root).all():  # nudge both covariances off singularity, as FID's reference code does
            offset = np.eye(len(s_g)) * 1e-6
            root = linalg.sqrtm((s_g + offset) @ (s_r + offset))
    if np.iscomplexobj(root):  # rounding leaves tiny imaginary parts on near-singular products
        root = root.real
    return float(((mu_g - mu_r) ** 2).sum() + np.trace(s_g + s_r - 2.0 * root))


def load_i3d(path: str, device: torch.device) -> torch.jit.ScriptModule:
    try:
        with warnings.catch_warnings():  # torch.jit is deprecated, but the shared I3D file is TorchScript
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.load(path, map_location=device).eval()
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{path} is not a TorchScript file (FVD needs i3d_torchscript.pt): {e}") from None


class ClipFeatures:
    """I3D features of a video's 16-frame clips, fed one frame at a time (``start`` a video, ``add``)."""

    def __init__(self, detector, device: torch.device):
        self.detector, self.device = detector, device
        self.rows: list[np.ndarray] = []
        self.clip: list[torch.Tensor] = []
        self.starts: set[int] = set()
        self.frames = 0

    def start(self, shot_starts: list[int]) -> None:
        self.starts, self.frames, self.clip = set(shot_starts) | {0}, 0, []

    @torch.inference_mode()
    def add(self, rgb: np.ndarray) -> None:
        if self.frames in self.starts:
            self.clip = []  # a shot's tail shorter than a clip is left out
        self.frames += 1
        x = torch.from_numpy(rgb).to(self.device).permute(2, 0, 1)[None].float()
        self.clip.append(F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)[0])
        if len(self.clip) == CLIP_FRAMES:
            video = (torch.stack(self.clip, dim=1)[None] / 127.5 - 1.0).clamp(-1, 1)  # (1, 3, 16, 224, 224)
            self.rows.append(self.detector(video, rescale=False, resize=False, return_features=True)
                             .reshape(1, -1).float().cpu().numpy())
            self.clip = []

    def matrix(self) -> np.ndarray:
        return np.concatenate(self.rows) if self.rows else np.zeros((0, 0))


class FVD:
    """FVD of the generated videos fed to ``generated`` against every video under ``reference``."""
    name = "fvd"

    def __init__(self, i3d: str, reference: str, device: torch.device):
        from longlive_core.shots.clips import iter_timed_frames

        detector = load_i3d(i3d, device)
        self.weights = {"path": i3d, "sha256": weights_identity(i3d), "reference": reference,
                        "reference_sha256": weights_identity(reference)}
        real = ClipFeatures(detector, device)
        videos = sorted(p for p in Path(reference).rglob("*") if p.suffix.lower() in (".mp4", ".mkv", ".mov", ".webm"))
        if not videos:
            raise ConfigError(f"evaluate.weights.fvd_reference: no videos under {reference}")
        for path in videos:
            real.start([0])
            for rgb, *_ in iter_timed_frames(path):
                real.add(rgb)
        self.real = real.matrix()
        self.generated = ClipFeatures(detector, device)

    def distance(self) -> dict:
        gen = self.generated.matrix()
        return {"fvd": frechet_distance(gen, self.real), "generated_clips": len(gen), "real_clips": len(self.real)}
