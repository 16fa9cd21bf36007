"""The rollout's settings (the few-step sampler inference and distillation share), for params
validation: nothing here imports torch."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    chunk_frames: int = 8
    steps: tuple[int, ...] = (1000, 946, 854, 681, 0)
    window: int | None = 32  # latent frames of keys a chunk reads besides its own; None: all before it

    def __post_init__(self) -> None:
        s = self.steps
        if len(s) < 2 or s[-1] != 0 or any(a <= b for a, b in zip(s, s[1:])) or s[0] > 1000:
            raise ValueError(f"steps must descend from at most 1000 to 0; got {list(s)}")
