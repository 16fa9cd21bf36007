"""Captions for the kept shots: a sidecar's where the source allows, else the caption model's.

The shots of one video are captioned in order, each request holding the video's latest earlier
captions (sidecar or model; ``context_shots`` of them, so a long video's request stays bounded) so a
recurring subject keeps its words; then the model lists the video's
recurring subjects from all its captions (empty when its answer does not parse as a JSON array).

Captions are cached in ``state_dir`` by a key per shot: ``caption_key`` (the sampling params, the
model's weights digest, the template files' digest, this code's digest) with the clip's digest and
the earlier captions its request holds. A changed template re-captions everything; a new video
captions only its shots; a shot whose earlier captions changed is captioned again. A shot fails
only on a decode error or an empty caption: it gets no caption, its reason is reported, the stage
goes on (and tries it again on the next run: failures are not cached).

Work goes to the executor in tasks of up to ``batch_size`` videos: each generate call holds the
next shot of every video in the task, so a batch never holds two shots whose order matters.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pandas as pd

from longlive_core.caption.config import CaptionConfig
from longlive_core.caption.frames import shot_frames
from longlive_core.caption.model import CaptionModel
from longlive_core.caption.text import (
    cut_at_sentence_end,
    noun_phrases,
    parse_subjects,
    shot_prompt,
    subjects_json,
    subjects_prompt,
    template_digest,
)
from longlive_core.devices import pick_device
from longlive_core.io.parts import PartTable
from longlive_core.models.weights import weights_identity
from longlive_core.parallel import Executor, worker_slot
from longlive_core.progress import Progress
from longlive_core.shots.clips import read_clip
from longlive_core.tracking.lineage import code_digest, digest_json

log = logging.getLogger(__name__)

CAPTION_COLUMNS = ["video_id", "shot_index", "path", "clip_sha256", "duration_s", "caption", "caption_source",
                   "truncated", "caption_tokens", "tokens_per_s", "noun_phrases", "fail_reason"]
SUBJECT_COLUMNS = ["video_id", "path", "subjects", "subjects_parsed"]
CACHE_COLUMNS = ["key", "clip_sha256", "caption", "truncated", "caption_tokens"]
SUBJECT_CACHE_COLUMNS = ["key", "subjects_json"]


def caption_key(cfg: CaptionConfig) -> str:
    """What every caption depends on besides its clip and its video's earlier captions. ``device: auto`` is
    resolved here (a remote cluster needs cpu or cuda: tasks/caption.py), as the precision follows it."""
    device = cfg.device if cfg.device != "auto" else pick_device("auto").type
    return digest_json([cfg.sampling_params(device), weights_identity(cfg.model), template_digest(),
                        code_digest("longlive_core.caption.run")])


def context(earlier: list[str], cfg: CaptionConfig) -> list[str]:
    """The earlier captions a shot's request holds: the latest ``context_shots``, in order."""
    return earlier[len(earlier) - cfg.context_shots:] if cfg.context_shots else []


def shot_key(key: str, clip_sha256: str, context: list[str]) -> str:
    return digest_json([key, clip_sha256, context])


def subjects_key(key: str, captions: list[str]) -> str:
    return digest_json([key, "subjects", captions])


@dataclasses.dataclass(frozen=True)
class ShotWork:
    shot_index: int
    clip_sha256: str
    clip_shard: str
    clip_member: str
    duration_s: float
    given: str | None  # a sidecar's caption: context, not work
    known: tuple[tuple[str, str, bool, int], ...] = ()  # the cache's (key, caption, truncated, tokens) for the clip


@dataclasses.dataclass(frozen=True)
class VideoWork:
    video_id: str
    earlier: tuple[str, ...]  # the captions before its first shot here
    shots: tuple[ShotWork, ...]  # from its first uncached shot on (none: only its subjects are missing)


@dataclasses.dataclass(frozen=True)
class CaptionTask:
    clips_dir: str
    cfg: CaptionConfig
    key: str
    videos: tuple[VideoWork, ...]


@dataclasses.dataclass(frozen=True)
class ShotOutcome:
    video_id: str
    shot_index: int
    clip_sha256: str
    key: str
    caption: str | None
    truncated: bool = False
    caption_tokens: int = 0
    fail_reason: str = ""
    reused: bool = False  # found in the cache (a shot after one that failed or was captioned afresh)


