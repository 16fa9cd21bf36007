"""Prefect flow over the DVC pipeline: one Prefect task per DVC stage, in dependency order.

Each stage runs as one `dvc repro --single-item <stage>`, so DVC still decides whether it is up to
date and records it in dvc.lock; where it runs comes from params `orchestration` (`local`: here;
`slurm`: one Slurm job, flows/slurm_job.py), or from --executor for one run. Prefect adds the run
history, logs, retries of transient failures (a lost node, a preempted job) and a markdown
artifact per stage; MLflow gets a pipeline run with every stage run nested under it and dvc.lock
attached (tasks.record_pipeline).

    longlive-flow                                  # every stage
    longlive-flow --target ingest                  # ingest and the stages it needs
    longlive-flow --executor slurm                 # every stage as a Slurm job, whatever params say
    longlive-flow --dry-run                        # the stages `dvc status` would run; nothing runs
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import networkx as nx
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

from flows.config import EXECUTORS, orchestration_config
from flows.slurm_job import SlurmError, SlurmJobFailed, cancel_active, run_stage_job
from longlive_core.config import load_params
from longlive_core.tracking.mlflow_run import PARENT_RUN_ENV, StageRun


def dependency_order(graph) -> list:
    """The stages of a DVC graph, each after everything it depends on (ties by name)."""
    return list(reversed(list(nx.lexicographical_topological_sort(graph, key=lambda s: s.name))))


def stage_order(repo_root: str | Path, targets: list[str] | None = None) -> list[str]:
    """DVC stage names in the order they must run (each target with everything it depends on)."""
    from dvc.repo import Repo

    with Repo(str(repo_root)) as repo:
        graph = repo.index.graph  # an edge points from a stage to a stage it depends on
        by_name = {s.name: s for s in graph.nodes}
        if targets:
            unknown = sorted(set(targets) - set(by_name))
            if unknown:
                raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has {sorted(by_name)}")
            keep = set()
            for t in targets:
                keep |= {by_name[t]} | nx.descendants(graph, by_name[t])
            graph = graph.subgraph(keep)
        return [s.name for s in dependency_order(graph)]


def pending_stages(repo_root: str | Path) -> tuple[list[str], list[str]]:
    """(stages DVC sees as changed, stages downstream of them that may run after them): what
    `dvc repro` would do, without running anything. A downstream stage is skipped at run time when
    what it reads comes out byte-identical, so the second list is an upper bound."""
    from dvc.repo import Repo

    with Repo(str(repo_root)) as repo:
        changed = {key.rsplit(":", 1)[-1] for key in repo.status()}  # "path/dvc.yaml:stage" from elsewhere
        graph = repo.index.graph  # an edge points from a stage to a stage it depends on
        by_name = {s.name: s for s in graph.nodes}
        after = set()
        for name in changed & set(by_name):
            after |= {s.name for s in nx.ancestors(graph, by_name[name])}
        order = [s.name for s in dependency_order(graph)]
    return [s for s in order if s in changed], [s for s in order if s in after - changed]


def _stream(cmd: list[str], cwd: Path, logger) -> int:
    # the stages call `python`: make it this interpreter, the one with the project installed
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PATH=path)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        logger.info(line.rstrip())
    return proc.wait()


def stage_summary_markdown(stage: str, repo_root: Path, where: str) -> str:
    """The stage's report (reports/<stage>/run.json) as a table: counts, key metrics, the MLflow run."""
    from tasks.stage import report_path

    lines = [f"## {stage}", "", f"ran: {where}", ""]
    rp = repo_root / report_path(stage)
    report = json.loads(rp.read_text()) if rp.is_file() else {}
    run_id = report.pop("mlflow_run_id", None)
    if run_id:
        lines += [f"MLflow run: `{run_id}`", ""]
    scalars = {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool))}
    if scalars:
        lines += ["| key | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(scalars.items()))]
    else:
        lines.append("(no report)")
    return "\n".join(lines)


def _transient(task, task_run, state) -> bool:
    """Retry only what the cluster caused; a stage's own error fails fast with its message."""
    try:
        state.result()
    except (SlurmJobFailed, SlurmError) as exc:
        return exc.transient
    except BaseException:
        return False
    return False


@task(name="dvc-stage", task_run_name="{stage}", retry_condition_fn=_transient)
def run_dvc_stage(stage: str, repo_root: str, executor: str | None = None) -> str:
    logger = get_run_logger()
    root = Path(repo_root)
    params = load_params(root / "params.yaml")
    cfg = orchestration_config(params)
    placement = cfg.placement(stage, params, executor)
    if placement.executor == "slurm":
        job_id = run_stage_job(placement, cfg, root, logger.info)
        where = f"Slurm job {job_id} (partition {placement.resources.partition}, {placement.nodes} node(s))"
    else:
        rc = _stream([sys.executable, "-m", "dvc", "repro", "--single-item", stage], root, logger)
        if rc != 0:
            raise RuntimeError(f"dvc repro --single-item {stage} exited with {rc}; its log is above")
        where = "locally"
    create_markdown_artifact(key=f"stage-{stage.replace('_', '-')}",
                             markdown=stage_summary_markdown(stage, root, where),
                             description=f"{stage}: what the stage reported")
    return stage


@task(name="record-pipeline", task_run_name="record-pipeline")
def record(repo_root: str, run_id: str | None) -> str | None:
    from tasks.record_pipeline import record_pipeline

    return record_pipeline(repo_root, run_id)


@flow(name="longlive-pipeline", log_prints=True)
def longlive_pipeline(repo_root: str = ".", targets: list[str] | None = None, executor: str | None = None) -> list[str]:
    from tasks.record_pipeline import tracking_config

    logger = get_run_logger()
    root = str(Path(repo_root).resolve())
    if executor is not None and executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r} is not one of {EXECUTORS}")
    cfg = orchestration_config(load_params(Path(root) / "params.yaml"))
    order = stage_order(root, targets)
    logger.info("stages in order: %s", ", ".join(order))
    stage_task = run_dvc_stage.with_options(
        retries=cfg.retries, retry_delay_seconds=[cfg.retry_delay_s * 2 ** i for i in range(cfg.retries)])
    done = []
    with StageRun(tracking_config(root), "pipeline", root) as parent:
        previous = os.environ.get(PARENT_RUN_ENV)
        if parent.run_id:
            os.environ[PARENT_RUN_ENV] = parent.run_id  # the stages' runs (here or in Slurm jobs) nest under it
        try:
            for stage in order:
                done.append(stage_task(stage, root, executor))
            record(root, parent.run_id)
        finally:
            if previous is None:
                os.environ.pop(PARENT_RUN_ENV, None)
            else:
                os.environ[PARENT_RUN_ENV] = previous
    return done


