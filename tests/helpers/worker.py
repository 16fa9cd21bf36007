"""The main of the torchrun test workers: ``python -m tests.helpers.<worker> SPEC.json OUT_DIR`` runs
each of SPEC.json's ``runs`` in order in one process group (gloo), its results under OUT_DIR/<name>."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from longlive_core.distributed.launch import join_process_group


def main_over_runs(run_one: Callable[[dict, Path], None]) -> None:
    spec_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    join_process_group(torch.device("cpu"))  # gloo: the workers run on the CPU
    try:
        for spec in json.loads(spec_path.read_text())["runs"]:
            run_one(spec, out / spec["name"])
    finally:
        dist.destroy_process_group()