@dataclasses.dataclass(frozen=True)
class TaskOutcome:
    shots: list[ShotOutcome]
    subjects: list[tuple[str, str]]  # (subjects key, JSON: a list of names, or null when the answer did not parse)


_WORKER_MODEL: tuple[CaptionConfig, CaptionModel] | None = None


def worker_model(cfg: CaptionConfig) -> CaptionModel:
    """The model, loaded once per worker process on the worker's own device."""
    global _WORKER_MODEL
    if _WORKER_MODEL is None or _WORKER_MODEL[0] != cfg:
        _WORKER_MODEL = None  # the old model goes before the new one is loaded
        _WORKER_MODEL = (cfg, CaptionModel(cfg, pick_device(cfg.device, "caption.device", worker_slot())))
    return _WORKER_MODEL[1]


def caption_task(task: CaptionTask) -> TaskOutcome:
    cfg = task.cfg
    model = worker_model(cfg)
    captions = [list(v.earlier) for v in task.videos]
    shots: list[ShotOutcome] = []
    for r in range(max(len(v.shots) for v in task.videos)):
        batch = []
        for i, video in enumerate(task.videos):
            if r >= len(video.shots):
                continue
            s = video.shots[r]
            key = shot_key(task.key, s.clip_sha256, context(captions[i], cfg))
            if s.given is not None:
                captions[i].append(s.given)
                continue
            hit = next((k for k in s.known if k[0] == key), None)
            if hit is not None:
                shots.append(ShotOutcome(video.video_id, s.shot_index, s.clip_sha256, key, *hit[1:], reused=True))
                captions[i].append(hit[1])
                continue
            try:
                frames = shot_frames(read_clip(task.clips_dir, s.clip_shard, s.clip_member), s.duration_s, cfg.fps,
                                     cfg.max_frames)
            except Exception as exc:  # noqa: BLE001 - a broken clip fails its shot, reported, not the stage
                shots.append(ShotOutcome(video.video_id, s.shot_index, s.clip_sha256, key, None,
                                         fail_reason=f"decode error: {type(exc).__name__}: {exc}"))
                continue
            batch.append((i, video, s, key, frames, shot_prompt(context(captions[i], cfg), cfg.max_new_tokens)))
        for (i, video, s, key, _, _), out in zip(batch, model.generate([(b[4], b[5]) for b in batch])):
            text = cut_at_sentence_end(out.text) if out.reached_bound else out.text.strip()
            if not text:
                shots.append(ShotOutcome(video.video_id, s.shot_index, s.clip_sha256, key, None,
                                         fail_reason="empty caption"))
                continue
            tokens = model.count_tokens(text) if out.reached_bound else out.tokens
            shots.append(ShotOutcome(video.video_id, s.shot_index, s.clip_sha256, key, text, out.reached_bound,
                                     tokens))
            captions[i].append(text)
    asked = [c for c in captions if c]
    answers = model.generate([(None, subjects_prompt(c)) for c in asked])
    subjects = [(subjects_key(task.key, c), subjects_json(parse_subjects(a.text)))
                for c, a in zip(asked, answers)]
    return TaskOutcome(shots, subjects)


@dataclasses.dataclass
class CaptionOutcome:
    captions: pd.DataFrame  # CAPTION_COLUMNS, one row per kept shot
    subjects: pd.DataFrame  # SUBJECT_COLUMNS, one row per video with kept shots
    counts: dict[str, float]


@dataclasses.dataclass
class _Walk:
    rows: list[dict]
    captions: list[str]
    pending: VideoWork | None


