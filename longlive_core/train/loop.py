"""The step loop every training stage runs (train_ar, distill_dmd): resume, the per-step RNG, the
history, progress, MLflow's cadence and checkpoints. A trainer plugs in only its step
(``StepTrainer``); the loop owns everything around it, once for both.

Every rank runs the loop. Rank 0 decides where to resume (``CheckpointStore.resume``), every rank
loads that checkpoint, then each step ``s`` reseeds torch's global RNG from (seed, "rng", s, rank)
(stochastic rounding, dropout: nothing depends on how many steps ran before in this process), runs
the trainer's step, and on rank 0 appends the step's metrics to the history and hands them to the
sink every ``log_every`` steps. Checkpoints every ``checkpoint_every`` steps and at the target.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from longlive_core.progress import Progress
from longlive_core.tracking.lineage import git_state, runtime_versions
from longlive_core.train.checkpointing import HISTORY, CheckpointStore, agree, read_history, write_history
from longlive_core.train.config import CheckpointConfig
from longlive_core.train.data import generator_for

MetricsSink = Callable[[dict, int], None]  # (metrics, step): rank 0's MLflow logging


class StepTrainer(Protocol):
    """What a trainer gives the loop."""

    device: torch.device
    store: CheckpointStore

    def checkpointed(self) -> tuple[Any, Any, dict]:
        """(the module(s) and optimizer(s) a checkpoint holds, extra tensors by name: the EMA)."""

    def rank_state(self) -> dict[str, torch.Tensor] | None:
        """Tensors of this rank alone (the error-recycling buffers), or None."""

    def load_rank_state(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def schedule(self) -> dict[str, Any]:
        """How this run computes, where that changes no number (activation checkpointing, compile, the
        attention kernels): the lineage records it per step range."""

    def train_step(self, step: int) -> dict[str, float]:
        """Step ``step`` (0-based); its metrics, with "skipped": how many optimizer steps were skipped."""

    def after_step(self, done: int, seconds: float, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics that need the step's time or run at a cadence (throughput, validation)."""


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    name: str  # the stage, for log lines
    steps: int  # the target
    seed: int
    log_every: int
    checkpoint: CheckpointConfig


def run_steps(trainer: StepTrainer, s: LoopSettings, sink: MetricsSink | None = None,
              stop_after: int | None = None) -> dict:
    """Trains from the newest intact checkpoint of this run digest at or before ``s.steps`` to
    ``s.steps``; ``stop_after`` ends the run after that step, as a kill after a checkpoint would (for
    tests of resumption). Returns what the loop knows of the run: its start, steps, skipped steps and
    lineage (each step range and how it was computed)."""
    rank, store, device = dist.get_rank(), trainer.store, trainer.device
    point = agree(store.resume(s.steps, s.checkpoint.resume == "force") if rank == 0 else None)
    store.bind(point, {**trainer.schedule(), **runtime_versions(), **git_state(".")})
    logging.getLogger(__name__).info("%s: %s", s.name, point.why)
    log = logging.getLogger(f"longlive_core.{s.name}")
    skipped = 0
    if point.step:
        store.load(*trainer.checkpointed())
        if trainer.rank_state() is not None:
            trainer.load_rank_state(store.load_rank_state())
        skipped = point.skipped_steps
    start = point.step
    last = min(s.steps, stop_after) if stop_after is not None else s.steps
    progress = Progress(log, s.name, max(0, last - start), "steps") if rank == 0 else None
    history = store.history.open("a") if rank == 0 else None
    try:
        for step in range(start, last):
            t0 = time.perf_counter()
            torch.manual_seed(generator_for(s.seed, "rng", step, rank).initial_seed())
            metrics = trainer.train_step(step)
            if n := int(metrics.pop("skipped")):
                skipped += n
                log.warning("%s: step %d skipped: %s", s.name, step + 1, _numbers(metrics))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            done = step + 1
            metrics = {**trainer.after_step(done, time.perf_counter() - t0, metrics), "skipped_steps": skipped}
            if rank == 0:
                # per-layer detail (names with a /) goes to MLflow alone
                history.write(json.dumps({"step": done, **{k: v for k, v in metrics.items() if "/" not in k}}) + "\n")
                history.flush()
                if sink is not None and (done % s.log_every == 0 or done == last):
                    sink(metrics, done)
                progress.advance()
            if done % s.checkpoint.checkpoint_every == 0 or done == s.steps:
                model, optimizer, extra = trainer.checkpointed()
                store.save(done, model, optimizer, extra, {"skipped_steps": skipped}, trainer.rank_state())
    finally:
        if history is not None:
            history.close()
    return {"start_step": start, "resume": point.why, "steps": last, "steps_run": max(0, last - start),
            "skipped_steps": skipped, "lineage": store.lineage_until(last), "checkpoints": point.run_dir}


def report_history(summary: dict, target: Path) -> None:
    """The run's history (each step up to the one exported, as logged) as ``target`` (a report)."""
    write_history(target, [r for r in read_history(Path(summary["checkpoints"]) / HISTORY)
                           if r["step"] <= summary["steps"]])


def sum_over_ranks(values: list, device: torch.device) -> list[float]:
    """Numbers or device scalars (read here, in the one host sync this costs), summed over all ranks."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    dist.all_reduce(t)
    return t.tolist()


def peak_memory_mb(device: torch.device, step_peak=None) -> float:
    """The run's peak so far: on CUDA the allocator's, and where a budget planner resets that counter
    between steps, the most its ``StepPeak`` carried (work between steps included); else the RSS."""
    if device.type == "cuda":
        carried = 0 if step_peak is None else step_peak.overall()
        return max(torch.cuda.max_memory_allocated(device), carried) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _numbers(metrics: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in metrics.items() if "loss" in k or "grad_norm" in k)
