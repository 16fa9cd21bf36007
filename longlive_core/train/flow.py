"""Rectified-flow matching with Wan's shifted schedule.

The noise level of train timestep index i (0 <= i < N) is s = 1 - i / N shifted:
sigma = shift * s / (1 + (shift - 1) * s); the model sees timestep 1000 * sigma (Wan's scale),
x_sigma = (1 - sigma) x0 + sigma * noise, and learns the velocity noise - x0.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FlowMatching:
    num_train_timesteps: int = 1000
    shift: float = 5.0

    def sigmas(self, index: torch.Tensor) -> torch.Tensor:
        s = 1.0 - index.double() / self.num_train_timesteps
        return (self.shift * s / (1 + (self.shift - 1) * s)).float()

    def sample_index(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.num_train_timesteps, shape, generator=generator)

    @staticmethod
    def timestep(sigma: torch.Tensor) -> torch.Tensor:
        return sigma * 1000.0

    @staticmethod
    def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """sigma broadcasts over x0 (e.g. (B, 1, F, 1, 1) per frame)."""
        return (1 - sigma) * x0 + sigma * noise

    @staticmethod
    def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return noise - x0
