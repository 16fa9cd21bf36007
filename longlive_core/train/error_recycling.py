"""Error recycling: the model's own prediction errors, stored as training goes, put back into its
inputs so that it learns to recover from the drift autoregressive generation accumulates.

Two buffers of per-chunk errors, bucketed by (position, timestep): the latent error x0_pred - x0
and the noise error (1 - sigma)(v_pred - v). The position bucket is the chunk's relative place in
its window (``position_buckets`` of them), the timestep bucket its train-timestep index
(``timestep_buckets``); a full bucket overwrites a slot drawn at random. Each sample, unless it
stays clean (``clean_prob``), may get a latent error added to its clean context (``context_prob``:
an entry of the chunk's position, any timestep), to the clean latent it is noised from
(``latent_prob``: the chunk's own bucket; the target stays the true clean latent) and to its noise
(``noise_prob``: the target follows the changed noise); each entry scaled by a factor drawn from
[1 - modulate, 1 + modulate]. An empty bucket injects nothing.

Sharded by sequence-parallel rank: position buckets are a multiple of P, so the chunks a rank holds
always fall in its own buckets and it stores only those. Every draw (whether, which entry, which
factor, which slot a full bucket overwrites) is made for the whole sample from the (seed, step,
slot) keys and sliced, so buffers, injections and losses do not depend on P. For the first
``warmup_steps`` the ranks that hold the same position buckets (the data-parallel group of an SP
rank) pool their errors, so the buffers fill evenly; after that each keeps its own.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from longlive_core.train.config import ErrorRecyclingConfig
from longlive_core.train.data import generator_for


def position_bucket(chunk: int, chunks: int, buckets: int) -> int:
    """The bucket of chunk ``chunk`` of a ``chunks``-chunk window: its relative place in it."""
    return chunk * buckets // chunks


class ErrorBuffer:
    """One kind of error, this rank's position buckets: ``(position, timestep bucket) -> entries``."""

    def __init__(self, positions: range, timestep_buckets: int, capacity: int, dtype: torch.dtype):
        self.positions, self.timestep_buckets, self.capacity, self.dtype = positions, timestep_buckets, capacity, dtype
        self.entries: dict[tuple[int, int], list[torch.Tensor]] = {}

    def add(self, position: int, t_bucket: int, error: torch.Tensor, slot_draw: float) -> None:
        """Stores ``error``; a full bucket overwrites the slot ``slot_draw`` (in [0, 1)) points at."""
        if position not in self.positions:
            raise ValueError(f"position bucket {position} is not one of this rank's {self.positions}")
        bucket = self.entries.setdefault((position, t_bucket), [])
        error = error.detach().to("cpu", self.dtype)
        if len(bucket) < self.capacity:
            bucket.append(error)
        else:
            bucket[int(slot_draw * self.capacity)] = error

    def sample(self, position: int, t_bucket: int, draw: float) -> torch.Tensor | None:
        bucket = self.entries.get((position, t_bucket), [])
        return bucket[int(draw * len(bucket))] if bucket else None

    def sample_position(self, position: int, draw: float) -> torch.Tensor | None:
        """An entry of ``position`` at any timestep (the buckets in timestep order, as one list)."""
        pooled = [e for t in range(self.timestep_buckets) for e in self.entries.get((position, t), [])]
        return pooled[int(draw * len(pooled))] if pooled else None

    def __len__(self) -> int:
        return sum(len(b) for b in self.entries.values())

    @property
    def total_capacity(self) -> int:
        return len(self.positions) * self.timestep_buckets * self.capacity

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}/{p}/{t}": torch.stack(b) for (p, t), b in sorted(self.entries.items()) if b}

    def load_state_dict(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        self.entries = {}
        for key, stacked in state.items():
            kind, p, t = key.rsplit("/", 2)
            if kind == prefix:
                self.entries[(int(p), int(t))] = list(stacked.to(self.dtype).unbind(0))


@dataclasses.dataclass(frozen=True)
class InjectionDraws:
    """One sample's draws, for every chunk of its window (a rank slices its own chunks)."""

    clean: bool
    context: bool
    latent: bool
    noise: bool
    entry: torch.Tensor  # (3, chunks) in [0, 1): which entry, for context, latent, noise
    scale: torch.Tensor  # (3, chunks) in [1 - m, 1 + m]

    @classmethod
    def draw(cls, cfg: ErrorRecyclingConfig, chunks: int, generator: torch.Generator) -> InjectionDraws:
        u = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
        entry = torch.rand(3, chunks, generator=generator, dtype=torch.float64)
        scale = 1 + cfg.modulate * (2 * torch.rand(3, chunks, generator=generator, dtype=torch.float64) - 1)
        clean = u[0] < cfg.clean_prob
        return cls(clean, not clean and u[1] < cfg.context_prob, not clean and u[2] < cfg.latent_prob,
                   not clean and u[3] < cfg.noise_prob, entry, scale)


class _Pending(NamedTuple):
    """An error queued by ``record`` until the step's ``commit``."""

    key: tuple  # the micro-batch's draw key
    chunk: int
    kind: str  # latent | noise
    position: int
    t_bucket: int
    error: torch.Tensor
    slot_draw: float


class ErrorRecycler:
    """Both buffers of one rank, the injections into a sample's inputs and the errors it stores."""

    def __init__(self, cfg: ErrorRecyclingConfig, sp_rank: int, sp: int, num_train_timesteps: int,
                 dp_group: dist.ProcessGroup | None = None):
        self.cfg, self.num_train_timesteps, self.dp_group = cfg, num_train_timesteps, dp_group
        share = cfg.position_buckets // sp
        positions = range(sp_rank * share, (sp_rank + 1) * share)
        dtype = getattr(torch, cfg.store_dtype)
        self.latent = ErrorBuffer(positions, cfg.timestep_buckets, cfg.entries_per_bucket, dtype)
        self.noise = ErrorBuffer(positions, cfg.timestep_buckets, cfg.entries_per_bucket, dtype)
        self.pending: list[_Pending] = []
        self.injected = {"context": 0, "latent": 0, "noise": 0}

    def t_bucket(self, index: int) -> int:
        return index * self.cfg.timestep_buckets // self.num_train_timesteps

    def inject(self, draws: InjectionDraws, step: int, chunks: list[int], total_chunks: int, t_index: list[int],
               chunk_frames: int, like: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Errors to add to the clean context, the clean latent and the noise of this rank's chunks
        ``chunks`` (global indices, timestep indices ``t_index``): three (1, C, f, h, w) tensors like
        ``like`` or None where nothing is injected."""
        if step < self.cfg.start_step or draws.clean:
            return None, None, None
        out = []
        for k, (on, kind) in enumerate(((draws.context, "context"), (draws.latent, "latent"), (draws.noise, "noise"))):
            if not on:
                out.append(None)
                continue
            buffer = self.noise if kind == "noise" else self.latent
            parts, any_entry = [], False
            for j, (c, ti) in enumerate(zip(chunks, t_index, strict=True)):
                pos, u = position_bucket(c, total_chunks, self.cfg.position_buckets), float(draws.entry[k, c])
                e = buffer.sample_position(pos, u) if kind == "context" else buffer.sample(pos, self.t_bucket(ti), u)
                if e is None:
                    parts.append(torch.zeros_like(like[0, :, j * chunk_frames:(j + 1) * chunk_frames]))
                else:
                    any_entry = True
                    self.injected[kind] += 1
                    parts.append(e.to(like.device, like.dtype) * float(draws.scale[k, c]))
            out.append(torch.cat(parts, dim=1)[None] if any_entry else None)
        return tuple(out)

    def record(self, key: tuple, chunks: list[int], total_chunks: int, t_index: list[int], chunk_frames: int,
               latent_error: torch.Tensor, noise_error: torch.Tensor, seed: int) -> None:
        """Queues this rank's chunks' errors (1, C, f, h, w) of the sample drawn with ``key``; ``commit``
        stores them after the step."""
        for j, (c, ti) in enumerate(zip(chunks, t_index, strict=True)):
            pos = position_bucket(c, total_chunks, self.cfg.position_buckets)
            slot = float(torch.rand(1, generator=generator_for(seed, "error-slot", *key, c), dtype=torch.float64))
            part = slice(j * chunk_frames, (j + 1) * chunk_frames)
            for kind, err in (("latent", latent_error), ("noise", noise_error)):
                self.pending.append(_Pending(key, c, kind, pos, self.t_bucket(ti), err[0, :, part].detach(), slot))

    def commit(self, step: int, store: bool = True) -> None:
        """Stores the step's queued errors in key order (none when not ``store``: a skipped step's may
        not be finite); during warm-up those of every data-parallel rank of this SP rank. A collective
        over ``dp_group`` in warm-up: every rank calls it, storing or not."""
        # to the CPU now, after the step: queued on the device, the errors cost no sync per micro-batch
        items = [p._replace(error=p.error.to("cpu", self.latent.dtype)) for p in self.pending] if store else []
        self.pending = []
        if step < self.cfg.warmup_steps and self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            gathered: list = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(gathered, items, group=self.dp_group)
            items = [item for part in gathered for item in part]
        for p in sorted(items, key=lambda p: (p.key, p.chunk, p.kind)):
            (self.noise if p.kind == "noise" else self.latent).add(p.position, p.t_bucket, p.error, p.slot_draw)

    def take_injection_counts(self) -> dict[str, int]:
        counts, self.injected = self.injected, {k: 0 for k in self.injected}
        return counts

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.latent.state_dict("latent"), **self.noise.state_dict("noise")}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.latent.load_state_dict(state, "latent")
        self.noise.load_state_dict(state, "noise")
