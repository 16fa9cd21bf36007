"""The caption model: a Qwen2.5-VL folder loaded through transformers from local files only, and
batched generation (transformers' generate: vLLM does not fit on the machines lent here).

Greedy decoding, so a caption is a function of its inputs and can be cached. Precision: bf16 on a GPU
that supports it, fp32 on the CPU (``caption.precision: auto``).
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch

from longlive_core.caption.config import TINY, CaptionConfig
from longlive_core.caption.text import prompt_words
from longlive_core.models.weights import require_pretrained_dir


@dataclasses.dataclass(frozen=True)
class Generated:
    text: str
    tokens: int  # generated, the end token left out
    reached_bound: bool  # stopped by max_new_tokens, not by the model's end token


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return torch.float32
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


_TINY_DIR: tempfile.TemporaryDirectory | None = None


def model_folder(model: str) -> Path:
    """The folder to load: ``tiny`` is made once per process (seeded, so the same bytes every time)."""
    global _TINY_DIR
    if model != TINY:
        return Path(model)
    if _TINY_DIR is None:
        from longlive_core.caption.tiny import make_tiny_vlm

        _TINY_DIR = tempfile.TemporaryDirectory(prefix="longlive-tiny-vlm-")
        make_tiny_vlm(_TINY_DIR.name, seed=0, prompt_text=prompt_words())
    return Path(_TINY_DIR.name)


class CaptionModel:
    """``generate`` turns (frames or None, request text) pairs into captions, one generate call a batch."""

    def __init__(self, cfg: CaptionConfig, device: torch.device):
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per load and save in the stage's log says nothing

        folder = model_folder(cfg.model)
        require_pretrained_dir(folder, "caption model (Qwen2.5-VL)",
                               "download Qwen/Qwen2.5-VL-7B-Instruct on a machine with internet and copy it here")
        dtype = resolve_dtype(cfg.precision, device)
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, local_files_only=True, dtype=dtype)
        self._attach(cfg, device, processor, model.to(device))

    @classmethod
    def from_parts(cls, cfg: CaptionConfig, device: torch.device, processor, model) -> CaptionModel:
        """A model made in memory (bench/caption_throughput.py's random 7B: no folder of 16 GB to write and
        read) behind the very ``generate`` the stage runs; ``model`` is already on ``device``."""
        self = cls.__new__(cls)
        self._attach(cfg, device, processor, model)
        return self

    def _attach(self, cfg: CaptionConfig, device: torch.device, processor, model) -> None:
        self.cfg, self.device = cfg, device
        self.dtype = resolve_dtype(cfg.precision, device)
        self.processor = processor
        self.processor.tokenizer.padding_side = "left"  # decoder-only generation pads on the left
        self.model = model.eval()
        self.end_ids = set(np.atleast_1d(self.model.generation_config.eos_token_id or []).tolist())

    def count_tokens(self, text: str) -> int:
        return len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.inference_mode()
    def generate(self, items: list[tuple[np.ndarray | None, str]]) -> list[Generated]:
        """Items of one batch are all with frames or all without."""
        if not items:
            return []
        with_video = items[0][0] is not None
        messages = [[{"role": "user", "content": ([{"type": "video"}] if with_video else [])
                      + [{"type": "text", "text": text}]}] for _, text in items]
        texts = [self.processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        kwargs = {}
        if with_video:
            kwargs = {"videos": [frames for frames, _ in items], "fps": self.cfg.fps, "do_sample_frames": False,
                      "size": {"shortest_edge": 28 * 28, "longest_edge": self.cfg.max_pixels},
                      "cap_pixels_per_frame": True}
        inputs = self.processor(text=texts, padding=True, return_tensors="pt", **kwargs).to(self.device)
        if "pixel_values_videos" in inputs:
            inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(self.dtype)
        out = self.model.generate(**inputs, max_new_tokens=self.cfg.max_new_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:].cpu()
        pad = self.processor.tokenizer.pad_token_id
        results = []
        for row in new.tolist():
            stop = next((i for i, t in enumerate(row) if t in self.end_ids), None)
            kept = row[:stop] if stop is not None else [t for t in row if t != pad]
            text = self.processor.tokenizer.decode(kept, skip_special_tokens=True).strip()
            results.append(Generated(text, len(kept), stop is None and len(row) >= self.cfg.max_new_tokens))
        return results
