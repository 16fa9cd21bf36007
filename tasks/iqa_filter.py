"""DVC stage `iqa_filter`: a quality score (pyiqa: MANIQA in production, PIQE in the demo) and a
motion score per usable shot, and the keep decision from per-metric thresholds. Outputs
data/iqa/scores.parquet. Raw scores are cached in data/iqa/state/ (persist), so changing a
threshold re-decides without re-scoring."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.devices import pick_device
from longlive_core.io.atomic import write_parquet
from longlive_core.iqa.metrics import IQAConfig, QualityMetric
from longlive_core.iqa.score import score_shots
from longlive_core.tracking.lineage import digest_file
from tasks.shots import CLIPS, SHOTS
from tasks.stage import main_for

OUT = Path("data/iqa")
SCORES = OUT / "scores.parquet"
STATE = OUT / "state"


def body(params, run):
    cfg = stage_config(IQAConfig, "iqa_filter", params)
    device = pick_device(cfg.device, "iqa_filter.device")
    run.set_tags({"input.shots.sha256": digest_file(SHOTS), "iqa.metric": cfg.metric, "device": str(device)})
    metric = QualityMetric(cfg, device)
    out = score_shots(pd.read_parquet(SHOTS), CLIPS, cfg, metric, STATE)
    write_parquet(out.scores, SCORES)
    run.log_metrics(out.counts)
    run.log_artifact(SCORES)
    return {**out.counts, "iqa_metric": cfg.metric, "threshold": cfg.thresholds[cfg.metric],
            "lower_better": metric.lower_better}


def one_line(s) -> str:
    return (f"{s['shots']} shots scored with {s['iqa_metric']} ({s['scored']} new, {s['reused']} cached): "
            f"{s['kept']} kept, {s['rejected_quality']} below quality, {s['rejected_static']} static")


def main() -> None:
    main_for("iqa_filter", body, one_line)


if __name__ == "__main__":
    main()
