"""The latent cache: every shot of every selected sample -> normalised VAE latents + caption embeddings.

Single process, or P ranks under torchrun (``sp = P``): every rank decodes and normalises the shot,
encodes only its chunk (plus halo) of the latent frames, and sends the chunk to rank 0, which
assembles the shot's latents, embeds the caption and writes the shards. A shot whose decode or
normalisation fails is reported, and its sample skipped (a sample's shots stay consecutive).

Output: ``shards/shard-NNNNN.safetensors`` (tensors ``<sample_id>/<k>/latents`` and
``<sample_id>/<k>/text`` for the sample's k-th shot; shots after the first are encoded with "The
scene transitions. " in front of their caption), an index (one row per shot, with the prompt as
encoded), the failed samples and the empty prompt's embedding (for guidance). Each sample's index
rows carry a fingerprint of what its tensors were made from (its shots' clips and frame ranges, its
captions, the encode settings and the model weights' identity): a rerun keeps the samples whose
fingerprint still matches, re-encodes those whose inputs changed, drops the rows of samples gone
from the samples table, refreshes the split column, and deletes shards no row refers
to. A shard is recorded in the index only once it is written.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import resource
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import av
import cv2
import pandas as pd
import torch
from safetensors.torch import save_file

from longlive_core.config import ConfigError
from longlive_core.devices import pick_device
from longlive_core.io.atomic import TMP_PREFIX, atomic_path, remove_unreferenced, write_parquet
from longlive_core.latents.files import EMPTY_PROMPT
from longlive_core.latents.halo import Chunk, plan_chunks, receptive_field_latents
from longlive_core.models.text import check_text_encoder_dir, shot_prompts, text_dtype, text_encoder_from
from longlive_core.models.vae import (
    TEMPORAL_STRIDE,
    check_vae_dir,
    encode_video,
    frames_to_input,
    vae_architecture,
    vae_from,
)
from longlive_core.models.weights import CheckpointError, weights_identity
from longlive_core.parallel import EXECUTORS, Executor, InlineExecutor, worker_slot
from longlive_core.progress import Progress
from longlive_core.shots.clips import iter_timed_frames, read_clip
from longlive_core.tracking.lineage import code_digest, digest_json
from longlive_core.video.normalize import ClipFormat, ClipRejected, normalize_clip

log = logging.getLogger(__name__)

INDEX_COLUMNS = ["sample_id", "shot", "video_id", "shot_index", "shard", "latents_key", "text_key", "latent_shape",
                 "num_frames", "caption", "split", "encode_key", "fingerprint"]


@dataclasses.dataclass(frozen=True)
class EncodeLatentsConfig:
    vae: str = "tiny"  # "tiny", or a local Diffusers vae/ directory
    text_encoder: str = "tiny"  # "tiny", or a local umT5 encoder directory
    text_max_length: int = 512
    clip: ClipFormat = ClipFormat()
    halo: int | None = None  # latent frames of context per chunk; None: the VAE's receptive field
    sp: int = 1  # ranks; >1 runs under torchrun
    executor: str = "local"  # local (processes here) | dask (params `dask`): samples fanned out, one GPU per worker
    workers: int = 1  # processes (local) or local-cluster workers (dask); 1 with sp > 1
    split: str = "all"  # all | train | val
    max_samples: int = 0  # 0: every selected sample
    shard_max_mb: float = 256.0
    device: str = "auto"  # auto | cpu | cuda
    store_dtype: str = "float32"  # float32 | bfloat16 (half the disk; a 16 s 704x1280 shot is 65 MB in float32)

    def validate(self, where: str) -> None:
        self.clip.validate(f"{where}.clip")
        if self.split not in ("all", "train", "val"):
            raise ConfigError(f"{where}.split must be all, train or val; got {self.split!r}")
        if self.store_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{where}.store_dtype must be float32 or bfloat16; got {self.store_dtype!r}")
        if self.sp < 1:
            raise ConfigError(f"{where}.sp must be at least 1; got {self.sp}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor must be one of {list(EXECUTORS)}, got {self.executor!r}")
        if self.workers < 1:
            raise ConfigError(f"{where}.workers must be at least 1; got {self.workers}")
        if self.sp > 1 and (self.workers > 1 or self.executor != "local"):
            raise ConfigError(f"{where}: sp > 1 splits each shot over ranks, workers > 1 or executor dask spread "
                              "samples over workers; use one (sp: 1, or workers: 1 with executor: local)")
        if self.clip.temporal_stride != TEMPORAL_STRIDE:
            raise ConfigError(f"{where}.clip.temporal_stride must be the VAE's, {TEMPORAL_STRIDE}")
        if self.clip.height % 32 or self.clip.width % 32:
            raise ConfigError(f"{where}.clip height and width must be multiples of 32 (VAE stride 16, DiT patch 2)")
        for key, check in (("vae", check_vae_dir), ("text_encoder", check_text_encoder_dir)):
            if getattr(self, key) != "tiny":
                try:
                    check(getattr(self, key))
                except CheckpointError as exc:
                    raise ConfigError(f"{where}.{key}: {exc} (or tiny, the demo's random model)") from exc

    def encode_params(self) -> dict:
        """The params the stored tensors depend on (not the device, selection or shard sizes)."""
        c = self.clip
        return {"vae": self.vae, "text_encoder": self.text_encoder, "text_max_length": self.text_max_length,
                "clip": [c.fps, c.height, c.width, c.fit, c.portrait], "halo": self.halo, "store": self.store_dtype}


@dataclasses.dataclass
class Comm:
    """This process's place among the ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")  # where exchanged tensors live: cpu (gloo) or this rank's GPU (nccl)

    def exchange(self, mine: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor | None:
        """Rank 0 gets every chunk's latents, in order, concatenated along frames (on the CPU);
        others get None."""
        if self.world == 1:
            return mine
        import torch.distributed as dist

        if self.rank != 0:
            dist.send(mine.contiguous().to(self.device), dst=0)
            return None
        parts = [mine.to(self.device)]
        for c in chunks[1:]:
            buf = torch.empty((mine.shape[0], c.latent_end - c.latent_start, *mine.shape[2:]), dtype=mine.dtype,
                              device=self.device)
            dist.recv(buf, src=c.rank)
            parts.append(buf)
        return torch.cat(parts, dim=1).cpu()

    def agree(self, ok: bool) -> bool:
        """True only if every rank's ``ok`` is (a failure anywhere skips the sample everywhere)."""
        if self.world == 1:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def make_models(cfg: EncodeLatentsConfig, device: torch.device, rank: int):
    """The VAE on every rank; the text encoder on rank 0 only (None elsewhere): it embeds the captions."""
    text = text_encoder_from(cfg.text_encoder, cfg.text_max_length, device) if rank == 0 else None
    return vae_from(cfg.vae, device), text


SHARD_NAME = re.compile(r"shard-(\d+)\.safetensors")


class ShardSink:
    """Collects tensors and writes them as safetensors shards, each only when complete."""

    def __init__(self, directory: Path, max_bytes: int):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        numbers = [int(m[1]) for p in self.dir.glob("shard-*.safetensors") if (m := SHARD_NAME.fullmatch(p.name))]
        self.next = max(numbers, default=-1) + 1
        self.max_bytes = max_bytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.rows: list[dict] = []
        self.size = 0

    @property
    def name(self) -> str:
        return f"shard-{self.next:05d}.safetensors"

    def add(self, tensors: dict[str, torch.Tensor], rows: list[dict]) -> None:
        for row in rows:
            row["shard"] = self.name
        self.tensors.update({k: v.contiguous().cpu() for k, v in tensors.items()})
        self.rows.extend(rows)
        self.size += sum(t.numel() * t.element_size() for t in tensors.values())

    def flush(self) -> list[dict]:
        """Writes the open shard; returns its rows (now safe to record)."""
        if not self.tensors:
            return []
        with atomic_path(self.dir / self.name) as tmp:
            save_file(self.tensors, os.fspath(tmp))
        rows, self.tensors, self.rows, self.size = self.rows, {}, [], 0
        self.next += 1
        return rows


def select_samples(samples: pd.DataFrame, cfg: EncodeLatentsConfig) -> pd.DataFrame:
    picked = samples if cfg.split == "all" else samples[samples["split"] == cfg.split]
    picked = picked.sort_values("sample_id")
    return picked.head(cfg.max_samples) if cfg.max_samples else picked


def sample_fingerprints(samples: pd.DataFrame, shot_rows: pd.DataFrame, key: str) -> dict[str, str]:
    """sample_id -> digest of everything its stored tensors depend on (the split is not: it is
    metadata): the encode key, its clips' contents and its captions."""
    out = {}
    for sample in samples.itertuples(index=False):
        clips = []
        for shot_index in sample.shot_indices:
            try:
                clips.append(shot_rows.loc[(sample.video_id, int(shot_index))].clip_sha256)
            except KeyError:
                clips.append(None)  # fails at encode time and is reported there
        captions = list(sample.captions) if sample.captions is not None else None
        out[sample.sample_id] = digest_json([key, clips, captions])
    return out


def load_index(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame(columns=INDEX_COLUMNS)
    index = pd.read_parquet(path)
    for column in INDEX_COLUMNS:  # indexes written before a column existed: their rows will not match
        if column not in index:
            index[column] = None
    return index[INDEX_COLUMNS]


def reusable_rows(index: pd.DataFrame, samples: pd.DataFrame, fingerprints: dict[str, str]) -> pd.DataFrame:
    """The index rows still valid for samples that still exist (selected or not: a smaller
    selection, e.g. max_samples, keeps what was encoded before), with today's split."""
    current = index["sample_id"].map(fingerprints)
    keep = index[current.notna() & (index["fingerprint"] == current)].copy()
    keep["split"] = keep["sample_id"].map(samples.set_index("sample_id")["split"])
    return keep.reset_index(drop=True)


@dataclasses.dataclass(frozen=True)
class SampleTask:
    """One sample to encode: what a worker needs to make its tensors and index rows."""
    sample_id: str
    video_id: str
    split: str
    shot_indices: tuple[int, ...]
    clips: tuple[tuple[str, str] | None, ...]  # (clip_shard, clip_member) per shot; None: not in the shots table
    captions: tuple[str, ...]  # as encoded ("The scene transitions. " in front of later shots')
    clips_dir: str
    cfg: EncodeLatentsConfig
    halo: int
    key: str
    fingerprint: str


@dataclasses.dataclass
class Encoded:
    """A sample's tensors (on the CPU, in the store dtype) and index rows, or why it was skipped;
    ``counts`` adds to the stage's. On ranks other than 0 tensors and rows stay empty."""
    tensors: dict[str, torch.Tensor]
    rows: list[dict]
    counts: dict[str, float]
    reason: str | None = None


SUMMED = ("shots_encoded", "frames_encoded", "latents_kept", "latents_encoded", "latents_encoded_max_rank",
          "frames_trimmed", "frames_repeated", "frames_dropped", "rotated_shots", "portrait_shots")


def sample_tasks(todo: pd.DataFrame, shot_rows: pd.DataFrame, clips_dir: Path, cfg: EncodeLatentsConfig,
                 halo: int, key: str, fingerprints: dict[str, str]) -> Iterator[SampleTask]:
    for sample in todo.itertuples(index=False):
        clips = []
        for shot_index in sample.shot_indices:
            try:
                row = shot_rows.loc[(sample.video_id, int(shot_index))]
                clips.append((row.clip_shard, row.clip_member))
            except KeyError:
                clips.append(None)
        captions = shot_prompts(list(sample.captions) if sample.captions is not None
                                else [""] * len(sample.shot_indices))
        yield SampleTask(sample.sample_id, sample.video_id, sample.split, tuple(int(i) for i in sample.shot_indices),
                         tuple(clips), tuple(captions), str(clips_dir), cfg, halo, key, fingerprints[sample.sample_id])


def encode_sample(task: SampleTask, vae, text, comm: Comm, device: torch.device) -> Encoded:
    """Every shot of one sample, in lockstep across ranks; a shot that fails skips the sample."""
    counts = dict.fromkeys(SUMMED, 0)
    tensors, rows = {}, []
    store = getattr(torch, task.cfg.store_dtype)
    for k, (shot_index, where) in enumerate(zip(task.shot_indices, task.clips)):
        clip, reason = None, None
        try:  # one shot at a time: a long shot's frames are large
            if where is None:
                raise KeyError(f"({task.video_id!r}, {shot_index}) is not in the shots table")
            clip = normalize_clip(iter_timed_frames(read_clip(Path(task.clips_dir), *where)), task.cfg.clip)
        except (ClipRejected, KeyError, OSError, ValueError, av.FFmpegError, tarfile.TarError, cv2.error) as exc:
            reason = f"shot {k} (shot_index {shot_index}): {type(exc).__name__}: {exc}"
        if not comm.agree(clip is not None):
            return Encoded({}, [], {}, reason or f"shot {k} (shot_index {shot_index}) failed on another rank")
        z = encode_shot(vae, clip, task.halo, comm, device, counts)
        if comm.rank == 0:
            lkey, tkey = f"{task.sample_id}/{k}/latents", f"{task.sample_id}/{k}/text"
            tensors[lkey] = z.to(store)
            rows.append({"sample_id": task.sample_id, "shot": k, "video_id": task.video_id,
                         "shot_index": int(shot_index), "latents_key": lkey, "text_key": tkey,
                         "latent_shape": list(z.shape), "num_frames": int(clip.counts["frames"]),
                         "caption": task.captions[k], "split": task.split, "encode_key": task.key,
                         "fingerprint": task.fingerprint})
    counts["shots_encoded"] = len(task.shot_indices)
    if comm.rank == 0:
        for row, embed in zip(rows, text.encode(list(task.captions))):
            tensors[row["text_key"]] = embed.to(store).contiguous()
    if device.type == "cuda":
        counts["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return Encoded(tensors, rows, counts)


_WORKER_MODELS: tuple | None = None


def worker_models(cfg: EncodeLatentsConfig, device: torch.device, rank: int = 0):
    """``make_models``, once per process (an executor's worker encodes many samples)."""
    global _WORKER_MODELS
    ident = (cfg.vae, cfg.text_encoder, cfg.text_max_length, device, rank)
    if _WORKER_MODELS is None or _WORKER_MODELS[0] != ident:
        _WORKER_MODELS = None  # the old models go before the new ones load
        _WORKER_MODELS = (ident, *make_models(cfg, device, rank))
    return _WORKER_MODELS[1], _WORKER_MODELS[2]


@dataclasses.dataclass(frozen=True)
class EmptyPromptTask:
    """The executor's first item: the empty caption's embedding (for guidance), made by a worker so
    the stage's own process never loads the text encoder."""
    cfg: EncodeLatentsConfig


def empty_embedding(text, cfg: EncodeLatentsConfig) -> torch.Tensor:
    return text.encode([""])[0].to(getattr(torch, cfg.store_dtype)).contiguous().cpu()


def encode_task(task: SampleTask | EmptyPromptTask) -> Encoded | torch.Tensor:
    """An executor's item, on this worker's device: one sample, or the empty caption."""
    device = pick_device(task.cfg.device, "encode_latents.device", worker_slot())
    vae, text = worker_models(task.cfg, device)
    if isinstance(task, EmptyPromptTask):
        return empty_embedding(text, task.cfg)
    return encode_sample(task, vae, text, Comm(device=device), device)


def key_device_type(cfg: EncodeLatentsConfig) -> str:
    """The device type the encoders run on, which fixes the text encoder's dtype (part of the key):
    as set, or what ``auto`` finds here (so a remote cluster's workers need it set: tasks.encode_latents)."""
    return cfg.device if cfg.device != "auto" else pick_device("auto").type


def encode_samples(samples: pd.DataFrame, shots: pd.DataFrame, clips_dir: Path, shard_dir: Path, index_path: Path,
                   failed_path: Path, cfg: EncodeLatentsConfig, comm: Comm, executor: Executor | None = None) -> dict:
    """Encodes what is new; rank 0 writes the shards, the index and the failures; returns counts.
    With one rank the samples go through ``executor`` (inline when None); with several, every rank
    encodes every sample together (its chunk of each shot)."""
    if comm.world > 1 and executor is not None:
        raise ValueError("encode_samples: an executor fans samples out to workers; sp ranks split each shot: not both")
    vae = text = None
    if comm.world > 1:
        device = pick_device(cfg.device, "encode_latents.device")
        vae, text = worker_models(cfg, device, comm.rank)
    halo = cfg.halo if cfg.halo is not None else receptive_field_latents(vae_architecture(cfg.vae))
    # what every stored tensor depends on besides its clip and caption: the params, the weights'
    # contents and the code that makes them (the same files dvc.yaml lists for the stage)
    dtype = text_dtype(torch.device(key_device_type(cfg)))
    key = digest_json([cfg.encode_params(), halo, weights_identity(cfg.vae), weights_identity(cfg.text_encoder),
                       str(dtype), code_digest("longlive_core.latents.encode")])
    picked = select_samples(samples, cfg)
    shot_rows = shots.set_index(["video_id", "shot_index"])
    fingerprints = sample_fingerprints(samples, shot_rows, key)
    done = pd.DataFrame(columns=INDEX_COLUMNS)
    stale = dropped = 0
    if comm.rank == 0:
        previous = load_index(index_path)
        done = reusable_rows(previous, samples, fingerprints)
        existing = previous["sample_id"].isin(fingerprints)
        stale = previous.loc[existing, "sample_id"].nunique() - done["sample_id"].nunique()
        dropped = previous.loc[~existing, "sample_id"].nunique()
    if comm.world > 1:  # every rank must walk the same list of samples
        import torch.distributed as dist

        holder = [sorted(set(done["sample_id"]))]
        dist.broadcast_object_list(holder, src=0)  # a list of strings made by rank 0 of this same job
        done_ids = set(holder[0])
    else:
        done_ids = set(done["sample_id"])
    if comm.rank == 0:
        shard_dir.mkdir(parents=True, exist_ok=True)
        for leftover in shard_dir.glob(f"{TMP_PREFIX}*"):  # from a killed run
            leftover.unlink()
    todo = picked[~picked["sample_id"].isin(done_ids)]
    tasks = sample_tasks(todo, shot_rows, clips_dir, cfg, halo, key, fingerprints)
    empty = None
    if comm.world > 1:
        results = ((t, encode_sample(t, vae, text, comm, device)) for t in tasks)
        if text is not None:
            empty = empty_embedding(text, cfg)
    else:
        results = (executor or InlineExecutor()).map_unordered(encode_task, itertools.chain([EmptyPromptTask(cfg)],
                                                                                            tasks))
    sink = ShardSink(shard_dir, int(cfg.shard_max_mb * 1024 * 1024)) if comm.rank == 0 else None
    new_rows: list[dict] = []
    failed: list[dict] = []
    counts = {"samples_selected": int(len(picked)), "samples_reused": int(picked["sample_id"].isin(done_ids).sum()),
              "samples_encoded": 0, "samples_failed": 0, **dict.fromkeys(SUMMED, 0), "halo": halo,
              "ranks": comm.world}
    progress = Progress(log, "encode_latents", len(todo), "samples") if comm.rank == 0 else None
    start = time.perf_counter()
    for task, enc in results:
        if isinstance(task, EmptyPromptTask):
            if isinstance(enc, BaseException):
                raise RuntimeError(f"embedding the empty prompt failed: {type(enc).__name__}: {enc}") from enc
            empty = enc
            continue
        if isinstance(enc, BaseException):  # the task itself died (e.g. its worker, more than dask.retries times)
            enc = Encoded({}, [], {}, f"{type(enc).__name__}: {enc}")
        if enc.reason is not None:
            counts["samples_failed"] += 1
            if comm.rank == 0:
                log.warning("%s: skipped: %s", task.sample_id, enc.reason)
                failed.append({"sample_id": task.sample_id, "video_id": task.video_id, "reason": enc.reason})
                progress.advance()
            continue
        counts["samples_encoded"] += 1
        for name, value in enc.counts.items():
            counts[name] = max(counts.get(name, 0), value) if name.startswith("peak_") else counts[name] + value
        if comm.rank == 0:
            sink.add(enc.tensors, enc.rows)
            progress.advance()
            if sink.size >= sink.max_bytes:
                new_rows += sink.flush()
                _write_index(index_path, done, new_rows)
        del enc
    elapsed = time.perf_counter() - start
    if comm.rank != 0:
        return counts
    new_rows += sink.flush()
    index = _write_index(index_path, done, new_rows)
    counts["samples_stale"], counts["samples_dropped"] = int(stale), int(dropped)
    # shards no index row points at: every sample in them was redone or dropped
    counts["shards_removed"] = remove_unreferenced(shard_dir, SHARD_NAME, set(index["shard"]))
    write_parquet(pd.DataFrame(failed, columns=["sample_id", "video_id", "reason"]), failed_path)
    with atomic_path(index_path.parent / EMPTY_PROMPT) as tmp:  # the unconditional text of guidance, once
        save_file({"text": empty}, os.fspath(tmp))
    counts["frames_per_s"] = round(counts["frames_encoded"] / max(elapsed, 1e-9), 3)
    counts["halo_overhead"] = round(counts["latents_encoded"] / max(counts["latents_kept"], 1), 4)
    counts["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return counts


def encode_shot(vae, clip, halo: int, comm: Comm, device: torch.device, counts: dict) -> torch.Tensor | None:
    """This rank's chunk of one normalised shot, assembled on rank 0 (None elsewhere)."""
    n_lat = 1 + (len(clip.frames) - 1) // TEMPORAL_STRIDE
    chunks = plan_chunks(n_lat, min(comm.world, n_lat), halo)  # a shot shorter than P latents: fewer ranks
    counts["latents_kept"] += n_lat
    counts["latents_encoded"] += sum(c.encoded_latents for c in chunks)
    counts["latents_encoded_max_rank"] += max(c.encoded_latents for c in chunks)
    counts["frames_encoded"] += clip.counts["frames"]
    for name, value in (("frames_trimmed", "trimmed_frames"), ("frames_repeated", "repeated_frames"),
                        ("frames_dropped", "dropped_source_frames"), ("rotated_shots", "rotated"),
                        ("portrait_shots", "portrait")):
        counts[name] += clip.counts[value]
    if comm.rank >= len(chunks):
        return None
    c = chunks[comm.rank]
    video = frames_to_input(clip.frames[c.raw_start:c.raw_end], device)  # only this rank's frames move
    z = encode_video(vae, video)[:, c.drop:].float()  # stays on the device for NCCL; exchange returns CPU
    return z.cpu() if len(chunks) == 1 else comm.exchange(z, chunks)


def _write_index(path: Path, done: pd.DataFrame, new_rows: list[dict]) -> pd.DataFrame:
    index = pd.concat([done, pd.DataFrame(new_rows, columns=INDEX_COLUMNS)], ignore_index=True)
    index = index.sort_values(["sample_id", "shot"]).reset_index(drop=True)
    write_parquet(index, path)
    return index

