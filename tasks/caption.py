"""DVC stage `caption`: a caption for every kept shot, a sidecar's where ``caption.source`` allows and
there is one, else the caption model's (Qwen2.5-VL from a local folder; the demo's is tiny and random),
the shots of a video in order with its earlier captions as context; and each video's recurring
subjects. Outputs data/captions/captions.parquet and subjects.parquet; captions are cached in
data/captions/state/ (persist) by the clip, the model's weights, the templates (configs/caption/),
the sampling params and the code, so a new video captions only its shots."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from longlive_core.caption.config import CaptionConfig
from longlive_core.caption.run import caption_shots
from longlive_core.config import ConfigError, stage_config
from longlive_core.data.captions import shot_captions
from longlive_core.devices import pick_device
from longlive_core.io.atomic import write_parquet
from longlive_core.parallel import DaskConfig, make_executor
from longlive_core.tracking.lineage import digest_file
from tasks.paths import CAPTION_STATE, CAPTIONS, CLIPS, MANIFEST, SCORES, SUBJECTS, raw_root
from tasks.stage import main_for


@dataclasses.dataclass(frozen=True)
class Prepared:
    caption: CaptionConfig
    dask: DaskConfig
    raw_root: Path


def prepare(params) -> Prepared:
    cfg = stage_config(CaptionConfig, "caption", params)
    dask = DaskConfig.from_params(params)
    if not dask.remote(cfg.executor):  # a GPU asked for and absent is said now
        pick_device(cfg.device, "caption.device")
    elif cfg.device == "auto" and cfg.source != "sidecar":
        raise ConfigError("caption.device must be cpu or cuda with a remote Dask cluster (dask.address): the model's "
                          "precision follows the device and is part of each caption's cache key")
    return Prepared(cfg, dask, raw_root(params))


def body(p: Prepared, run):
    cfg = p.caption
    run.set_tags({"input.scores.sha256": digest_file(SCORES), "input.manifest.sha256": digest_file(MANIFEST),
                  "caption.model": cfg.model, "caption.source": cfg.source, "caption.executor": cfg.executor})
    scores = pd.read_parquet(SCORES)
    kept = scores[scores["kept"]].sort_values(["video_id", "shot_index"]).reset_index(drop=True)
    sidecar = shot_captions(kept, pd.read_parquet(MANIFEST), p.raw_root) if cfg.source != "model" else \
        [None] * len(kept)
    executor = make_executor(cfg.executor, cfg.workers, p.dask, gpu=cfg.device == "cuda")
    out = caption_shots(kept, sidecar, CLIPS, cfg, CAPTION_STATE, executor)
    write_parquet(out.captions, CAPTIONS)
    write_parquet(out.subjects, SUBJECTS)
    run.log_metrics(out.counts)
    run.log_artifact(CAPTIONS)
    run.log_artifact(SUBJECTS)
    return {**out.counts, "model": cfg.model, "source": cfg.source}


def one_line(s) -> str:
    return (f"{s['shots']} kept shots: {s['sidecar_captions']} sidecar captions, {s['model_captions']} from "
            f"{s['model']} ({s['captioned']} new, {s['reused']} cached, {s['truncated']} cut at the token bound), "
            f"{s['failed']} failed, {s['without_caption']} without caption; {s['tokens_per_s_mean']:.1f} tokens/s of "
            f"video, {s['noun_phrases_mean']:.1f} noun phrases per caption; recurring subjects in "
            f"{s['videos_with_subjects']} of {s['videos']} videos")


def main() -> None:
    main_for("caption", prepare, body, one_line)


if __name__ == "__main__":
    main()
