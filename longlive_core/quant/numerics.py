"""Per-layer quantization SQNR, cheap enough to log every N training steps.

    with record_sqnr(model) as sqnr:
        loss = step(model); loss.backward()
    sqnr.values  # {"blocks.0.attn.qkv": {"weight": 27.1, "input": 19.8, "grad_output": 17.5}, ...}

While the block is open every converted layer measures 10*log10(|x|^2 / |x - Q(x)|^2) of the
operands it quantizes anyway (one extra reduction each); outside it they measure nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from longlive_core.quant.linear import NVFP4Linear


@dataclasses.dataclass
class SQNRRecord:
    values: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def flat(self, prefix: str = "sqnr") -> dict[str, float]:
        """{"sqnr/<layer>/<operand>": dB}: ready for an MLflow log_metrics call."""
        return {f"{prefix}/{layer}/{kind}": v for layer, kinds in self.values.items() for kind, v in kinds.items()}


@contextlib.contextmanager
def record_sqnr(model: nn.Module):
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    probes: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
    record = SQNRRecord()
    for name, layer in layers.items():
        layer.probe = probes[name]
    try:
        yield record
    finally:
        for layer in layers.values():
            layer.probe = None
        record.values = {name: {k: float(v) for k, v in p.items()} for name, p in probes.items() if p}
