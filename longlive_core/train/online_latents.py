"""Latents encoded while training, from the shots' clips, instead of read from the latent cache
(``train_ar.latent_source: online``): Balanced SP's VAE side. A rank encodes only the latent frames
it holds, with a halo of context before them (``latents.halo``), so its VAE work is O(F/P + h)
latent frames per sample instead of O(F); the result equals the cache's latents, which
``encode_latents`` made the same way. The cache's index still names the samples and their shots,
and its caption embeddings are still read from it."""
from __future__ import annotations

import dataclasses
import functools
import tarfile
from pathlib import Path

import av
import cv2
import pandas as pd
import torch

from longlive_core.config import ConfigError
from longlive_core.latents.encode import EncodeLatentsConfig
from longlive_core.latents.halo import chunk_for, receptive_field_latents
from longlive_core.models.vae import encode_video, frames_to_input, vae_from
from longlive_core.shots.clips import iter_timed_frames, read_clip
from longlive_core.video.normalize import ClipRejected, normalize_clip


@dataclasses.dataclass(frozen=True)
class OnlineSource:
    """Where online latents come from: the encoder's settings, shots.parquet and the clip shards."""

    encode: EncodeLatentsConfig
    shots_table: Path
    clips_dir: Path

    def open(self, device: torch.device) -> OnlineLatents:
        return OnlineLatents(self.encode, self.shots_table, self.clips_dir, device)


class OnlineLatents:
    def __init__(self, cfg: EncodeLatentsConfig, shots_table: Path, clips_dir: Path, device: torch.device):
        self.cfg, self.clips_dir, self.device = cfg, clips_dir, device
        self.vae = vae_from(cfg.vae, device)
        self.halo = cfg.halo if cfg.halo is not None else receptive_field_latents(self.vae)
        self.shots = pd.read_parquet(shots_table).set_index(["video_id", "shot_index"])
        self.latents_encoded = 0  # latent frames the VAE made, halo included

    @functools.lru_cache(maxsize=2)  # noqa: B019 (a window's shots come one after another)
    def _clip(self, video_id: str, shot_index: int):
        try:
            shot = self.shots.loc[(video_id, shot_index)]
            return normalize_clip(iter_timed_frames(read_clip(self.clips_dir, shot.clip_shard, shot.clip_member)),
                                  self.cfg.clip)
        except (ClipRejected, KeyError, OSError, ValueError, av.FFmpegError, tarfile.TarError, cv2.error) as exc:
            raise ConfigError(f"train_ar.latent_source online: shot {shot_index} of video {video_id} cannot be "
                              f"decoded ({type(exc).__name__}: {exc}); the clips changed since encode_latents "
                              "ran: run dvc repro, or use latent_source cache") from exc

    def read(self, video_id: str, shot_index: int, start: int, end: int) -> torch.Tensor:
        """Latent frames [start, end) of the shot, (C, end - start, h, w) float32 on the CPU."""
        clip = self._clip(video_id, int(shot_index))
        chunk = chunk_for(0, start, end, self.halo)
        video = frames_to_input(clip.frames[chunk.raw_start:chunk.raw_end], self.device)
        self.latents_encoded += chunk.encoded_latents
        return encode_video(self.vae, video)[:, chunk.drop:].float().cpu()
