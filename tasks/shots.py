"""DVC stage `shots`: splits every usable video into shots (PySceneDetect), applies the shot-length
rules and stores the clips in tar shards. Outputs data/shots/shots.parquet (usable shots) and
data/shots/rejected.parquet (too-short shots and videos that failed, with reasons). Reruns only
split new videos (state in data/shots/state/, clips in data/shots/clips/, both persist)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.io.atomic import remove_stale_tmp, write_parquet
from longlive_core.parallel import DaskConfig, make_executor
from longlive_core.shots.detect import ShotsConfig
from longlive_core.shots.split import split_videos
from longlive_core.tracking.lineage import digest_file
from tasks.paths import CLIPS, MANIFEST, REJECTED, SHOTS, SHOTS_STATE, raw_root
from tasks.stage import main_for


@dataclasses.dataclass(frozen=True)
class Prepared:
    shots: ShotsConfig
    raw_root: Path
    dask: DaskConfig


def prepare(params) -> Prepared:
    dask = DaskConfig.from_params(params)
    return Prepared(stage_config(ShotsConfig, "shots", params), raw_root(params), dask)


def body(cfg: Prepared, run):
    remove_stale_tmp(CLIPS)
    run.set_tags({"input.manifest.sha256": digest_file(MANIFEST)})
    manifest = pd.read_parquet(MANIFEST)
    out = split_videos(manifest, cfg.raw_root, cfg.shots, SHOTS_STATE, CLIPS,
                       make_executor(cfg.shots.executor, cfg.shots.workers, cfg.dask))
    write_parquet(out.shots, SHOTS)
    write_parquet(out.rejected, REJECTED)
    run.log_metrics(out.counts)
    run.log_artifact(SHOTS)
    run.log_artifact(REJECTED)
    return dict(out.counts)


def one_line(s) -> str:
    return (f"{s['videos']} videos -> {s['shots']} usable shots ({s['usable_s']:.1f} s), "
            f"{s['shots_rejected_short']} too short, {s['videos_failed']} videos failed; "
            f"{s['videos_split']} split, {s['videos_reused']} reused; {s['video_s_per_s']:.1f} video-s/s")


def main() -> None:
    main_for("shots", prepare, body, one_line)


if __name__ == "__main__":
    main()
