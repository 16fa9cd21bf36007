"""What the GPU benchmarks share: random DiT weights made on the GPU, a one-rank process group, and a
profile's kernels printed by device time."""
from __future__ import annotations

import datetime

import torch

from longlive_core.distributed.launch import join_process_group
from longlive_core.models.config import DiTConfig
from longlive_core.models.wan_dit import WanDiT


def random_dit_on_gpu(cfg: DiTConfig) -> WanDiT:
    """A WanDiT of float32 N(0, 0.02) weights, made on the GPU and left there (a CPU init of a billion
    parameters takes longer than a benchmark)."""
    with torch.device("meta"):
        model = WanDiT(cfg)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def one_rank_group() -> None:
    """GPU 0 as a world of one (NCCL), for the code that runs under FSDP2: the group a one-rank stage
    makes in its own process."""
    join_process_group(torch.device("cuda", 0), alone=True, timeout=datetime.timedelta(minutes=30))


def print_kernels(prof, top: int = 12, shares: dict[str, tuple[str, ...]] | None = None) -> None:
    """``prof`` (a finished torch.profiler run)'s kernels by device time, the ``top`` longest, and the
    share of device time of each group of ``shares``: a kernel belongs to the first group holding any
    of its words in its name (case ignored), so the groups and "other" add up to the whole."""
    from torch.autograd import DeviceType

    # the kernels themselves: a CPU-side event (an op, a compiled region, a launch call, "Command Buffer Full")
    # carries the device time of the kernels under it, which would count them again
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) or 1
    groups = dict.fromkeys(shares or {}, 0.0)
    if groups:
        groups["other"] = 0.0
        for e in kernels:
            name = e.key.lower()
            group = next((g for g, words in shares.items() if any(w in name for w in words)), "other")
            groups[group] += e.device_time_total
    print(f"  kernels: {total / 1e3:.0f} ms of device time"
          + "".join(f", {g} {t / total:.0%} ({t / 1e3:.0f} ms)" for g, t in groups.items()))
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(f"  {e.device_time_total / 1e3:8.1f} ms {e.count:5d}x  {e.key[:110]}")
