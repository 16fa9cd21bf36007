"""An exponential moving average of the weights, kept in float32 beside the FSDP shards (each rank
averages its own shard; no communication until the averaged weights are exported)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from longlive_core.distributed.parallelize import clean_name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMA:
    def __init__(self, model: nn.Module, decay: float, start_step: int):
        self.decay, self.start_step = decay, start_step
        self.shadow = {clean_name(n): p.detach().float().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After the optimizer step of ``step`` (0-based): a copy before ``start_step``, the average from it.
        One multi-tensor op over every local shard (the weights are float32 masters, like the shadow)."""
        pairs = [(_local(self.shadow[clean_name(n)]), _local(p.detach())) for n, p in model.named_parameters()]
        shadows, params = [s for s, _ in pairs], [p.float() for _, p in pairs]
        if step < self.start_step:
            torch._foreach_copy_(shadows, params)
        else:
            torch._foreach_lerp_(shadows, params, 1.0 - self.decay)

    def full_state_dict(self, keep: bool) -> dict[str, torch.Tensor]:
        """Collective: every averaged weight whole; on the CPU where ``keep``, else dropped."""
        out = {}
        for name, t in self.shadow.items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if keep:
                out[name] = full.detach().cpu()
        return out
