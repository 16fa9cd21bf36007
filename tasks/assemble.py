"""DVC stage `assemble`: consecutive kept shots -> multi-shot samples with per-shot captions (the
caption stage's, each with its source), duration buckets and a train/val split by video. Outputs
data/samples/samples.parquet and the curation report in reports/curation/ (also logged to MLflow)."""
from __future__ import annotations

import dataclasses

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.data.assemble import AssembleConfig, assemble_samples
from longlive_core.data.curation_report import ReportInputs, write_curation_report
from longlive_core.io.atomic import write_parquet
from longlive_core.iqa.metrics import IQAConfig, lower_is_better
from longlive_core.shots.detect import ShotsConfig
from longlive_core.tracking.lineage import digest_file
from tasks.paths import CAPTIONS, CLIPS, CURATION_REPORT, REJECTED, SAMPLES, SCORES
from tasks.stage import main_for


@dataclasses.dataclass(frozen=True)
class Prepared:
    assemble: AssembleConfig
    shots: ShotsConfig  # the thresholds the curation report draws
    iqa: IQAConfig


def prepare(params) -> Prepared:
    return Prepared(stage_config(AssembleConfig, "assemble", params), stage_config(ShotsConfig, "shots", params),
                    stage_config(IQAConfig, "iqa_filter", params))


def body(p: Prepared, run):
    run.set_tags({"input.scores.sha256": digest_file(SCORES), "input.captions.sha256": digest_file(CAPTIONS)})
    scores, captions = pd.read_parquet(SCORES), pd.read_parquet(CAPTIONS)
    out = assemble_samples(scores, captions, p.assemble)
    write_parquet(out.samples, SAMPLES)
    run.log_metrics(out.counts)
    run.log_artifact(SAMPLES)

    report = ReportInputs(scores=scores, rejected_shots=pd.read_parquet(REJECTED), samples=out.samples,
                          clips_dir=CLIPS, min_shot_s=p.shots.min_shot_s, max_shot_s=p.shots.max_shot_s,
                          metric=p.iqa.metric, threshold=p.iqa.thresholds[p.iqa.metric],
                          lower_better=lower_is_better(p.iqa.metric), min_motion=p.iqa.min_motion,
                          dedup_hamming=p.iqa.dedup_hamming, captions=captions)
    counts = write_curation_report(report, CURATION_REPORT)
    run.log_metrics({f"caption_{k}": v for k, v in counts["captions"].items() if isinstance(v, (int, float))})
    run.log_artifact(CURATION_REPORT, "curation")
    return dict(out.counts)


def one_line(s) -> str:
    buckets = ", ".join(f"{k[7:]}: {v}" for k, v in s.items() if k.startswith("bucket_"))
    return (f"{s['samples']} samples ({s['train']} train, {s['val']} val; {buckets}) from {s['kept_shots']} kept "
            f"shots; {s['samples_too_short']} too short, {s['missing_captions']} shots without caption")


def main() -> None:
    main_for("assemble", prepare, body, one_line)


if __name__ == "__main__":
    main()
