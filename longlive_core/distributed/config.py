"""The parallel section of a multi-rank stage's params (``train_ar``, ``distill_dmd``): its keys sit
at the stage's level (``train_ar.nproc``), validated here once for both."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    nnodes: int = 1
    nproc: int = 1  # ranks per node (GPUs, or CPU processes)
    sp: int = 1  # Balanced sequence parallelism: ranks (of one node) that split every sample's frames
    sharding: str = "full"  # full | hybrid (shard inside a node, replicate across nodes)
    device: str = "auto"

    def validate(self, where: str) -> None:
        for key in ("nnodes", "nproc"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be at least 1; got {getattr(self, key)}")
        if self.sp < 1 or self.nproc % self.sp:
            raise ConfigError(f"{where}.sp ({self.sp}) must divide nproc ({self.nproc}): a sample's ranks are on one "
                              "node (its all-to-all runs every layer)")
        if self.sharding not in ("full", "hybrid"):
            raise ConfigError(f"{where}.sharding must be full or hybrid; got {self.sharding!r}")
        if self.sharding == "hybrid" and self.nnodes < 2:
            raise ConfigError(f"{where}.sharding hybrid replicates across nodes: it needs nnodes >= 2")

    def world_layout(self) -> dict[str, int]:
        """What a checkpoint's per-rank files depend on: a resumed rank reads its predecessor's."""
        return {"nnodes": self.nnodes, "nproc": self.nproc}

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: groups of ``sp`` ranks that each work on their own samples."""
        return self.world_size // self.sp
