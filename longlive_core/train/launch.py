"""The one way a training stage starts its ranks: ``torchrun`` with the world size from params.

One node: ``--standalone`` (a local rendezvous). Several nodes (a Slurm job runs the same command on
each): a c10d rendezvous at ``rdzv_endpoint`` (host:port of the first node) under one job id.
"""
from __future__ import annotations

import os
import sys

from longlive_core.config import ConfigError

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


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
