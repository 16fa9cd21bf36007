"""umT5 kept in host memory by a process that embeds many prompt files (``Generator``).

Loading umT5-XXL's 11 GB from its folder for every prompt file took 1.2 s of a later video's 2.8 s to
its first frame on the H200 (bench/RESULTS.md), most of it pageable host-to-device copies. Kept
page-locked on the host, its weights are copied to the GPU for one file's embedding at the link's
speed and let go after, so nothing of umT5 is on the GPU while the DiT runs. The price: the weights
stay in the process's host memory (11 GB a rank).
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from longlive_core.models.text import TextEncoder, load_text_encoder, text_dtype, tiny_text_encoder


class HostTextEncoder:
    """``text_encoder_from``'s encoder for ``device``, in its dtype but held on the host (page-locked
    where ``device`` is a GPU); ``on()`` puts its weights on ``device`` for a block."""

    def __init__(self, path: str, max_length: int, device: torch.device | str):
        self.device = torch.device(device)
        dtype = text_dtype(self.device)
        # loaded on the CPU in the device's dtype: umT5-XXL in float32 would be 22 GB
        self.encoder = tiny_text_encoder(dim=32, max_length=max_length) if path == "tiny" else \
            load_text_encoder(path, max_length=max_length, dtype=dtype)
        self.encoder.model.to(dtype)
        self.weights = [t for _, t in itertools.chain(self.encoder.model.named_parameters(),
                                                      self.encoder.model.named_buffers())]
        if self.device.type == "cuda":
            for t in self.weights:
                t.data = t.data.pin_memory()

    @contextlib.contextmanager
    def on(self) -> Iterator[TextEncoder]:
        """The encoder with its weights on the device until the block ends (a tied weight copied once)."""
        if self.device.type == "cpu":
            yield self.encoder
            return
        host = [t.data for t in self.weights]
        try:
            for t in self.weights:
                t.data = t.data.to(self.device, non_blocking=True)
            yield self.encoder
        finally:
            for t, data in zip(self.weights, host):
                t.data = data
