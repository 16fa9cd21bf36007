"""NVFP4 decoded on the GPU: the Triton helpers that turn E4M3 scale bytes and E2M1 codes into float32
(shared by the KV cache's kernels, infer/kv_attention.py), and a kernel that decodes a packed weight
into the bfloat16 operand the emulated GEMM multiplies.

The packed W4A4 linear (quant/packed.py: the W4A4 folder's every linear, distill_dmd's frozen
backbone) decodes its weight at every forward and backward. The torch path does it in nine kernels
over float32 intermediates (unpack, mask, table lookup, sign, scale, cast): about 30 bytes moved an
element, and on an H100 a fifth of the W4A4 folder's generation time (bench/RESULTS.md, the W4A4
profile). ``partial_operand`` reads the 0.5-byte code and its share of the scale byte and writes the
2-byte value once. A code's value times its block's E4M3 scale has at most 6 significant bits, so it
is exact in float32 and in bfloat16 whatever the order of operations: the kernel's output is the torch
path's bit for bit (block scales are never negative; under a negative one a zero code's sign would
differ, which no product sees).
"""
from __future__ import annotations

import torch

from longlive_core.devices import made_current
from longlive_core.quant.triton_launch import CachedLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None

# rows x columns a program decodes: 8K values, 64 a thread; not swept (a pass bound by its 2.5 bytes an element)
TILE = {"BM": 32, "BK": 256, "num_warps": 4}

if triton is not None:
    @triton.jit
    def _e4m3(b):
        """An E4M3 byte (int32, 0..255) as float32, exactly: the power of two is built from its bits,
        not by exp2. The NaN bytes (0x7F, 0xFF) decode as 480: scales written by the quantizers hold
        none (a NaN input makes the global scale NaN, and every value with it)."""
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        power = ((e + 120) << 23).to(tl.float32, bitcast=True)  # 2^(e - 7) for e >= 1
        mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * power)
        return tl.where((b & 128) != 0, -mag, mag)

    @triton.jit
    def _e2m1_times(n, q0, q1):
        """An E2M1 code ``n`` (int32, 0..15: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times its
        block's factor F (S / S_enc in the window kernel, S x G in the fused read, S in the packed
        weight's decode), given q0 = F and q1 = 1.5 F (float32, each rounded once from the exact value).
        A nonzero code's magnitude is 1 or 1.5 times a power of two 2^k (0.5 = 2^-1, 3 = 1.5 x 2^1;
        2^k's exponent field is 126 + (n & 6) / 2), and scaling by a power of two commutes with
        rounding, so 2^k q is code x F rounded once (below float32's normal range, 1.2e-38, the
        product's own rounding could differ in the last bit). The sign is the code's bit 3, set on the
        result's bits: a few integer operations and one multiply an element, where a division an
        element took ten instructions and a slow path, and decoding the code to a float a dozen more."""
        magnitude = n & 7
        q = tl.where(((n & 1) != 0) & (magnitude > 1), q1, q0)
        power = (((n & 6) << 22) + 0x3F000000).to(tl.float32, bitcast=True)
        x = tl.where(magnitude == 0, 0.0, q * power)
        return (x.to(tl.int32, bitcast=True) ^ ((n & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _partial_kernel(P, S, Out, M, K, BM: tl.constexpr, BK: tl.constexpr):
        """Rows [BM pid0, +BM) and columns [BK pid1, +BK) of Out (M, K, bfloat16): codes P (M, K/2
        bytes, element 2i in the low nibble) times scale bytes S (M, K/16, E4M3), K a multiple of 16."""
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        in_rows = rows[:, None] < M
        blocks = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
        keep = in_rows & (blocks[None, :] < K // 16)
        s = _e4m3(tl.load(S + rows[:, None] * (K // 16) + blocks[None, :], mask=keep, other=0).to(tl.int32))
        q0, q1 = s[:, :, None], (1.5 * s)[:, :, None]  # 1.5 S is exact: S has at most 4 significant bits
        halves = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        c = tl.load(P + rows[:, None] * (K // 2) + halves[None, :], mask=in_rows & (halves[None, :] < K // 2),
                    other=0).to(tl.int32)
        c = tl.reshape(c, (BM, BK // 16, 8))
        x = tl.reshape(tl.join(_e2m1_times(c & 15, q0, q1), _e2m1_times(c >> 4, q0, q1)), (BM, BK))
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        tl.store(Out + rows[:, None] * K + cols[None, :], x.to(tl.bfloat16), mask=in_rows & (cols[None, :] < K))

    _partial_launcher = CachedLaunch(_partial_kernel)


def partial_operand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, K) bfloat16: the E2M1 codes ``packed`` (M, K/2 uint8) times their E4M3 block scales ``scale``
    (M, K/16), exact, from one kernel; the global decode scale is not applied (the GEMM's alpha)."""
    if triton is None:
        raise RuntimeError("the packed weight's decode kernel needs Triton")
    m, half = packed.shape
    k = 2 * half
    # the scales' bytes are read as E4M3 (PackedNVFP4Linear's contract): a scale cast to another dtype (a packed
    # model's .to(bfloat16)) would be read as other bytes
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or scale.shape != (m, k // 16) or k % 16:
        raise ValueError(f"packed codes (M, K/2) uint8 and E4M3 scales (M, K/16), K a multiple of 16; got "
                         f"{tuple(packed.shape)} {packed.dtype} and {tuple(scale.shape)} {scale.dtype}")
    out = torch.empty((m, k), dtype=torch.bfloat16, device=packed.device)
    if m and k:
        with made_current(packed):
            grid = (-(-m // TILE["BM"]), -(-k // TILE["BK"]))
            _partial_launcher[grid](packed.contiguous(), scale.contiguous().view(torch.uint8), out, m, k,
                                    BM=TILE["BM"], BK=TILE["BK"], num_warps=TILE["num_warps"])
    return out
