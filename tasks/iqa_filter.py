"""DVC stage `iqa_filter`: a quality score (pyiqa: MANIQA in production, PIQE in the demo) and a
motion score per usable shot, and the keep decision from per-metric thresholds; then, among the kept
shots, near-duplicates across videos (perceptual hashes of three frames) are removed, one copy kept
per group. This is the stage that decodes every shot anyway, and removing copies here spares every
later stage their work. Outputs data/iqa/scores.parquet. Raw scores and hashes are cached in
data/iqa/state/ (persist), so changing a threshold re-decides without re-scoring."""
from __future__ import annotations

import dataclasses

import pandas as pd

from longlive_core.config import stage_config
from longlive_core.devices import pick_device
from longlive_core.io.atomic import write_parquet
from longlive_core.iqa.metrics import IQAConfig, lower_is_better
from longlive_core.iqa.score import score_shots
from longlive_core.parallel import DaskConfig, make_executor
from longlive_core.tracking.lineage import digest_file
from tasks.paths import CLIPS, IQA_STATE, SCORES, SHOTS
from tasks.stage import main_for


@dataclasses.dataclass(frozen=True)
class Prepared:
    iqa: IQAConfig
    dask: DaskConfig


def prepare(params) -> Prepared:
    cfg = stage_config(IQAConfig, "iqa_filter", params)
    dask = DaskConfig.from_params(params)
    if not dask.remote(cfg.executor):  # here, or a local cluster here: a GPU asked for and absent is said now
        pick_device(cfg.device, "iqa_filter.device")
    return Prepared(cfg, dask)


def body(p: Prepared, run):
    cfg = p.iqa
    run.set_tags({"input.shots.sha256": digest_file(SHOTS), "iqa.metric": cfg.metric, "iqa.executor": cfg.executor,
                  "iqa.workers": str(cfg.workers)})
    executor = make_executor(cfg.executor, cfg.workers, p.dask, gpu=cfg.device == "cuda")
    out = score_shots(pd.read_parquet(SHOTS), CLIPS, cfg, IQA_STATE, executor)
    write_parquet(out.scores, SCORES)
    run.log_metrics(out.counts)
    run.log_artifact(SCORES)
    return {**out.counts, "iqa_metric": cfg.metric, "threshold": cfg.thresholds[cfg.metric],
            "lower_better": lower_is_better(cfg.metric)}


def one_line(s) -> str:
    return (f"{s['shots']} shots scored with {s['iqa_metric']} ({s['scored']} new, {s['reused']} cached): "
            f"{s['kept']} kept, {s['rejected_quality']} below quality, {s['rejected_unscorable']} unscorable "
            f"({s['unscorable_frames']} frames left out in all), {s['rejected_static']} static, "
            f"{s['rejected_duplicate']} near-duplicates ({s['duplicate_groups']} groups)")


def main() -> None:
    main_for("iqa_filter", prepare, body, one_line)


if __name__ == "__main__":
    main()
