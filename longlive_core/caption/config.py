"""params ``caption``: the dense-caption stage's settings (nothing heavy imported here)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from longlive_core.config import ConfigError
from longlive_core.parallel import EXECUTORS

SOURCES = ("sidecar_first", "model", "sidecar")
TINY = "tiny"  # the demo's random model, made by caption/tiny.py and loaded as a folder like any other


@dataclasses.dataclass(frozen=True)
class CaptionConfig:
    source: str = "sidecar_first"  # sidecar_first (a sidecar caption, else the model) | model | sidecar
    model: str = TINY  # a local Qwen2.5-VL folder (from_pretrained, local files only) | tiny
    fps: float = 2.0  # frames sampled per second of the shot
    max_frames: int = 32  # at most this many, spread over the shot
    max_pixels: int = 230400  # each frame resized to at most this many pixels (Qwen2.5-VL's processor)
    max_new_tokens: int = 256  # the caption's bound; output that reaches it is cut at its last sentence end
    context_shots: int = 8  # the video's latest earlier captions in each shot's request (0: none)
    batch_size: int = 8  # videos captioned together, a shot of each per generate call
    precision: str = "auto"  # auto: bf16 on a GPU that supports it, fp32 elsewhere | bf16 | fp32
    device: str = "auto"  # auto | cpu | cuda
    executor: str = "local"  # local (processes here) | dask (params `dask`); a task of batch_size videos
    workers: int = 1  # processes (local) or local-cluster workers (dask); one GPU each where there are some

    def validate(self, where: str) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"{where}.source must be one of {list(SOURCES)}, got {self.source!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError(f"{where}.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"{where}.device must be auto, cpu or cuda, got {self.device!r}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor must be one of {list(EXECUTORS)}, got {self.executor!r}")
        if not self.fps > 0:
            raise ConfigError(f"{where}.fps must be > 0, got {self.fps}")
        if self.max_frames < 2:
            raise ConfigError(f"{where}.max_frames must be >= 2 (Qwen2.5-VL reads frames in pairs), got "
                              f"{self.max_frames}")
        if self.max_pixels < 28 * 28:
            raise ConfigError(f"{where}.max_pixels must be >= 784 (one 28x28 patch group), got {self.max_pixels}")
        for key in ("max_new_tokens", "batch_size", "workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}.{key} must be >= 1")
        if self.context_shots < 0:
            raise ConfigError(f"{where}.context_shots must be >= 0 (0: no earlier captions in a request)")
        folder = Path(self.model)
        if self.source != "sidecar" and self.model != TINY and not (
                (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
            raise ConfigError(
                f"{where}.model {self.model!r} is not a model folder (config.json and safetensors weights). The "
                "caption model is "
                "read from local files only: download Qwen/Qwen2.5-VL-7B-Instruct on a machine with internet "
                "(huggingface-cli download Qwen/Qwen2.5-VL-7B-Instruct --local-dir models/qwen2.5-vl-7b-instruct), "
                "copy it here and set this path; or use model: tiny (random, the demo's), or source: sidecar")

    def sampling_params(self, device_type: str) -> dict:
        """What a caption depends on besides the clip, the model, the template and the code; ``device_type``
        is where it runs (cpu or cuda: ``precision: auto`` follows it)."""
        return {**{k: getattr(self, k) for k in ("fps", "max_frames", "max_pixels", "max_new_tokens", "context_shots",
                                                 "precision")},
                "device": device_type}
