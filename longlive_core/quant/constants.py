"""The quantizers' constant tables (E2M1 magnitudes, the RHT's signs), kept on each device they run on."""
from __future__ import annotations

import torch

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, copied from the host once per device and dtype and
    reused: ``torch.tensor(values, device=...)`` is a synchronous copy, so on a GPU the host would
    wait for every queued kernel at each call (per linear, per quantized KV chunk). Callers must not
    write to it. Made outside inference mode, so autograd may save it whatever mode first asked for it;
    not for FakeTensorMode traces once cached (a real tensor in them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device: one key for it
        device = torch.device("cuda", torch.cuda.current_device())
    key = (values, device, dtype)
    table = _CONSTANTS.get(key)
    if table is None:
        with torch.inference_mode(False):
            table = torch.tensor(values, dtype=dtype, device=device)
        # a table first asked for while Dynamo traces stays the graph's own constant: cached, a traced
        # tensor would leak out of its trace (inside a checkpointed region Dynamo refuses the side effect)
        if type(table) is torch.Tensor and not torch.compiler.is_compiling():  # nor may a fake tensor outlive it
            _CONSTANTS[key] = table
    return table
