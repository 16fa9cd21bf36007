"""Prefect flow over the DVC pipeline: one Prefect task per DVC stage, in dependency order.

Each task runs `dvc repro --single-item <stage>`, so DVC still decides whether the stage is up to
date and records it in dvc.lock; Prefect adds the run history, logs and retries in its UI. After
the stages, the run is recorded in MLflow with dvc.lock attached (tasks.record_pipeline).

    longlive-flow                    # every stage
    longlive-flow --target ingest    # ingest and the stages it needs
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
from prefect import flow, get_run_logger, task


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
        order = list(reversed(list(nx.lexicographical_topological_sort(graph, key=lambda s: s.name))))
        return [s.name for s in order]


def _stream(cmd: list[str], cwd: Path, logger) -> int:
    # the stages call `python`: make it this interpreter, the one with the project installed
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PATH=path)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        logger.info(line.rstrip())
    return proc.wait()


@task(name="dvc-stage", task_run_name="{stage}", retries=0)
def run_dvc_stage(stage: str, repo_root: str) -> str:
    logger = get_run_logger()
    rc = _stream([sys.executable, "-m", "dvc", "repro", "--single-item", stage], Path(repo_root), logger)
    if rc != 0:
        raise RuntimeError(f"dvc repro --single-item {stage} exited with {rc}; its log is above")
    return stage


@task(name="record-pipeline", task_run_name="record-pipeline")
def record(repo_root: str) -> str | None:
    from tasks.record_pipeline import record_pipeline

    return record_pipeline(repo_root)


@flow(name="longlive-pipeline", log_prints=True)
def longlive_pipeline(repo_root: str = ".", targets: list[str] | None = None) -> list[str]:
    logger = get_run_logger()
    root = str(Path(repo_root).resolve())
    order = stage_order(root, targets)
    logger.info("stages in order: %s", ", ".join(order))
    done = []
    for stage in order:
        done.append(run_dvc_stage(stage, root))
    record(root)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive-flow", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--repo", default=".", help="repository root (default: .)")
    ap.add_argument("--target", action="append", help="a stage to run with its upstream stages (repeatable)")
    args = ap.parse_args(argv)
    longlive_pipeline(repo_root=args.repo, targets=args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