def _walk(video_id: str, shots: pd.DataFrame, given: dict, cfg: CaptionConfig, key: str, cache: dict,
          failed: dict, by_clip: dict) -> _Walk:
    """A video's shots in order against the cache: its rows when all are known, else the work left."""
    rows, captions = [], []
    for n, r in enumerate(shots.itertuples(index=False)):
        row = {"video_id": video_id, "shot_index": int(r.shot_index), "path": r.path, "clip_sha256": r.clip_sha256,
               "duration_s": float(r.duration_s), "caption": None, "caption_source": "", "truncated": False,
               "caption_tokens": 0, "fail_reason": ""}
        sidecar = given.get(int(r.shot_index))
        k = shot_key(key, r.clip_sha256, context(captions, cfg))
        if sidecar is not None:
            row.update(caption=sidecar, caption_source="sidecar")
        elif cfg.source == "sidecar":
            pass  # no sidecar caption, and the model is not asked
        elif (video_id, int(r.shot_index), k) in failed:
            row["fail_reason"] = failed[(video_id, int(r.shot_index), k)]
        elif k in cache:
            hit = cache[k]
            row.update(caption=hit["caption"], caption_source="model", truncated=bool(hit["truncated"]),
                       caption_tokens=int(hit["caption_tokens"]), _key=k)
        else:
            rest = tuple(ShotWork(int(s.shot_index), s.clip_sha256, s.clip_shard, s.clip_member, float(s.duration_s),
                                  given.get(int(s.shot_index)), by_clip.get(s.clip_sha256, ()))
                         for s in shots.iloc[n:].itertuples(index=False))
            return _Walk(rows, captions, VideoWork(video_id, tuple(captions), rest))
        if row["caption"] is not None:
            captions.append(row["caption"])
        rows.append(row)
    return _Walk(rows, captions, None)


def caption_shots(kept: pd.DataFrame, sidecar: list[str | None], clips_dir: Path, cfg: CaptionConfig,
                  state_dir: Path, executor: Executor, checkpoint_every: int = 50) -> CaptionOutcome:
    """``kept``: the kept shots (scores.parquet's rows); ``sidecar``: each one's sidecar caption or None."""
    key = caption_key(cfg) if cfg.source != "sidecar" else "sidecar"  # sidecars only: no model, nothing cached
    table = PartTable(state_dir, "captions", CACHE_COLUMNS)
    subject_table = PartTable(state_dir, "subjects", SUBJECT_CACHE_COLUMNS)
    cache = {r["key"]: r for r in table.read().to_dict("records")}
    subject_cache = dict(zip(*subject_table.read()[["key", "subjects_json"]].to_dict("list").values()))
    kept = kept.assign(_sidecar=sidecar if cfg.source != "model" else [None] * len(kept))
    videos = [(vid, shots.sort_values("shot_index")) for vid, shots in kept.groupby("video_id", sort=True)]
    failed: dict[tuple, str] = {}
    by_clip: dict[str, tuple] = {}
    for r in cache.values():
        by_clip[r["clip_sha256"]] = (*by_clip.get(r["clip_sha256"], ()),
                                     (r["key"], r["caption"], bool(r["truncated"]), int(r["caption_tokens"])))

    def walk_all() -> list[tuple[str, _Walk]]:
        return [(vid, _walk(vid, shots, {int(i): c for i, c in zip(shots["shot_index"], shots["_sidecar"])
                                         if isinstance(c, str)}, cfg, key, cache, failed, by_clip))
                for vid, shots in videos]

    def needs_subjects(w: _Walk) -> bool:
        return cfg.source != "sidecar" and bool(w.captions) and subjects_key(key, w.captions) not in subject_cache

    work = []
    for vid, w in walk_all():
        if w.pending is not None:
            work.append(w.pending)
        elif needs_subjects(w):
            work.append(VideoWork(vid, tuple(w.captions), ()))
    to_caption = sum(1 for v in work for s in v.shots if s.given is None)
    progress = Progress(log, "caption", to_caption, "shots")
    captioned = 0
    tasks = [CaptionTask(str(clips_dir), cfg, key, tuple(work[i:i + cfg.batch_size]))
             for i in range(0, len(work), cfg.batch_size)]
    new_rows: list[dict] = []
    new_subjects: list[dict] = []

    def flush() -> None:
        table.append(pd.DataFrame(new_rows, columns=CACHE_COLUMNS))
        subject_table.append(pd.DataFrame(new_subjects, columns=SUBJECT_CACHE_COLUMNS))
        new_rows.clear()
        new_subjects.clear()

    try:
        for task, result in executor.map_unordered(caption_task, tasks):
            if isinstance(result, BaseException):  # the model, not a shot: every shot would fail the same way
                raise RuntimeError(f"captioning failed for the videos {[v.video_id[:12] for v in task.videos]}: "
                                   f"{type(result).__name__}: {result} (the captions made so far are kept; rerun "
                                   "to continue)") from result
            for s in result.shots:
                if s.reused:
                    pass
                elif s.caption is None:
                    failed[(s.video_id, s.shot_index, s.key)] = s.fail_reason
                    log.warning("caption: %s shot %d failed: %s", s.video_id[:12], s.shot_index, s.fail_reason)
                else:
                    row = {"key": s.key, "clip_sha256": s.clip_sha256, "caption": s.caption, "truncated": s.truncated,
                           "caption_tokens": s.caption_tokens}
                    cache[s.key] = row
                    new_rows.append(row)
                    captioned += 1
                progress.advance()
            for k, value in result.subjects:
                subject_cache[k] = value
                new_subjects.append({"key": k, "subjects_json": value})
            if len(new_rows) >= checkpoint_every:
                flush()
    finally:
        flush()

    rows, subjects = [], []
    for vid, w in walk_all():
        if w.pending is not None:
            raise RuntimeError(f"{vid}: shots left uncaptioned after the run (a bug: every task returned)")
        rows += w.rows
        parsed = parse_json_list(subject_cache.get(subjects_key(key, w.captions))) if w.captions else None
        subjects.append({"video_id": vid, "path": w.rows[0]["path"] if w.rows else "",
                         "subjects": parsed or [], "subjects_parsed": parsed is not None})
    # keep what today's shots use, so the cache does not grow with every template or model
    live = {r["_key"] for r in rows if "_key" in r}
    table.compact(pd.DataFrame([cache[k] for k in sorted(live)], columns=CACHE_COLUMNS))
    live_subjects = {subjects_key(key, w.captions) for _, w in walk_all() if w.captions}
    subject_table.compact(pd.DataFrame([{"key": k, "subjects_json": v} for k, v in sorted(subject_cache.items())
                                        if k in live_subjects], columns=SUBJECT_CACHE_COLUMNS))
    out = _with_density(pd.DataFrame(rows, columns=[c for c in CAPTION_COLUMNS
                                                    if c not in ("tokens_per_s", "noun_phrases")]))
    subjects_df = pd.DataFrame(subjects, columns=SUBJECT_COLUMNS)
    model = out[out["caption_source"] == "model"]
    counts = {"shots": len(out), "videos": len(videos), "captioned": captioned, "reused": len(model) - captioned,
              "model_captions": len(model), "sidecar_captions": int((out["caption_source"] == "sidecar").sum()),
              "failed": int((out["fail_reason"] != "").sum()), "truncated": int(model["truncated"].sum()),
              "without_caption": int(out["caption"].isna().sum()),
              "videos_with_subjects": int((subjects_df["subjects"].map(len) > 0).sum()),
              "shots_per_s": round(captioned / max(progress.elapsed_s, 1e-9), 3),
              **density(out)}
    return CaptionOutcome(out, subjects_df, counts)


