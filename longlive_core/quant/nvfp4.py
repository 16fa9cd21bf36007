"""NVFP4 quantization, bit-exact with the published formulas (Transformer Engine's numerics).

Public API (stable: the training, distillation and merge code and the checks rely on it)::

    quantize_nvfp4(x, tile=(1, 16), rht=False, stochastic=False, four_over_six=None,
                   generator=None, backend=None) -> NVFP4Tensor
    NVFP4Tensor.codes   uint8 (M, K//2): element 2i in the low nibble, 2i+1 in the high nibble
    NVFP4Tensor.scales  float8_e4m3fn (M, K//16); a 16x16 tile's scale repeated on its 16 rows
    NVFP4Tensor.amax    float32 scalar: the global amax the encode scale came from (after the RHT)
    NVFP4Tensor.dequantize(dtype=torch.float32) -> (M, K)

``x`` is 2-D (M, K), float32 or bfloat16, K a multiple of 16 (M too for 16x16 tiles); blocks run
along K. The numbers, for a tensor with global amax ``A`` and a block with amax ``a``::

    S_enc = 448 * 6 / A           (1 when A or S_enc is 0; at most FLT_MAX)
    S_dec = e4m3(min(a * (S_enc * (1/6)), 448))
    enc   = min(1 / (f32(S_dec) * (1/S_enc)), FLT_MAX)
    q     = e2m1(clamp(x * enc, -6, 6))          round to nearest even, or stochastic
    x    ~= q * f32(S_dec) / S_enc

all in float32, in exactly that operation order. ``four_over_six`` ("mse" or "mae") encodes with
256 in place of 448 and, per block, also tries a scale 1.5x larger (so the block's amax lands on
4 rather than 6), keeping it only when its error is strictly smaller. ``rht=True`` applies
:func:`longlive_core.quant.hadamard.rht` first; ``dequantize`` then returns the transformed values
(``dequantize(inverse_rht=True)`` undoes it).

``backend``: ``"torch"`` (any device; the reference) or ``"triton"`` (CUDA; bit-identical for
round-to-nearest, the default on CUDA when Triton imports). Stochastic rounding draws from
``generator`` on the torch path; the Triton kernel takes a seed drawn from the same generator, so
both are reproducible, but their draws differ. Without a generator the Triton path draws its seed
from the device's default generator (so it advances that generator, as dropout would).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from longlive_core.quant.constants import device_constant
from longlive_core.quant.hadamard import inverse_rht as undo_rht  # dequantize's flag has the function's name
from longlive_core.quant.hadamard import rht as apply_rht

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FOUR_OVER_SIX_E4M3_MAX = 256.0
FLT_MAX = torch.finfo(torch.float32).max
# Magnitudes of the E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FourOverSix = Literal["mse", "mae"] | None
Backend = Literal["torch", "triton"] | None


@dataclasses.dataclass
class NVFP4Tensor:
    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    shape: tuple[int, int]
    tile: tuple[int, int] = (1, BLOCK)
    rht: bool = False
    # the E4M3 maximum S_enc was built from: 448, or 256 under Four-Over-Six
    scale_max: float = E4M3_MAX

    @property
    def encode_scale(self) -> torch.Tensor:
        return global_encode_scale(self.amax, self.scale_max)

    def values(self) -> torch.Tensor:
        """The E2M1 values (signed), float32, (M, K)."""
        return decode_e2m1(unpack_codes(self.codes))

    def dequantize(self, dtype: torch.dtype = torch.float32, inverse_rht: bool = False) -> torch.Tensor:
        m, k = self.shape
        scaled = self.values().view(m, k // BLOCK, BLOCK) * self.scales.float()[..., None]
        out = (scaled / self.encode_scale).view(m, k)
        if inverse_rht and self.rht:
            out = undo_rht(out)  # float32 already
        return out.to(dtype)


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    # a fill on the device: torch.tensor(value, device=...) would copy from the host and wait for the GPU
    return torch.full((), value, dtype=torch.float32, device=like.device)


def float32_scalar(d: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """``d`` (a number or a one-element tensor) as a 0-d float32 tensor on ``device``; returned as
    it is where it already is one, since even a no-op conversion costs the host a dispatch and the
    Triton path calls this per quantize and per GEMM."""
    if isinstance(d, torch.Tensor) and d.dtype == torch.float32 and d.dim() == 0 and d.device == device:
        return d
    return torch.as_tensor(d, dtype=torch.float32, device=device).reshape(())


def global_encode_scale(amax: torch.Tensor, scale_max: float = E4M3_MAX) -> torch.Tensor:
    """S_enc = scale_max * 6 / amax, 1 when amax or the quotient is 0, capped at FLT_MAX."""
    amax = amax.float()
    s = _f32(scale_max * E2M1_MAX, amax) / amax
    s = torch.where((amax == 0) | (s == 0), _f32(1.0, amax), s)
    return torch.clamp(s, max=FLT_MAX)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to float8_e4m3fn, nearest even, after clamping to 448 (larger values would
    otherwise become NaN on some builds)."""
    return torch.clamp(x, max=E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, sign in bit 3) of float32 values already clamped to [-6, 6], nearest even.
    A tie goes to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4."""
    a = v.abs()
    mag = torch.zeros_like(v, dtype=torch.uint8)
    # (threshold, inclusive) above which the magnitude code is at least i: ties round to even codes
    for i, (t, inclusive) in enumerate(((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                                        (2.5, False), (3.5, True), (5.0, False)), start=1):
        mag = torch.where(a >= t if inclusive else a > t, i, mag).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def e2m1_stochastic(v: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Codes of values in [-6, 6], rounded up in magnitude with probability equal to the fractional
    distance between the two neighbouring E2M1 magnitudes (``uniform`` in [0, 1))."""
    a = v.abs()
    table = device_constant(E2M1_VALUES, v.device)
    lo = (torch.bucketize(a, table, right=True) - 1).clamp(0, 6)
    lo_val, hi_val = table[lo], table[lo + 1]
    p = (a - lo_val) / (hi_val - lo_val)
    mag = (lo + (uniform < p).to(lo.dtype)).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    table = device_constant(E2M1_VALUES, codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pairwise_block_sum(e: torch.Tensor) -> torch.Tensor:
    """Sums the last axis (16) by adjacent pairs, in a fixed order the Triton kernel repeats."""
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    return e[..., 0]


def check_input(x: torch.Tensor, tile: tuple[int, int]) -> None:
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D (M, K) tensor; got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize_nvfp4 takes float32 or bfloat16; got {x.dtype}")
    if tile not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(f"tile must be (1, 16) or (16, 16); got {tile}")
    m, k = x.shape
    if k % BLOCK or (tile[0] == BLOCK and m % BLOCK):
        raise ValueError(f"shape {tuple(x.shape)}: K must be a multiple of 16 (and M too for 16x16 tiles)")


def _block_amax(xb: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Per-block amax of xb (M, K//16, 16); for 16x16 tiles one amax per tile, repeated on its rows."""
    amax = xb.abs().amax(-1)
    if tile[0] == BLOCK:
        m, g = amax.shape
        amax = amax.view(m // BLOCK, BLOCK, g).amax(1, keepdim=True).expand(m // BLOCK, BLOCK, g).reshape(m, g)
    return amax


def _encode(xb: torch.Tensor, block_amax: torch.Tensor, s_enc: torch.Tensor, multiplier: float | None):
    """Block decode scales and the clamped scaled values for one choice of block scale."""
    scaled = block_amax * (s_enc * _f32(1 / E2M1_MAX, s_enc)) if multiplier is None else \
        block_amax / _f32(E2M1_MAX, s_enc) * s_enc * _f32(multiplier, s_enc)
    s_dec = e4m3(scaled)
    one = _f32(1.0, s_enc)
    enc = torch.clamp(one / (s_dec.float() * (one / s_enc)), max=FLT_MAX)
    v = torch.clamp(xb * enc[..., None], -E2M1_MAX, E2M1_MAX)
    return s_dec, v


def _block_error(codes: torch.Tensor, s_dec: torch.Tensor, s_enc: torch.Tensor, xb: torch.Tensor,
                 kind: str) -> torch.Tensor:
    deq = decode_e2m1(codes) * s_dec.float()[..., None] / s_enc
    d = deq - xb
    return pairwise_block_sum(d * d if kind == "mse" else d.abs())


def quantize_torch(x: torch.Tensor, tile: tuple[int, int] = (1, BLOCK), rht: bool = False,
                   stochastic: bool = False, four_over_six: FourOverSix = None,
                   generator: torch.Generator | None = None, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """The reference implementation (eager PyTorch, any device). ``amax``: the global amax of x (after
    the RHT when rht) where the caller already has it, e.g. from ``gemm.operand_amaxes``."""
    check_input(x, tile)
    if four_over_six not in (None, "mse", "mae"):
        raise ValueError(f"four_over_six must be None, 'mse' or 'mae'; got {four_over_six!r}")
    m, k = x.shape
    xf = (apply_rht(x) if rht else x).float()
    if amax is None:
        amax = xf.abs().amax() if xf.numel() else _f32(0.0, xf)
    amax = amax.float().reshape(())
    scale_max = FOUR_OVER_SIX_E4M3_MAX if four_over_six else E4M3_MAX
    s_enc = global_encode_scale(amax, scale_max)
    xb = xf.view(m, k // BLOCK, BLOCK)
    block_amax = _block_amax(xb, tile)

    def round_(v: torch.Tensor) -> torch.Tensor:
        if not stochastic:
            return e2m1_rne(v)
        return e2m1_stochastic(v, torch.rand(v.shape, generator=generator, device=v.device))

    if four_over_six is None:
        s_dec, v = _encode(xb, block_amax, s_enc, None)
        codes = round_(v)
    else:
        s6, v6 = _encode(xb, block_amax, s_enc, 1.0)
        s4, v4 = _encode(xb, block_amax, s_enc, 1.5)
        c6, c4 = round_(v6), round_(v4)
        e6 = _block_error(c6, s6, s_enc, xb, four_over_six)
        e4 = _block_error(c4, s4, s_enc, xb, four_over_six)
        if tile[0] == BLOCK:  # one choice per 16x16 tile: the tile's row errors summed the same way
            g = e6.shape[1]
            e6, e4 = (pairwise_block_sum(e.view(m // BLOCK, BLOCK, g).transpose(1, 2)) for e in (e6, e4))
            pick4 = (e4 < e6)[:, None, :].expand(m // BLOCK, BLOCK, g).reshape(m, g)
        else:
            pick4 = e4 < e6
        s_dec = torch.where(pick4, s4.float(), s6.float()).to(torch.float8_e4m3fn)
        codes = torch.where(pick4[..., None], c4, c6)
    return NVFP4Tensor(codes=pack_codes(codes.view(m, k)), scales=s_dec, amax=amax.float(), shape=(m, k),
                       tile=tuple(tile), rht=rht, scale_max=scale_max)


def default_backend(x: torch.Tensor) -> str:
    if x.is_cuda:
        from longlive_core.quant import triton_kernels
        if triton_kernels.available():
            return "triton"
    return "torch"


def quantize_nvfp4(x: torch.Tensor, tile: tuple[int, int] = (1, BLOCK), rht: bool = False,
                   stochastic: bool = False, four_over_six: FourOverSix = None,
                   generator: torch.Generator | None = None, backend: Backend = None) -> NVFP4Tensor:
    """Quantizes a 2-D tensor to NVFP4 (see the module docstring for the exact numerics)."""
    backend = backend or default_backend(x)
    if backend == "torch":
        return quantize_torch(x, tuple(tile), rht, stochastic, four_over_six, generator)
    if backend == "triton":
        from longlive_core.quant import triton_kernels
        return triton_kernels.quantize(x, tuple(tile), rht, stochastic, four_over_six, generator)
    raise ValueError(f"backend must be 'torch' or 'triton'; got {backend!r}")
