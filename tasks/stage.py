"""What every stage module shares: params, logging, the MLflow run and the run report.

A stage's ``prepare`` turns params into its typed configs and checks them (sources, model paths)
before anything else happens: bad params fail with one line that says what to fix, and no MLflow
run is opened for them. Its body gets the prepared configs and the open StageRun and returns a
summary dict; the summary is written to ``reports/<stage>/run.json`` (with the MLflow run id) and
ends the log as one line.

A stage whose dvc.yaml entry declares ``reports/<stage>/params.yaml`` among its outs also gets the
params it ran with written there: the keys its ``params:`` list names, as params.yaml gave them.
Later stages (``package``, which bundles them) depend on that file instead of on params.yaml whole,
so an edit elsewhere in params.yaml reruns nothing that did not read it.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from longlive_core.config import ConfigError, load_params, stage_config
from longlive_core.data.roots import SourceError
from longlive_core.io.atomic import atomic_path, write_json
from longlive_core.models.weights import CheckpointError
from longlive_core.package.bundle import BundleError
from longlive_core.progress import setup_logging
from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig

REPORTS = Path("reports")
DVC_YAML = Path("dvc.yaml")
C = TypeVar("C")
_MISSING = object()


def report_path(stage: str) -> Path:
    return REPORTS / stage / "run.json"


def params_path(stage: str) -> Path:
    """The params ``stage`` ran with (written only when its dvc.yaml entry declares this file)."""
    return REPORTS / stage / "params.yaml"


def stage_params(stage: str, params: dict[str, Any], dvc_yaml: Path = DVC_YAML) -> dict[str, Any] | None:
    """What ``stage`` records as the params it ran with: each key of its dvc.yaml ``params:`` list
    (``train_ar`` a whole section, ``encode_latents.vae`` that one value, nested as in params.yaml),
    or None when dvc.yaml does not declare ``reports/<stage>/params.yaml`` among its outs (or there is
    no dvc.yaml: a stage run outside the repository records nothing). A key params.yaml lacks is a
    ConfigError, raised before the stage starts."""
    if not dvc_yaml.is_file():
        return None
    entry = ((yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}).get("stages") or {}).get(stage) or {}
    outs = {next(iter(o)) if isinstance(o, dict) else o for o in entry.get("outs") or ()}
    if params_path(stage).as_posix() not in outs:
        return None
    keys: list[str] = []
    for item in entry.get("params") or ():
        # DVC's two spellings: a key of params.yaml, or {file: [keys]}; only params.yaml is what load_params read
        if isinstance(item, dict):
            for file, listed in item.items():
                if file != "params.yaml":
                    raise ConfigError(f"dvc.yaml's {stage} params name {file}: only params.yaml's keys are recorded "
                                      f"in {params_path(stage)}; move those params into params.yaml")
                keys += list(listed)
        else:
            keys.append(str(item))
    recorded: dict[str, Any] = {}
    for key in keys:
        value: Any = params
        for part in key.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            raise ConfigError(f"params.yaml has no {key}, which dvc.yaml's {stage} stage reads: add it (see "
                              "configs/production.yaml for every key)")
        *parents, last = key.split(".")
        node = recorded
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return recorded


def write_stage_params(stage: str, recorded: dict[str, Any]) -> Path:
    """Writes ``reports/<stage>/params.yaml``; keys sorted, so the same values are the same bytes and
    DVC reruns nothing after a stage rerun with unchanged params."""
    target = params_path(stage)
    with atomic_path(target) as tmp:
        tmp.write_text(f"# the params {stage} ran with (its params in dvc.yaml); written by the stage\n"
                       + yaml.safe_dump(recorded, sort_keys=True, allow_unicode=True, default_flow_style=False),
                       encoding="utf-8")
    return target


def run_stage(stage: str, prepare: Callable[[dict[str, Any]], C], body: Callable[[C, StageRun], dict[str, Any]],
              one_line: Callable[[dict[str, Any]], str]) -> int:
    setup_logging()
    log = logging.getLogger(f"stage.{stage}")
    try:
        params = load_params()
        tracking = stage_config(TrackingConfig, "tracking", params) if "tracking" in params else TrackingConfig()
        cfg = prepare(params)
        recorded = stage_params(stage, params)
    except (ConfigError, SourceError, CheckpointError) as exc:  # the message says what to fix; nothing started
        log.error("%s: %s", stage, exc)
        return 2
    start = time.monotonic()
    try:
        with StageRun(tracking, stage) as run:  # an exception marks the MLflow run FAILED
            run.log_params({stage: params.get(stage, {})})
            summary = body(cfg, run)
            if recorded is not None:  # only after a body that finished: the file says what made the outputs
                run.log_artifact(write_stage_params(stage, recorded))
            summary["elapsed_s"] = round(time.monotonic() - start, 3)
            run.log_metrics({"elapsed_s": summary["elapsed_s"]})
            summary["mlflow_run_id"] = run.run_id
            write_json(summary, report_path(stage))
            run.log_artifact(report_path(stage))
    # what shows only once working (a bucket that says no, weights that do not fit their model)
    except (ConfigError, SourceError, CheckpointError, BundleError) as exc:
        log.error("%s: %s", stage, exc)
        return 2
    log.info("%s: %s (%.1fs)", stage, one_line(summary), summary["elapsed_s"])
    return 0


def main_for(stage: str, prepare, body, one_line) -> None:
    sys.exit(run_stage(stage, prepare, body, one_line))


def run_ranks(stage: str, prepare: Callable[[dict[str, Any]], C], body: Callable[[C, StageRun], dict[str, Any]],
              one_line: Callable[[dict[str, Any]], str], world: Callable[[C], Any]) -> None:
    """A stage whose body runs on ``nnodes`` x ``nproc`` ranks (``world(prepared)`` gives those and
    ``device``): validates once, re-executes itself under torchrun, and in each rank joins the process
    group (gloo on the CPU, NCCL on GPUs); rank 0 holds the MLflow run and the report. One rank of one
    node is this process itself, its group of one made in memory: torchrun's launcher and a second
    interpreter importing the stage again would add several seconds to every run and nothing else."""
    import datetime
    import os

    from longlive_core.devices import pick_device
    from longlive_core.distributed.launch import join_process_group, launch_command, under_torchrun

    setup_logging()
    launched = under_torchrun()
    if not launched:
        try:
            cfg = world(prepare(load_params()))
            alone = cfg.nnodes == 1 and cfg.nproc == 1
            cmd = None if alone else launch_command(f"tasks.{stage}", cfg.nnodes, cfg.nproc)
        except (ConfigError, SourceError, CheckpointError) as exc:
            print(f"{stage}: {exc}", file=sys.stderr)
            sys.exit(2)
        if cmd is not None:
            os.execvp(cmd[0], cmd)
    import torch.distributed as dist

    device = pick_device(world(prepare(load_params())).device, f"{stage}.device")
    join_process_group(device, alone=not launched, timeout=datetime.timedelta(hours=1))
    try:
        if dist.get_rank() == 0:
            code = run_stage(stage, prepare, body, one_line)
        else:
            body(prepare(load_params()), StageRun(TrackingConfig(enabled=False), stage))
            code = 0
    finally:
        dist.destroy_process_group()
    sys.exit(code)