def parse_json_list(value: str | None) -> list[str] | None:
    return json.loads(value) if value else None


def _with_density(out: pd.DataFrame) -> pd.DataFrame:
    out = out.copy()
    out["tokens_per_s"] = [t / d if src == "model" and d > 0 else 0.0
                           for t, d, src in zip(out["caption_tokens"], out["duration_s"], out["caption_source"])]
    out["noun_phrases"] = [len(noun_phrases(c)) if isinstance(c, str) else 0 for c in out["caption"]]
    return out.astype({"shot_index": "int64", "truncated": "bool", "caption_tokens": "int64",
                       "noun_phrases": "int64"})[CAPTION_COLUMNS]


def density(captions: pd.DataFrame) -> dict[str, float]:
    """Caption density: the model's tokens per second of video (model captions), and distinct noun phrases
    per caption (text.noun_phrases' heuristic, every caption)."""
    model = captions[captions["caption_source"] == "model"]
    has = captions[captions["caption"].notna()]
    return {"tokens_per_s_mean": float(model["tokens_per_s"].mean()) if len(model) else 0.0,
            "noun_phrases_mean": float(has["noun_phrases"].mean()) if len(has) else 0.0,
            "caption_tokens_mean": float(model["caption_tokens"].mean()) if len(model) else 0.0}
