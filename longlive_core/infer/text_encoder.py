"""The text encoder of a ``Generator``: loaded from its folder for each prompt file, or kept in host memory.

One video a process (``longlive generate``): umT5 is loaded onto the GPU for the prompt file and let
go before the DiT runs (``FileTextEncoder``). Many videos a process (evaluate's suite, the benches):
loading umT5-XXL's 11 GB from its folder for every prompt file took 1.26 s on an H100, most of it
pageable host-to-device copies; kept page-locked on the host, its weights are copied to the GPU for a
file's embedding in 0.26 s and let go after (``HostTextEncoder``, bench/RESULTS.md). The price: a
5.0 s load once, and the weights held in the process's host memory (page-locked blocks are rounded up
to powers of two by torch's host allocator: about 14 GiB for umT5-XXL's 10.6), per rank.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from longlive_core.models.text import TextEncoder, load_text_encoder, text_dtype, text_encoder_from, tiny_text_encoder


class FileTextEncoder:
    """``on()``: the encoder loaded from its folder onto ``device`` for a block (``text_encoder_from``)."""

    def __init__(self, path: str, max_length: int, device: torch.device | str):
        self.path, self.max_length, self.device = path, max_length, torch.device(device)

    @contextlib.contextmanager
    def on(self) -> Iterator[TextEncoder]:
        yield text_encoder_from(self.path, self.max_length, self.device)

    def close(self) -> None:
        """Nothing is held between prompt files."""


class HostTextEncoder:
    """``text_encoder_from``'s encoder for ``device``, in its dtype but held on the host (page-locked
    where ``device`` is a GPU); ``on()`` puts its weights on ``device`` for a block (one block at a
    time: the weights are swapped in place)."""

    def __init__(self, path: str, max_length: int, device: torch.device | str):
        self.device = torch.device(device)
        dtype = text_dtype(self.device)
        # loaded on the CPU in the device's dtype (umT5-XXL in float32 would be 22 GB): text_encoder_from takes
        # the device's dtype only onto the device, and models/text.py is in encode_latents' reuse key (a change
        # there encodes every cached latent again), so its two branches are repeated here
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

    def close(self) -> None:
        """Gives the page-locked memory back to the system (torch's host allocator keeps freed blocks)."""
        self.weights = []
        self.encoder = None
        if self.device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
