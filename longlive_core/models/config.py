"""Model configurations by name: the real Wan2.2-TI2V-5B dimensions and a tiny one for this CPU."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    dim: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    in_channels: int = 48
    out_channels: int = 48
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """How a head's dimensions split between time, height and width rotations (Wan's rule)."""
        hw = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * hw, hw, hw

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of num_heads {self.num_heads}")
        if any(d % 2 for d in self.rope_dims):
            raise ValueError(f"head_dim {self.head_dim} splits into odd RoPE parts {self.rope_dims}")


DIT_CONFIGS: dict[str, DiTConfig] = {
    # Wan2.2-TI2V-5B (REFERENCE.md §2): 24 heads x 128, 30 layers, 48 latent channels, umT5-XXL text
    "wan2.2-ti2v-5b": DiTConfig(dim=3072, ffn_dim=14336, num_layers=30, num_heads=24),
    # the same architecture small enough to train on two CPU cores; text from the tiny encoder
    "tiny": DiTConfig(dim=64, ffn_dim=128, num_layers=2, num_heads=2, text_dim=32, freq_dim=32),
    # six heads: splits over 2, 3 or 6 sequence-parallel ranks (the SP equality tests)
    "tiny-6h": DiTConfig(dim=96, ffn_dim=192, num_layers=2, num_heads=6, text_dim=32, freq_dim=32),
}


def dit_config(name: str) -> DiTConfig:
    if name not in DIT_CONFIGS:
        raise ValueError(f"unknown DiT config {name!r}; known: {', '.join(DIT_CONFIGS)}")
    return DIT_CONFIGS[name]
