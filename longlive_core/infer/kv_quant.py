"""The NVFP4 KV cache: cached keys and values held as E2M1 codes with E4M3 scales per 16 elements of
the head dimension (each token's own blocks) and one FP32 global scale per layer and written chunk,
dequantized on read.

K-smoothing (an option): the keys are stored minus a mean per layer and head, fixed from the first
chunk written. Subtracting the same vector m from every key shifts each query's logits q.k by the
same q.m, which softmax ignores: attention's output is unchanged in exact arithmetic, while the keys'
per-channel offset (real keys have one) no longer eats the quantization's range. The chunk being
generated reads its own keys minus the same mean. Four-Over-Six block scales are an option too.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from longlive_core.quant.nvfp4 import BLOCK, FourOverSix, decode_e2m1, quantize_nvfp4, unpack_codes


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
    smooth_keys: bool = True
    four_over_six: FourOverSix = None


@dataclasses.dataclass(frozen=True)
class QuantizedChunk:
    """One written chunk of one layer's keys or values, (B, H, T, D) as codes and scales."""
    codes: torch.Tensor  # (B, H, T, D/2) uint8, element 2i in the low nibble
    scales: torch.Tensor  # (B, H, T, D/16) float8_e4m3fn
    encode_scale: torch.Tensor  # float32 scalar S_enc of the chunk: x ~ codes x scales / S_enc

    @classmethod
    def of(cls, x: torch.Tensor, four_over_six: FourOverSix = None) -> QuantizedChunk:
        b, h, t, d = x.shape
        if d % BLOCK:
            raise ValueError(f"the head dimension {d} is not a multiple of {BLOCK}")
        q = quantize_nvfp4(x.reshape(-1, d), four_over_six=four_over_six)
        return cls(q.codes.view(b, h, t, d // 2), q.scales.view(b, h, t, d // BLOCK), q.encode_scale.reshape(()))

    @property
    def tokens(self) -> int:
        return self.codes.shape[2]

    def slice(self, lo: int, hi: int) -> QuantizedChunk:
        """Tokens [lo, hi), copied unless whole (a view would pin the whole chunk's memory)."""
        if hi - lo == self.tokens:
            return self
        return QuantizedChunk(self.codes[:, :, lo:hi].clone(), self.scales[:, :, lo:hi].clone(), self.encode_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """In ``dtype`` throughout: a code times its E4M3 scale is exact in bfloat16 (at most 5
        significant bits), and only the division by the global scale rounds."""
        b, h, t, half = self.codes.shape
        values = byte_table(dtype, self.codes.device)[self.codes.int()]  # (b, h, t, D/2, 2): one gather
        out = values.view(b, h, t, 2 * half // BLOCK, BLOCK) * self.scales.to(dtype)[..., None]
        return (out / self.encode_scale.to(dtype)).view(b, h, t, 2 * half)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() + 4


@functools.cache
def byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): the two E2M1 values of every packed byte, element 2i in the low nibble."""
    codes = torch.arange(256, dtype=torch.uint8)
    return decode_e2m1(unpack_codes(codes[:, None])).view(256, 2).to(device, dtype)


def dequantize_all(chunks: list[QuantizedChunk], dtype: torch.dtype) -> torch.Tensor | None:
    return torch.cat([c.dequantize(dtype) for c in chunks], dim=2) if chunks else None

