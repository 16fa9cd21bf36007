"""Which torch device a stage runs on, from its ``device`` param (auto | cpu | cuda)."""
from __future__ import annotations

import os

import torch

from longlive_core.config import ConfigError


def pick_device(name: str, param: str = "device") -> torch.device:
    """auto: CUDA when there is one. Under torchrun each rank takes its own GPU (LOCAL_RANK).
    ``param`` names the setting in error messages (e.g. "iqa_filter.device")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{param} is cuda but no CUDA device is visible")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ConfigError(f"rank {local} has no GPU of its own: this machine has {torch.cuda.device_count()}; "
                              "start at most that many ranks, or set device: cpu")
        return torch.device("cuda", local)
    if name != "cpu":
        raise ConfigError(f"{param} must be auto, cpu or cuda; got {name!r}")
    return torch.device(name)
