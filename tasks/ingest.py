"""DVC stage `ingest`: lists the source, hashes, probes, quarantines and de-duplicates the videos
into data/ingest/manifest.parquet. Rerunning only touches new or changed files (state in
data/ingest/state/, declared persist in dvc.yaml)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from longlive_core.config import stage_config
from longlive_core.data.ingest import IngestConfig, IngestState, ingest
from longlive_core.data.sources import check_source, open_source
from longlive_core.io.atomic import remove_stale_tmp, write_parquet
from longlive_core.tracking.lineage import digest_lines
from tasks.paths import INGEST, INGEST_STATE, MANIFEST
from tasks.stage import main_for

log = logging.getLogger("stage.ingest")


def prepare(params) -> IngestConfig:
    cfg = stage_config(IngestConfig, "ingest", params)
    check_source(cfg.source)
    return cfg


def body(cfg: IngestConfig, run):
    removed = remove_stale_tmp(INGEST)
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted run", removed)
    t0 = time.monotonic()
    cache = Path(cfg.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)  # a declared output of the stage, even for a local source
    (cache / "README.txt").write_text("Local mirror of an s3:// ingest.source (unused for a local one).\n")
    source = open_source(cfg.source, cfg.cache_dir, cfg.s3)
    listing = source.list()
    t_list = time.monotonic() - t0
    outcome = ingest(listing, cfg, IngestState(INGEST_STATE), cfg.source)
    t_all = max(time.monotonic() - t0, 1e-9)
    counts = dict(outcome.counts)
    counts.update(list_s=round(t_list, 3), ingest_s=round(t_all, 3),
                  videos_per_s=round(counts["videos"] / t_all, 3),
                  hash_mb_per_s=round(counts["bytes_hashed"] / 1e6 / max(t_all - t_list, 1e-9), 3))
    m = outcome.manifest
    write_parquet(m, MANIFEST)

    # The stage's input, as it saw it: every listed path with its content hash.
    input_digest = digest_lines(f"{r.path}\t{r.video_id}" for r in m.itertuples(index=False))
    run.set_tags({"input.source": cfg.source, "input.source.sha256": input_digest,
                  "output.manifest.rows": len(m)})
    run.log_metrics(counts)
    run.log_artifact(MANIFEST)
    quarantined = m[m["status"] == "quarantined"]
    for row in quarantined.head(20).itertuples(index=False):
        log.warning("quarantined %s: %s", row.path, row.reason)
    if len(quarantined) > 20:
        log.warning("... and %d more quarantined files: see %s", len(quarantined) - 20, MANIFEST)
    return counts


def one_line(s) -> str:
    return (f"{s['videos']} videos: {s['status_ok']} ok, {s['status_quarantined']} quarantined, "
            f"{s['status_duplicate']} duplicate; {s['hashed']} hashed, {s['probed']} probed, "
            f"{s['reused']} reused; {s['ok_duration_s']:.1f} s of usable video")


def main() -> None:
    main_for("ingest", prepare, body, one_line)


if __name__ == "__main__":
    main()