def exit_on_signal(signum, frame):
    cancel_active()  # jobs of this run must not outlive it
    raise SystemExit(128 + signum)


def cancel_jobs_on_signals() -> None:
    """SIGINT and SIGTERM to a command-line run cancel its Slurm jobs before it exits."""
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, exit_on_signal)


# Prefect's temporary server (no PREFECT_API_URL) gets 20 s to start by default; on a 2-core machine under load its
# fresh SQLite database took longer about once in a dozen starts, and the run died before its first stage
EPHEMERAL_STARTUP_S = 120


def patient_temporary_server() -> contextlib.AbstractContextManager:
    """Prefect settings for a command-line run: a temporary server's start waited for at least
    ``EPHEMERAL_STARTUP_S`` (a longer wait the user set is kept)."""
    setting = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    return temporary_settings(updates={setting: max(setting.value(), EPHEMERAL_STARTUP_S)})


def dry_run_text(changed: list[str], after: list[str]) -> str:
    """``pending_stages``' answer in a line, for --dry-run (nothing runs)."""
    return (f"would run: {', '.join(changed) or 'nothing'}; then, if their outputs change: "
            f"{', '.join(after) or 'nothing'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive-flow", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--repo", default=".", help="repository root (default: .)")
    ap.add_argument("--target", action="append", help="a stage to run with its upstream stages (repeatable)")
    ap.add_argument("--executor", choices=EXECUTORS, help="run every stage here or as Slurm jobs (overrides "
                    "params orchestration for this run)")
    ap.add_argument("--dry-run", action="store_true", help="print the stages `dvc status` would run; run nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(dry_run_text(*pending_stages(args.repo)))
        return 0
    cancel_jobs_on_signals()
    with patient_temporary_server():
        longlive_pipeline(repo_root=args.repo, targets=args.target, executor=args.executor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
