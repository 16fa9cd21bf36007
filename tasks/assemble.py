"""DVC stage `assemble`: consecutive kept shots -> multi-shot samples with per-shot captions,
duration buckets and a train/val split by video. Outputs data/samples/samples.parquet and the
curation report in reports/curation/ (also logged to MLflow)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.data.assemble import AssembleConfig, assemble_samples
from longlive_core.data.curation_report import ReportInputs, write_curation_report
from longlive_core.data.ingest import IngestConfig
from longlive_core.data.sources import local_root
from longlive_core.io.atomic import write_parquet
from longlive_core.iqa.metrics import IQAConfig, lower_is_better
from longlive_core.shots.detect import ShotsConfig
from longlive_core.tracking.lineage import digest_file
from tasks.ingest import MANIFEST
from tasks.iqa_filter import SCORES
from tasks.shots import CLIPS, REJECTED
from tasks.stage import main_for

SAMPLES = Path("data/samples/samples.parquet")
REPORT = Path("reports/curation")


def body(params, run):
    cfg = stage_config(AssembleConfig, "assemble", params)
    ingest_cfg = stage_config(IngestConfig, "ingest", params)
    run.set_tags({"input.scores.sha256": digest_file(SCORES), "input.manifest.sha256": digest_file(MANIFEST)})
    scores = pd.read_parquet(SCORES)
    out = assemble_samples(scores, pd.read_parquet(MANIFEST),
                           local_root(ingest_cfg.source, ingest_cfg.cache_dir), cfg)
    write_parquet(out.samples, SAMPLES)
    run.log_metrics(out.counts)
    run.log_artifact(SAMPLES)

    shots_cfg = stage_config(ShotsConfig, "shots", params)
    iqa_cfg = stage_config(IQAConfig, "iqa_filter", params)
    report = ReportInputs(scores=scores, rejected_shots=pd.read_parquet(REJECTED), samples=out.samples,
                          clips_dir=CLIPS, min_shot_s=shots_cfg.min_shot_s, max_shot_s=shots_cfg.max_shot_s,
                          metric=iqa_cfg.metric, threshold=iqa_cfg.thresholds[iqa_cfg.metric],
                          lower_better=lower_is_better(iqa_cfg.metric), min_motion=iqa_cfg.min_motion)
    write_curation_report(report, REPORT)
    run.log_artifact(REPORT, "curation")
    return dict(out.counts)


def one_line(s) -> str:
    buckets = ", ".join(f"{k[7:]}: {v}" for k, v in s.items() if k.startswith("bucket_"))
    return (f"{s['samples']} samples ({s['train']} train, {s['val']} val; {buckets}) from {s['kept_shots']} kept "
            f"shots; {s['samples_too_short']} too short, {s['missing_captions']} shots without caption")


def main() -> None:
    main_for("assemble", body, one_line)


if __name__ == "__main__":
    main()
