"""Records a finished `dvc repro` as one MLflow run: dvc.lock and params.yaml as artifacts and the
run id of each stage's latest run as tags. dvc.lock only exists once the stages are done, so this
runs after the pipeline, not inside a stage."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml

from longlive_core.config import load_params, stage_config
from longlive_core.progress import setup_logging
from longlive_core.tracking.lineage import digest_file
from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig
from tasks.stage import report_path

log = logging.getLogger("pipeline")


def tracking_config(repo_root: str | Path = ".") -> TrackingConfig:
    params = load_params(Path(repo_root) / "params.yaml")
    return stage_config(TrackingConfig, "tracking", params) if "tracking" in params else TrackingConfig()


def record_pipeline(repo_root: str | Path = ".", run_id: str | None = None) -> str | None:
    """Records into the pipeline run `run_id` (the flow's, which the stage runs nest under) or a new one."""
    root = Path(repo_root)
    lock = root / "dvc.lock"
    stages = list((yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {}))
    with StageRun(tracking_config(root), "pipeline", root, resume_run_id=run_id) as run:
        tags = {}
        for stage in stages:
            rp = root / report_path(stage)
            if rp.is_file():
                tags[f"stage.{stage}.run_id"] = json.loads(rp.read_text()).get("mlflow_run_id")
        if lock.is_file():
            tags["dvc.lock.sha256"] = digest_file(lock)
            run.log_artifact(lock)
        else:
            log.warning("no dvc.lock yet: run `dvc repro` first")
        run.set_tags(tags)
        run.log_artifact(root / "params.yaml")
        run.log_artifact(root / "dvc.yaml")
        log.info("pipeline run recorded: %d stage runs linked%s", len(tags) - ("dvc.lock.sha256" in tags),
                 f", MLflow run {run.run_id}" if run.run_id else "")
        return run.run_id


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="longlive-record-pipeline", description=__doc__).parse_args(argv)
    setup_logging()
    record_pipeline()
    sys.exit(0)


if __name__ == "__main__":
    main()
