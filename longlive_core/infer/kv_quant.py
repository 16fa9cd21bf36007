"""The quantized KV caches, dequantized on read:

- NVFP4 (``kv: nvfp4``): cached keys and values held as E2M1 codes with E4M3 scales per 16 elements of
  the head dimension (each token's own blocks) and one FP32 global scale per layer and written chunk:
  3.56x fewer bytes than bf16.
- FP8 (``kv: fp8``): E4M3 codes with one FP32 scale per token and head (its amax / 448, as the FP8
  linears scale a token: ``quant/fp8.py``): 1 + 4 / D bytes an element, 1.94x fewer than bf16 at the
  5B model's head dimension of 128, with E4M3's 3 mantissa bits where E2M1 has 1.

K-smoothing (an option for both): the keys are stored minus a mean per layer and head, fixed from the
first chunk written. Subtracting the same vector m from every key shifts each query's logits q.k by
the same q.m, which softmax ignores: attention's output is unchanged in exact arithmetic, while the
keys' per-channel offset (real keys have one) no longer eats the quantization's range. The chunk being
generated reads its own keys minus the same mean. Four-Over-Six block scales are an option of the
NVFP4 cache.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from longlive_core.quant.fp8 import quantize_rows
from longlive_core.quant.nvfp4 import BLOCK, FourOverSix, decode_e2m1, quantize_nvfp4, unpack_codes

FORMATS = ("nvfp4", "fp8")


@dataclasses.dataclass(frozen=True)
class KVQuantConfig:
    smooth_keys: bool = True
    four_over_six: FourOverSix = None  # the NVFP4 cache's block scales
    format: str = "nvfp4"  # nvfp4 | fp8

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"a quantized KV cache's format is one of {FORMATS}; got {self.format!r}")

    def chunk(self, x: torch.Tensor) -> QuantizedChunk | FP8Chunk:
        """``x`` (B, H, T, D), one written chunk of a layer's keys or values, as this format holds it."""
        return QuantizedChunk.of(x, self.four_over_six) if self.format == "nvfp4" else FP8Chunk.of(x)


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


@dataclasses.dataclass(frozen=True)
class FP8Chunk:
    """One written chunk of one layer's keys or values, (B, H, T, D) as E4M3 codes and a scale per row."""
    codes: torch.Tensor  # (B, H, T, D) float8_e4m3fn
    scales: torch.Tensor  # (B, H, T, 1) float32: x ~ codes x scales

    @classmethod
    def of(cls, x: torch.Tensor) -> FP8Chunk:
        b, h, t, d = x.shape
        codes, scales = quantize_rows(x.reshape(-1, d))
        return cls(codes.view(b, h, t, d), scales.view(b, h, t, 1))

    @property
    def tokens(self) -> int:
        return self.codes.shape[2]

    def slice(self, lo: int, hi: int) -> FP8Chunk:
        """Tokens [lo, hi), copied unless whole (a view would pin the whole chunk's memory)."""
        if hi - lo == self.tokens:
            return self
        return FP8Chunk(self.codes[:, :, lo:hi].clone(), self.scales[:, :, lo:hi].clone())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The product in float32 (an E4M3 code times a float32 scale), rounded once to ``dtype``."""
        return (self.codes.float() * self.scales).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()


@functools.cache
def byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(256, 2): the two E2M1 values of every packed byte, element 2i in the low nibble."""
    codes = torch.arange(256, dtype=torch.uint8)
    return decode_e2m1(unpack_codes(codes[:, None])).view(256, 2).to(device, dtype)


def dequantize_all(chunks: list[QuantizedChunk | FP8Chunk], dtype: torch.dtype) -> torch.Tensor | None:
    return torch.cat([c.dequantize(dtype) for c in chunks], dim=2) if chunks else None

