"""Scheduled retraining: bring in new raw videos, run the pipeline, and act on `evaluate`'s verdict.

`ingest` lists its source (the S3 prefix in production) on every run, so a `dvc repro` is the sync:
new objects are mirrored and everything downstream of them reruns. `package` moves the registry's
`champion` alias only when the verdict passed; this flow reads what happened and says it (promoted,
or the champion stays and why). `prefect.yaml` deploys it on a cron schedule.

    longlive-retrain --dry-run      # what would run, nothing runs
    longlive-retrain                # one retraining now
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.config import EXECUTORS
from flows.pipeline import (
    cancel_jobs_on_signals,
    dry_run_text,
    longlive_pipeline,
    patient_temporary_server,
    pending_stages,
)
from longlive_core.tracking.lineage import digest_file

SCORES = Path("reports/evaluate/scores.json")
PACKAGE_REPORT = Path("reports/package/run.json")
MANIFEST = Path("data/ingest/manifest.parquet")


@dataclass
class Outcome:
    promoted: bool
    message: str
    version: str | None = None
    reasons: list[str] = field(default_factory=list)
    new_videos: int | None = None


def read_outcome(repo_root: str | Path, scores_before: str | None) -> Outcome:
    """What the run did to the champion, from evaluate's scores and package's report."""
    root = Path(repo_root)
    scores_path, package_path = root / SCORES, root / PACKAGE_REPORT
    if not scores_path.is_file():
        return Outcome(False, f"no verdict: {SCORES} was not written (evaluate did not run), so nothing was promoted")
    if scores_before is not None and digest_file(scores_path) == scores_before:
        return Outcome(False, "no new model: nothing upstream of evaluate changed, the champion stays")
    verdict = json.loads(scores_path.read_text()).get("verdict") or {}
    reasons = list(verdict.get("reasons", []))
    if not verdict.get("passed"):
        return Outcome(False, "the verdict failed, the champion stays: " + "; ".join(reasons), reasons=reasons)
    if not package_path.is_file():
        return Outcome(False, f"the verdict passed but {PACKAGE_REPORT} was not written (package did not run)",
                       reasons=reasons)
    report = json.loads(package_path.read_text())
    if report.get("verdict_passed") is not True:
        return Outcome(False, "package ran on another verdict than evaluate's last one: rerun the pipeline",
                       reasons=reasons)
    if not report.get("registered_version"):
        return Outcome(False, f"the verdict passed but bundle {report.get('version')} was not registered "
                              "(package.register is false or the registry was unreachable)",
                       version=report.get("version"), reasons=reasons)
    if not report.get("promoted"):
        return Outcome(False, f"the verdict passed but bundle {report['version']} was not promoted: "
                              f"{report.get('promotion')}", version=report["version"], reasons=reasons)
    return Outcome(True, f"bundle {report['version']} is the new champion (registry version "
                         f"{report['registered_version']})", version=report["version"], reasons=reasons)


def _videos(root: Path) -> int | None:
    import pandas as pd

    path = root / MANIFEST
    return int((pd.read_parquet(path, columns=["status"])["status"] == "ok").sum()) if path.is_file() else None


@flow(name="longlive-retrain", log_prints=True)
def retrain(repo_root: str = ".", dry_run: bool = False, executor: str | None = None) -> dict:
    logger = get_run_logger()
    root = Path(repo_root).resolve()
    if dry_run:
        changed, after = pending_stages(root)
        text = dry_run_text(changed, after)
        logger.info("dry run: %s", text)
        create_markdown_artifact(key="retrain-dry-run", markdown=f"## dry run\n\n{text}\n")
        return {"dry_run": True, "changed": changed, "may_run_after": after}
    scores_before = digest_file(root / SCORES) if (root / SCORES).is_file() else None
    videos_before = _videos(root)
    longlive_pipeline(repo_root=str(root), executor=executor)
    outcome = read_outcome(root, scores_before)
    videos_after = _videos(root)
    if videos_after is not None:
        outcome.new_videos = videos_after - (videos_before or 0)
    logger.info("retraining: %s", outcome.message)
    lines = ["## retraining", "", outcome.message, ""]
    if outcome.new_videos is not None:
        lines += [f"usable videos added since the last run: {outcome.new_videos}", ""]
    lines += [f"- {r}" for r in outcome.reasons]
    create_markdown_artifact(key="retrain-outcome", markdown="\n".join(lines))
    return asdict(outcome)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive-retrain", description="One retraining run (what the schedule runs).")
    ap.add_argument("--repo", default=".", help="repository root (default: .)")
    ap.add_argument("--dry-run", action="store_true", help="show what would run; run nothing")
    ap.add_argument("--executor", choices=EXECUTORS, help="overrides params orchestration for this run")
    args = ap.parse_args(argv)
    cancel_jobs_on_signals()
    with patient_temporary_server():
        result = retrain(repo_root=args.repo, dry_run=args.dry_run, executor=args.executor)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
