"""DVC stage `assemble`: consecutive kept shots -> multi-shot samples with per-shot captions,
duration buckets and a train/val split by video. Outputs data/samples/samples.parquet."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.data.assemble import AssembleConfig, assemble_samples
from longlive_core.data.ingest import IngestConfig
from longlive_core.data.sources import local_root
from longlive_core.io.atomic import write_parquet
from longlive_core.tracking.lineage import digest_file
from tasks.ingest import MANIFEST
from tasks.iqa_filter import SCORES
from tasks.stage import main_for

SAMPLES = Path("data/samples/samples.parquet")


def body(params, run):
    cfg = stage_config(AssembleConfig, "assemble", params)
    ingest_cfg = stage_config(IngestConfig, "ingest", params)
    run.set_tags({"input.scores.sha256": digest_file(SCORES), "input.manifest.sha256": digest_file(MANIFEST)})
    out = assemble_samples(pd.read_parquet(SCORES), pd.read_parquet(MANIFEST),
                           local_root(ingest_cfg.source, ingest_cfg.cache_dir), cfg)
    write_parquet(out.samples, SAMPLES)
    run.log_metrics(out.counts)
    run.log_artifact(SAMPLES)
    return dict(out.counts)


def one_line(s) -> str:
    buckets = ", ".join(f"{k[7:]}: {v}" for k, v in s.items() if k.startswith("bucket_"))
    return (f"{s['samples']} samples ({s['train']} train, {s['val']} val; {buckets}) from {s['kept_shots']} kept "
            f"shots; {s['samples_too_short']} too short, {s['missing_captions']} shots without caption")


def main() -> None:
    main_for("assemble", body, one_line)


if __name__ == "__main__":
    main()
