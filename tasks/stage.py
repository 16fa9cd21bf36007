"""What every stage module shares: params, logging, the MLflow run and the run report.

A stage body gets its params and the open StageRun and returns a summary dict; the summary is
written to ``reports/<stage>/run.json`` (with the MLflow run id) and ends the log as one line.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longlive_core.config import ConfigError, load_params, stage_config
from longlive_core.data.sources import SourceError
from longlive_core.io.atomic import write_json
from longlive_core.progress import setup_logging
from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig

REPORTS = Path("reports")


def report_path(stage: str) -> Path:
    return REPORTS / stage / "run.json"


def run_stage(stage: str, body: Callable[[dict[str, Any], StageRun], dict[str, Any]],
              one_line: Callable[[dict[str, Any]], str]) -> int:
    setup_logging()
    log = logging.getLogger(f"stage.{stage}")
    try:
        params = load_params()
        tracking = stage_config(TrackingConfig, "tracking", params) if "tracking" in params else TrackingConfig()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    start = time.monotonic()
    try:
        with StageRun(tracking, stage) as run:  # an exception marks the MLflow run FAILED
            run.log_params({stage: params.get(stage, {})})
            summary = body(params, run)
            summary["elapsed_s"] = round(time.monotonic() - start, 3)
            run.log_metrics({"elapsed_s": summary["elapsed_s"]})
            summary["mlflow_run_id"] = run.run_id
            write_json(summary, report_path(stage))
            run.log_artifact(report_path(stage))
    except (ConfigError, SourceError) as exc:  # bad params or source: the message says what to fix
        log.error("%s: %s", stage, exc)
        return 2
    log.info("%s: %s (%.1fs)", stage, one_line(summary), summary["elapsed_s"])
    return 0


def main_for(stage: str, body, one_line) -> None:
    sys.exit(run_stage(stage, body, one_line))
