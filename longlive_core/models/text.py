"""The text encoder: umT5-XXL through transformers from a local directory, or a tiny random one.

Captions become (max_length, dim) embeddings, zero past the caption's own tokens (Wan's
convention: the DiT sees the padded length, the padding carries nothing). The tiny encoder's
tokenizer is byte-level (UTF-8 bytes + 3), so the demo needs no downloaded vocabulary.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longlive_core.models.weights import require_pretrained_dir

PAD, EOS, BYTE_OFFSET = 0, 1, 3
SCENE_TRANSITION = "The scene transitions. "  # in front of every shot's caption after the first (REFERENCE.md §2)


def shot_prompts(captions: list[str]) -> list[str]:
    """The prompts a multi-shot sample's shots are encoded with, in training and in inference alike."""
    return [c if k == 0 else SCENE_TRANSITION + c for k, c in enumerate(captions)]


class ByteTokenizer:
    """UTF-8 bytes as token ids (offset past pad/eos/unk); truncates, appends EOS, pads."""

    vocab_size = 256 + BYTE_OFFSET

    def __call__(self, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(texts), max_length), PAD, dtype=torch.long)
        for i, text in enumerate(texts):
            tokens = [b + BYTE_OFFSET for b in text.encode("utf-8")][: max_length - 1] + [EOS]
            ids[i, : len(tokens)] = torch.tensor(tokens)
        return ids, (ids != PAD).long()


class HFTokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.tok(texts, max_length=max_length, padding="max_length", truncation=True,
                       add_special_tokens=True, return_tensors="pt")
        return out.input_ids, out.attention_mask


@dataclasses.dataclass
class TextEncoder:
    model: torch.nn.Module
    tokenizer: object
    max_length: int

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    @torch.no_grad()
    def encode(self, captions: list[str]) -> torch.Tensor:
        """(len(captions), max_length, dim) float32, zero past each caption's tokens."""
        device = next(self.model.parameters()).device
        ids, mask = self.tokenizer(captions, self.max_length)
        ids, mask = ids.to(device), mask.to(device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return hidden * mask[..., None]


def tiny_text_encoder(dim: int = 32, max_length: int = 64, seed: int = 0) -> TextEncoder:
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        return _tiny(dim, max_length)


def _tiny(dim: int, max_length: int) -> TextEncoder:
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=ByteTokenizer.vocab_size, d_model=dim, d_kv=8, d_ff=2 * dim, num_layers=2,
                     num_heads=max(1, dim // 8), relative_attention_num_buckets=8, dropout_rate=0.0)
    return TextEncoder(UMT5EncoderModel(cfg).eval(), ByteTokenizer(), max_length)


def text_dtype(device: torch.device) -> torch.dtype:
    """umT5 runs in bfloat16 on GPUs (as Wan runs it; umT5-XXL is 22 GB in float32), float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def text_encoder_from(path: str, max_length: int, device: torch.device | str = "cpu") -> TextEncoder:
    """``tiny`` (random, byte tokenizer) or a local umT5 folder, in ``text_dtype``."""
    device = torch.device(device)
    dtype = text_dtype(device)
    text = tiny_text_encoder(dim=32, max_length=max_length) if path == "tiny" else \
        load_text_encoder(path, max_length=max_length, dtype=dtype)
    text.model.to(device=device, dtype=dtype)
    return text


def check_text_encoder_dir(path: str | Path) -> None:
    """Raises CheckpointError, saying what to put there, unless ``path`` holds an encoder to load."""
    require_pretrained_dir(Path(path), "umT5 encoder", "put google/umt5-xxl's encoder there in the transformers "
                           "layout (config.json, *.safetensors and the tokenizer files; the text_encoder/ and "
                           "tokenizer/ folders of Wan-AI/Wan2.2-TI2V-5B-Diffusers merged)")


def load_text_encoder(path: str | Path, max_length: int = 512, dtype: torch.dtype = torch.float32) -> TextEncoder:
    from transformers import AutoTokenizer, UMT5EncoderModel

    path = Path(path)
    check_text_encoder_dir(path)
    model = UMT5EncoderModel.from_pretrained(path, local_files_only=True, use_safetensors=True, torch_dtype=dtype)
    return TextEncoder(model.eval(), HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True)),
                       max_length)
