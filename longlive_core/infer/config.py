"""The rollout's settings (the few-step sampler inference and distillation share), for params
validation: nothing here imports torch."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    chunk_frames: int = 8
    steps: tuple[int, ...] = (1000, 946, 854, 681, 0)
    window: int | None = 32  # latent frames a chunk attends to, itself and the sinks included; None: all before it
    global_sink: int = 0  # the video's first latent frames, kept in the cache all along
    shot_sink: int = 0  # the current shot's first latent frames, kept while the shot lasts

    def __post_init__(self) -> None:
        s = self.steps
        if len(s) < 2 or s[-1] != 0 or any(a <= b for a, b in zip(s, s[1:])) or s[0] > 1000:
            raise ValueError(f"steps must descend from at most 1000 to 0; got {list(s)}")
        SinkConfig(self.global_sink, self.shot_sink).check(self.window, self.chunk_frames)


@dataclasses.dataclass(frozen=True)
class SinkConfig:
    global_frames: int = 0  # S_g: the video's first latent frames, kept for the whole video
    shot_frames: int = 0  # S_s: the current shot's first latent frames, kept while the shot lasts

    def __post_init__(self) -> None:
        if self.global_frames < 0 or self.shot_frames < 0:
            raise ValueError(f"sink lengths must be at least 0; got {self}")

    def check(self, window: int | None, chunk_frames: int) -> None:
        """The window must hold both sinks and the chunk itself, or the sinks would crowd it out."""
        need = self.global_frames + self.shot_frames + chunk_frames
        if window is not None and window < need:
            raise ValueError(f"a KV window of {window} latent frames cannot hold the global sink "
                             f"({self.global_frames}), the shot sink ({self.shot_frames}) and a {chunk_frames}-frame "
                             f"chunk: make the window at least {need}")
