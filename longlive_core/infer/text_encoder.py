"""The text encoder of a ``Generator``: loaded from its folder for each prompt file, or kept in host memory.

One video a process (``longlive generate``): umT5 is loaded onto the GPU for the prompt file and let
go before the DiT runs (``FileTextEncoder``). Many videos a process (evaluate's suite, the benches):
loading umT5-XXL's 11 GB from its folder for every prompt file took 1.26 s on an H100, most of it
pageable host-to-device copies; kept page-locked on the host, its weights are copied to the GPU for a
file's embedding in 0.26 s and let go after (``HostTextEncoder``, bench/RESULTS.md). The price: a
load once (the page-locking in a thread beside the rest of the model's), and the weights held in the
process's host memory, per rank: umT5-XXL's 10.6 GiB in one buffer.
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from longlive_core.models.text import TextEncoder, load_text_encoder, text_dtype, text_encoder_from, tiny_text_encoder

_ALIGN = 256  # bytes: each weight's offset in the host buffer (as cudaMalloc aligns)


def _cuda_error(error) -> str:
    """The CUDA runtime's name and description of an error code torch's cudart bindings returned."""
    try:
        described = f" ({torch.cuda.cudart().cudaGetErrorString(error)})"
    except (AttributeError, TypeError):  # a torch build without that binding: the number alone
        described = ""
    return f"cudaError {int(error)}{described}"


class LockedBuffer:
    """Host bytes page-locked where they lie (``cudaHostRegister``) and unlocked before they can be freed.
    The driver locks whole pages, and a page locked twice is refused: the buffer owns its pages alone."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device, self.locked = device, False
        size = max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)
        # an anonymous mapping: pages of its own from its first byte, the storage's (torch's is_pinned asks
        # about a storage's first byte, and copies from it are asynchronous only where it is locked)
        self.bytes = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)

    def lock(self) -> None:
        """Called in a thread of its own (``HostTextEncoder`` does): a refusal leaves the CUDA runtime's last
        error set in the calling thread, and torch's next kernel launch there would raise it as its own."""
        error = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.bytes.nbytes, 0)
        if int(error):
            raise RuntimeError(f"page-locking {self.bytes.nbytes / 2**30:.1f} GiB of host memory for the text encoder "
                               f"failed: {_cuda_error(error)}")
        self.locked = True

    def unlock(self) -> None:
        """A refusal leaves the CUDA runtime's last error in the calling thread, as ``lock``'s does (not expected:
        the buffer unlocks only what it locked)."""
        if self.locked:
            torch.cuda.synchronize(self.device)  # no copy from it still in flight
            self.locked = False
            error = torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            if int(error):
                raise RuntimeError(f"unlocking the text encoder's host memory failed: {_cuda_error(error)}")

    def __del__(self) -> None:  # a buffer freed still locked would leave its pages locked for whatever comes next
        with contextlib.suppress(Exception):
            self.unlock()


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
    time: the weights are swapped in place). Page-locking runs in a thread of its own, beside what
    the caller loads next (``Generator``: the VAE and its decoder's compile); the first ``on()`` waits for it."""

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
        self.locking: Future | None = None
        self.buffer: LockedBuffer | None = None  # the weights' page-locked host memory
        if self.device.type == "cuda":
            # the new thread's current device is GPU 0: set to this one's first, or every rank makes a context there
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            pool = ThreadPoolExecutor(1, thread_name_prefix="lock-text-encoder")
            self.locking = pool.submit(self._lock_weights, index)
            pool.shutdown(wait=False)

    def _lock_weights(self, index: int) -> None:
        """The weights copied into one host buffer, which is then page-locked where it lies: torch's pinned
        blocks are rounded up to powers of two (about 14 GiB held for umT5-XXL's 10.6), a locked buffer
        is its own size."""
        torch.cuda.set_device(index)
        offsets, total = [], 0
        for t in self.weights:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += t.nbytes
        buffer = LockedBuffer(total, torch.device("cuda", index))
        for t, offset in zip(self.weights, offsets):
            view = buffer.bytes[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.data)
            t.data = view
        buffer.lock()
        self.buffer = buffer

    def wait_locked(self) -> None:
        """Waits for the weights to be page-locked (raising what page-locking raised)."""
        if self.locking is not None:
            self.locking.result()
            self.locking = None

    @contextlib.contextmanager
    def on(self) -> Iterator[TextEncoder]:
        """The encoder with its weights on the device until the block ends (a tied weight copied once)."""
        if self.device.type == "cpu":
            yield self.encoder
            return
        self.wait_locked()
        host = [t.data for t in self.weights]
        try:
            for t in self.weights:
                t.data = t.data.to(self.device, non_blocking=True)
            yield self.encoder
        finally:
            for t, data in zip(self.weights, host):
                t.data = data

    def close(self) -> None:
        """Gives the page-locked memory back to the system."""
        if self.locking is not None:  # its error, if any, was raised by on() or has no one to tell now
            wait([self.locking])
        if self.buffer is not None:
            self.buffer.unlock()
        self.weights, self.encoder, self.buffer = [], None, None
