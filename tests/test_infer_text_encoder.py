"""A Generator's text encoder: loaded for each prompt file, or kept in host memory (the same embeddings
as an encoder loaded for the call, its weights on the GPU only while a prompt file is embedded)."""
from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from longlive_core.infer.text_encoder import FileTextEncoder, HostTextEncoder
from longlive_core.models.text import text_encoder_from


def test_both_ways_embed_as_one_loaded_for_the_call_and_close_lets_the_weights_go():
    """On the CPU the kept encoder's ``on()`` hands it as it is, in float32 (``text_dtype``'s), its
    weights unmoved."""
    want = text_encoder_from("tiny", 16, "cpu").encode(["a red ball"])
    for way in (FileTextEncoder, HostTextEncoder):
        text = way("tiny", 16, "cpu")
        for _ in range(2):  # two prompt files
            with text.on() as encoder:
                assert torch.equal(encoder.encode(["a red ball"]), want), way
        text.close()
        if way is HostTextEncoder:
            assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in encoder.model.parameters())
    assert text.encoder is None and text.weights == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool)")
def test_a_host_kept_encoder_copies_its_weights_to_the_gpu_for_the_block_only():
    """The weights stay page-locked on the host between prompt files, on the GPU only inside ``on()``
    (the tied embedding copied once), and the embeddings are those of an encoder loaded onto the GPU."""
    device = torch.device("cuda")
    # first: cuBLAS's workspace (32 MiB on Hopper, from torch's allocator) is made by the thread's first GEMM
    want = text_encoder_from("tiny", 16, device).encode(["a red ball", "a kite"])
    kept = HostTextEncoder("tiny", 16, device)
    kept.wait_locked()
    assert all(t.device.type == "cpu" and t.is_pinned() and t.dtype == torch.bfloat16 for t in kept.weights)
    # views of one page-locked buffer of their own size (torch's pinned blocks round up to powers of two)
    buffer = kept.buffer.bytes.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == buffer for t in kept.weights)
    assert kept.buffer.bytes.nbytes < sum(t.nbytes for t in kept.weights) + 256 * len(kept.weights) + 4096
    before = torch.cuda.memory_allocated(device)
    with kept.on() as encoder:
        out = encoder.encode(["a red ball", "a kite"])
        assert all(t.device == torch.device("cuda", 0) for t in encoder.model.parameters())
        assert torch.cuda.memory_allocated(device) - before >= sum(t.nbytes for t in kept.weights)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in kept.weights)
    del encoder
    assert torch.cuda.memory_allocated(device) == before + out.untyped_storage().nbytes()
    assert torch.equal(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool)")
def test_a_host_kept_encoders_weights_go_back_to_the_host_when_the_block_raises_on_the_gpu():
    kept = HostTextEncoder("tiny", 16, "cuda")
    kept.wait_locked()
    host = [t.data_ptr() for t in kept.weights]
    with pytest.raises(RuntimeError, match="a bad prompt"):
        with kept.on():
            raise RuntimeError("a bad prompt")
    assert [t.data_ptr() for t in kept.weights] == host and all(t.is_pinned() for t in kept.weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool)")
def test_the_first_block_waits_for_page_locking_and_a_failure_to_lock_is_raised_there_on_the_gpu(monkeypatch):
    kept = HostTextEncoder("tiny", 16, "cuda")  # page-locking in its thread as the block starts
    with kept.on() as encoder:
        out = encoder.encode(["a red ball"])
    assert kept.locking is None and all(t.is_pinned() for t in kept.weights)
    HostTextEncoder("tiny", 16, "cuda").wait_locked()  # small buffers beside each other: each locks pages of its own
    other = HostTextEncoder("tiny", 16, "cuda")
    other.wait_locked()
    memory = other.buffer.bytes  # kept mapped: the encoder and its buffer let go without close() unlock it
    # locked twice: the driver's refusal, named. In a thread of its own, as the encoder locks: a refused call leaves
    # the CUDA runtime's last error set in its thread, where torch's next kernel launch would report it as its own
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match=r"page-locking .* failed: cudaError \d+"):
        pool.submit(other.buffer.lock).result()
    del other
    gc.collect()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(memory.data_ptr(), memory.nbytes, 0)) == 0
    assert int(cudart.cudaHostUnregister(memory.data_ptr())) == 0
    assert torch.equal(out, text_encoder_from("tiny", 16, "cuda").encode(["a red ball"]))
    kept.close()
    assert kept.buffer is None and kept.weights == []

    def refused(self, index):
        raise RuntimeError("page-locking 0.0 GiB of host memory for the text encoder failed")

    monkeypatch.setattr(HostTextEncoder, "_lock_weights", refused)
    kept = HostTextEncoder("tiny", 16, "cuda")
    with pytest.raises(RuntimeError, match="page-locking"):
        with kept.on():
            pass
    kept.close()  # the error was raised by on(): close() lets the encoder go without raising it again
    assert kept.encoder is None
