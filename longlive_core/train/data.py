"""Training samples from the latent cache, and the keyed draws that make runs reproducible.

Every random choice of a step (which sample, which window of it, the chunks' timesteps, the noise)
comes from a generator seeded by (seed, step, global micro-batch slot): 2 ranks draw what 1 rank
with 2 accumulation micro-steps draws, and a resumed run what an uninterrupted one would.

A sample is its shots in order. The cache holds 1 + k latent frames per shot; each shot is trimmed
to whole chunks (a shot shorter than one chunk is left out), frame positions jump by the shot offset
at each new shot, every frame reads its own shot's caption, and a sample longer than the window is
cut to a chunk-aligned window; under sequence parallelism over P ranks windows are whole multiples of
P chunks and each rank reads its part. A sample too short for one window is not drawn (counted).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import pandas as pd
import torch
from safetensors import safe_open

from longlive_core.config import ConfigError
from longlive_core.data.roots import resolve_inside


def generator_for(seed: int, *key: object) -> torch.Generator:
    """A CPU generator seeded from (seed, *key): independent streams for every named draw."""
    digest = hashlib.sha256(json.dumps([seed, *key]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample_weights(samples: str | Path) -> dict[str, float]:
    """``sample_id -> sample_weight`` of samples.parquet: how often training draws each sample (the
    duration buckets' weights). This map, not the whole file, is what training reads of it."""
    df = pd.read_parquet(samples, columns=["sample_id", "sample_weight"])
    return dict(zip(df["sample_id"], df["sample_weight"].astype(float)))


@dataclasses.dataclass
class TrainSample:
    sample_id: str
    latents: torch.Tensor  # (C, F, h, w) float32: the window, or this rank's part of it
    text: torch.Tensor  # (S, T, D): the captions of the shots in the window, in order
    shot_of_frame: torch.Tensor  # (F,) long: which of the S captions each frame reads
    positions: torch.Tensor  # (F,) RoPE frame positions (shot offsets included)
    window_frames: int  # frames of the whole window; F when the sample is not split over ranks


@dataclasses.dataclass(frozen=True)
class ShotRef:
    shard: str
    latents_key: str
    text_key: str
    frames: int  # latent frames kept (whole chunks)
    video_id: str
    shot_index: int


class LatentSamples:
    """The samples of one split of the latent cache (``index.parquet`` + ``shards/``)."""

    def __init__(self, latent_dir: str | Path, split: str, chunk: int, shot_offset: int,
                 sample_weights: dict[str, float] | None = None, align: int | None = None, online=None):
        """``align``: window lengths are multiples of it (a multiple of ``chunk``; sequence parallelism
        over P ranks needs P chunks), and a sample shorter is not drawn (counted). ``online``: an
        ``OnlineLatents`` that encodes the latent frames from the clips instead of reading the shards."""
        self.root = Path(latent_dir)
        self.online = online
        self.chunk, self.shot_offset = chunk, shot_offset
        self.align = align or chunk
        if self.align % chunk:
            raise ValueError(f"windows of multiples of {self.align} frames do not end on {chunk}-frame chunk bounds")
        index_path = self.root / "index.parquet"
        if not index_path.is_file():
            raise ConfigError(f"{index_path} is missing: run encode_latents first (dvc repro encode_latents)")
        index = pd.read_parquet(index_path)
        index = index[index["split"] == split].sort_values(["sample_id", "shot"])
        self.sample_ids: list[str] = []
        self.shots: dict[str, list[ShotRef]] = {}
        self.too_short = 0
        for sample_id, rows in index.groupby("sample_id", sort=True):
            refs = []
            for row in rows.itertuples(index=False):
                kept = (int(row.latent_shape[1]) // chunk) * chunk
                if kept:
                    refs.append(ShotRef(str(row.shard), row.latents_key, row.text_key, kept, str(row.video_id),
                                        int(row.shot_index)))
            if sum(r.frames for r in refs) < self.align:
                self.too_short += 1
                continue
            self.sample_ids.append(str(sample_id))
            self.shots[str(sample_id)] = refs
        weights = [1.0 if sample_weights is None else float(sample_weights.get(s, 0.0)) for s in self.sample_ids]
        self.weights = torch.tensor(weights, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def frames(self, sample_id: str) -> int:
        return sum(r.frames for r in self.shots[sample_id])

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a handful of open shards per dataset)
    def _shard(self, name: str):
        try:
            path = resolve_inside(self.root / "shards", name)
        except ValueError as exc:
            raise ConfigError(f"latent index names shard {name!r} outside {self.root / 'shards'}") from exc
        return safe_open(str(path), framework="pt")

    def draw(self, generator: torch.Generator) -> str:
        """A sample id, drawn proportionally to its weight (assemble's bucket weights)."""
        return self.sample_ids[int(torch.multinomial(self.weights, 1, generator=generator))]

    def window_length(self, sample_id: str, max_frames: int) -> int:
        """Frames of the sample's windows: the longest whole number of ``align`` frames up to ``max_frames``."""
        return min(self.frames(sample_id), max_frames) // self.align * self.align

    def window_lengths(self, max_frames: int) -> list[int]:
        """Every window length a draw can give (samples of weight 0 are never drawn)."""
        return sorted({self.window_length(s, max_frames) for s, w in zip(self.sample_ids, self.weights.tolist())
                       if w > 0})

    def window(self, sample_id: str, max_frames: int, generator: torch.Generator | None) -> tuple[int, int]:
        """(start, end) frames of the sample's window (``window_length``), at a chunk-aligned start drawn
        from ``generator`` (the first when it is None)."""
        total = self.frames(sample_id)
        length = self.window_length(sample_id, max_frames)
        n_windows = (total - length) // self.chunk + 1
        start = 0
        if n_windows > 1 and generator is not None:
            start = int(torch.randint(0, n_windows, (1,), generator=generator)) * self.chunk
        return start, start + length

    def load(self, sample_id: str, max_frames: int, generator: torch.Generator | None,
             part: tuple[int, int] = (0, 1)) -> TrainSample:
        """Part ``rank`` of ``size`` equal parts (``part``) of the sample's window (:meth:`window`):
        only those latent frames are read; the captions are the whole window's."""
        start, end = self.window(sample_id, max_frames, generator)
        rank, size = part
        share = (end - start) // size
        lo_part, hi_part = start + rank * share, start + (rank + 1) * share
        latents, texts, shot_of_frame, positions = [], [], [], []
        first = position = 0
        window_position = None
        for ref in self.shots[sample_id]:
            lo, hi = max(start, first), min(end, first + ref.frames)
            if lo < hi:
                shard = self._shard(ref.shard)
                texts.append(shard.get_tensor(ref.text_key).float())
                if window_position is None:
                    window_position = position + lo - first
                plo, phi = max(lo, lo_part), min(hi, hi_part)
                if plo < phi:
                    if self.online is not None:
                        z = self.online.read(ref.video_id, ref.shot_index, plo - first, phi - first)
                    else:
                        z = shard.get_slice(ref.latents_key)[:, plo - first:phi - first]
                    latents.append(torch.as_tensor(z).float())
                    shot_of_frame.append(torch.full((phi - plo,), len(texts) - 1, dtype=torch.long))
                    positions.append(torch.arange(position + plo - first, position + phi - first))
            first += ref.frames
            position += ref.frames + self.shot_offset
        return TrainSample(sample_id, torch.cat(latents, dim=1), torch.stack(texts), torch.cat(shot_of_frame),
                           torch.cat(positions) - window_position, end - start)
