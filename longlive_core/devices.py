"""Which torch device a stage runs on, from its ``device`` param (auto | cpu | cuda)."""
from __future__ import annotations

import contextlib
import os

import torch

from longlive_core.config import ConfigError


def pick_device(name: str, param: str = "device", slot: int | None = None) -> torch.device:
    """auto: CUDA when there is one. Under torchrun each rank takes its own GPU (LOCAL_RANK); a
    worker of an executor passes its ``slot`` and takes GPU slot mod count (workers beyond the GPUs
    share them). ``param`` names the setting in error messages (e.g. "iqa_filter.device")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{param} is cuda but no CUDA device is visible")
        if slot is not None:
            return torch.device("cuda", slot % torch.cuda.device_count())
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ConfigError(f"rank {local} has no GPU of its own: this machine has {torch.cuda.device_count()}; "
                              "start at most that many ranks, or set device: cpu")
        return torch.device("cuda", local)
    if name != "cpu":
        raise ConfigError(f"{param} must be auto, cpu or cuda; got {name!r}")
    return torch.device(name)


def made_current(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device the current one (nothing to do where it already is,
    or for a CPU tensor): Triton kernels and cuBLAS calls run on the current device's stream, torch
    ops on ``t`` on its own device's, and the two must be one."""
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)
