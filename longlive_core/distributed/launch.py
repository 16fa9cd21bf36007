"""The one way a training stage starts its ranks: ``torchrun`` with the world size from params.

One node: ``--standalone`` (a local rendezvous). Several nodes: a c10d rendezvous at
``rdzv_endpoint`` (host:port of the first node) under one job id; inside a Slurm allocation
(infra/slurm/stage.sbatch.j2 sets the endpoint) ``srun`` starts that torchrun once on every node.
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import TYPE_CHECKING

from longlive_core.config import ConfigError

if TYPE_CHECKING:
    import torch

RDZV_ENV = "LONGLIVE_RDZV_ENDPOINT"  # host:port of the rendezvous for multi-node runs
RDZV_ID_ENV = "LONGLIVE_RDZV_ID"


def torchrun_command(module: str, nnodes: int, nproc: int, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None) -> list[str]:
    """The command that runs ``python -m module`` on ``nproc`` ranks of this node, of ``nnodes``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        endpoint = rdzv_endpoint or os.environ.get(RDZV_ENV)
        if not endpoint:
            raise ConfigError(f"{nnodes} nodes need a rendezvous: set {RDZV_ENV}=host:port (the first node) on each "
                              "node, as the cluster job script does")
        cmd += [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                f"--rdzv_id={rdzv_id or os.environ.get(RDZV_ID_ENV, 'longlive')}"]
    return [*cmd, "-m", module]


def launch_command(module: str, nnodes: int, nproc: int) -> list[str]:
    """The command a stage re-executes itself as: torchrun on this node, or under a Slurm allocation of
    several nodes ``srun`` running torchrun on each (the job's one process holds the DVC lock)."""
    cmd = torchrun_command(module, nnodes, nproc)
    if nnodes == 1:
        return cmd
    if not os.environ.get("SLURM_JOB_ID"):
        return cmd  # another launcher started this on every node with the rendezvous set
    allocated = int(os.environ.get("SLURM_JOB_NUM_NODES") or 0)
    if allocated != nnodes:
        raise ConfigError(f"params ask for {nnodes} nodes but this Slurm job holds {allocated}: submit the stage "
                          "through the flow (it sizes the job from params) or fix nnodes")
    return ["srun", f"--nodes={nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL", *cmd]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_process_group(device: torch.device, *, alone: bool = False, timeout: datetime.timedelta | None = None) -> None:
    """This rank's process group: NCCL between GPUs (``device`` made the current GPU first), gloo on the
    CPU. ``alone``: a world of one made in memory, no rendezvous: a one-rank stage runs in its own
    process, not under torchrun (its launcher and a second interpreter importing the stage again would
    cost seconds and give nothing)."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
