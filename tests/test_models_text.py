"""The text encoder: the tiny byte-level one, padding, and the missing-weights error."""
from __future__ import annotations

import pytest
import torch

from longlive_core.models.text import EOS, ByteTokenizer, load_text_encoder, tiny_text_encoder
from longlive_core.models.weights import CheckpointError


def test_byte_tokenizer_needs_no_vocabulary():
    ids, mask = ByteTokenizer()(["ab", "café scène"], max_length=8)
    assert ids[0, :3].tolist() == [ord("a") + 3, ord("b") + 3, EOS] and mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert mask[1].all() and ids[1, -1] == EOS  # truncated to 7 bytes + EOS


def test_embeddings_are_zero_past_the_caption_and_deterministic():
    enc = tiny_text_encoder(dim=32, max_length=16)
    out = enc.encode(["a red ball", "a much longer caption than that"])
    assert out.shape == (2, 16, 32) and out.dtype == torch.float32
    assert (out[0, 11:] == 0).all() and (out[0, :11].abs().sum(-1) > 0).all()  # 10 bytes + EOS
    again = tiny_text_encoder(dim=32, max_length=16).encode(["a red ball"])
    assert torch.equal(again[0], out[0])


def test_missing_umt5_names_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="no umT5 encoder at .*nowhere"):
        load_text_encoder(tmp_path / "nowhere")
