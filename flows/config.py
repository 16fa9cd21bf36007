"""Where each stage runs, from params `orchestration`: typed, validated, merged per stage.

`orchestration` is not a DVC parameter of any stage: moving a stage to Slurm changes where it
runs, not what it makes. Nodes come from the stage's own params (`<stage>.nnodes`), so a change of
world size is a change DVC sees.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from longlive_core.config import ConfigError, from_mapping

EXECUTORS = ("local", "slurm")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")  # MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


@dataclass
class SlurmResources:
    partition: str = "local"
    account: str = ""  # empty: the user's default account
    time: str = "01:00:00"
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str = ""  # empty: the partition's default
    container_image: str = ""  # with pyxis: the stage runs in this image (the repository mounted at its path)

    def validate(self, where: str) -> None:
        if not _SLURM_TIME.match(self.time):
            raise ConfigError(f"{where}.time: {self.time!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
        if not self.partition:
            raise ConfigError(f"{where}.partition: may not be empty")
        if self.gpus_per_node < 0 or self.cpus_per_task < 1:
            raise ConfigError(f"{where}: gpus_per_node >= 0 and cpus_per_task >= 1")


@dataclass
class StagePlacement(SlurmResources):
    """`orchestration.stages.<stage>`: the executor and any Slurm resource that differs from the defaults."""
    executor: str = ""  # empty: orchestration.executor


@dataclass
class Placement:
    stage: str
    executor: str
    resources: SlurmResources
    nodes: int


@dataclass
class OrchestrationConfig:
    executor: str = "local"
    retries: int = 2  # retries after a transient failure (node failure, preemption, Slurm unreachable)
    retry_delay_s: float = 30.0  # the first retry's delay, doubled for each next one
    poll_s: float = 5.0
    rdzv_port: int = 29500
    log_dir: str = "logs/slurm"
    slurm: SlurmResources = field(default_factory=SlurmResources)
    stages: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor: {self.executor!r} is not one of {EXECUTORS}")
        if self.retries < 0 or self.retry_delay_s < 0 or self.poll_s <= 0:
            raise ConfigError(f"{where}: retries and retry_delay_s >= 0, poll_s > 0")
        for stage in self.stages:
            self.stage_placement(stage, where)

    def stage_placement(self, stage: str, where: str = "orchestration") -> StagePlacement:
        given = self.stages.get(stage) or {}
        if isinstance(given, str):  # `train_ar: slurm` is short for `train_ar: {executor: slurm}`
            given = {"executor": given}
        merged = {**dataclasses.asdict(self.slurm), **given}
        placement = from_mapping(StagePlacement, merged, f"{where}.stages.{stage}")
        if placement.executor not in ("", *EXECUTORS):
            raise ConfigError(f"{where}.stages.{stage}.executor: {placement.executor!r} is not one of {EXECUTORS}")
        return placement

    def placement(self, stage: str, params: dict[str, Any], executor: str | None = None) -> Placement:
        """Where `stage` runs; `executor` (the command line's --executor) overrides params for this run."""
        p = self.stage_placement(stage)
        chosen = executor or p.executor or self.executor
        if chosen not in EXECUTORS:
            raise ConfigError(f"executor {chosen!r} is not one of {EXECUTORS}")
        stage_params = params.get(stage) if isinstance(params.get(stage), dict) else {}
        nodes = stage_params.get("nnodes", 1)
        if not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"{stage}.nnodes: expected a positive integer, got {nodes!r}")
        if chosen == "slurm" and p.container_image and nodes > 1:
            raise ConfigError(f"orchestration.stages.{stage}.container_image: a {nodes}-node stage starts its ranks "
                              "with srun from inside the job, which a container does not have; run it on the "
                              "nodes' own environment (container_image: \"\")")
        fields = {f.name for f in dataclasses.fields(SlurmResources)}
        resources = SlurmResources(**{k: v for k, v in dataclasses.asdict(p).items() if k in fields})
        return Placement(stage, chosen, resources, nodes)


def orchestration_config(params: dict[str, Any]) -> OrchestrationConfig:
    return from_mapping(OrchestrationConfig, params.get("orchestration"), "orchestration")
