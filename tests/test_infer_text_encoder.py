"""A Generator's text encoder: loaded for each prompt file, or kept in host memory (the same embeddings
as an encoder loaded for the call, its weights on the GPU only while a prompt file is embedded)."""
from __future__ import annotations

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
    kept = HostTextEncoder("tiny", 16, device)
    assert all(t.device.type == "cpu" and t.is_pinned() and t.dtype == torch.bfloat16 for t in kept.weights)
    before = torch.cuda.memory_allocated(device)
    with kept.on() as encoder:
        out = encoder.encode(["a red ball", "a kite"])
        assert all(t.device == torch.device("cuda", 0) for t in encoder.model.parameters())
        assert torch.cuda.memory_allocated(device) - before >= sum(t.nbytes for t in kept.weights)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in kept.weights)
    del encoder
    assert torch.cuda.memory_allocated(device) == before + out.untyped_storage().nbytes()
    assert torch.equal(out, text_encoder_from("tiny", 16, device).encode(["a red ball", "a kite"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool)")
def test_a_host_kept_encoders_weights_go_back_to_the_host_when_the_block_raises_on_the_gpu():
    kept = HostTextEncoder("tiny", 16, "cuda")
    host = [t.data_ptr() for t in kept.weights]
    with pytest.raises(RuntimeError, match="a bad prompt"):
        with kept.on():
            raise RuntimeError("a bad prompt")
    assert [t.data_ptr() for t in kept.weights] == host and all(t.is_pinned() for t in kept.weights)
