"""8-bit attention for Hopper's 8-bit tensor cores (INT8 and FP8 both at twice bf16's rate): a Triton
kernel, flash-attention style (online softmax), after SageAttention's recipe.

- Q K^T in INT8: each query and each key scaled by its own amax / 127 and rounded, the keys after
  K-smoothing (their mean over the window subtracted per head and channel: softmax ignores a shift
  every key shares, and real keys carry a per-channel offset that would eat the range). Measured
  against float64 on N(0, 1) heads: INT8 leaves a quarter of E4M3's error in the output (3.7% for
  E4M3 Q K^T against 0.9%), so the logits are not taken in FP8.
- P V in E4M3 (``pv="fp8"``): P = exp(S - running max) in (0, 1], scaled by 256 into E4M3's range so
  the small probabilities of a long window keep their bits, and V per head and channel (its scale
  factors out of the sum over keys), stored transposed (FP8 operands are K-major); or in bfloat16
  (``pv="bf16"``: SageAttention v1, the PyPI one).
- Row sums and the accumulator in float32, the output in bfloat16.

Under Triton's CPU interpreter (the tests) the integer and E4M3 products are taken in float32, where
they are exact; its casts truncate, so rounding to E4M3 and bfloat16 is by hand (quant/triton_kernels'
helpers). Inference only: no backward.

Not used by generation: on the H200 it measured 7.7 ms (P V in bf16) and 8.2 ms (E4M3) for one chunk
over the paper's window against 3.5 ms for bf16 SDPA (bench/attention_kernels.py): as written it
reaches 300 of the 8-bit units' ~1,980 dense TFLOP/s.
"""
from __future__ import annotations

import math

import torch

from longlive_core.quant.fp8 import quantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None

BLOCK_M, BLOCK_N = 128, 64
P_SCALE = 256.0  # P x 256 <= 256 < 448: E4M3's normal range reaches probabilities down to 2^-14
ROWS = 32  # rows a quantize program takes


def int8_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, D) -> (INT8 codes (R, D), float32 scales (R,)): x ~ codes * scale, rounded half away from zero."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = xf / scale[:, None]
    return (torch.sign(q) * torch.floor(q.abs() + 0.5)).clamp(-127, 127).to(torch.int8), scale


if triton is not None:
    from longlive_core.infer.kv_attention import _bf16, _dot
    from longlive_core.quant.nvfp4_decode import _e4m3
    from longlive_core.quant.triton_kernels import _HW_ROUND, _f32, _round_e4m3

    @triton.jit
    def _int8_rows(X, Q, S, R, D: tl.constexpr, BR: tl.constexpr):
        """``int8_rows_torch`` of BR contiguous rows of D."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        keep = rows[:, None] < R
        offs = rows[:, None] * D + tl.arange(0, D)[None, :]
        x = _f32(tl.load(X + offs, mask=keep, other=0.0))
        # correctly rounded divisions (the GPU's "/" is approximate): the same codes as int8_rows_torch
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), 127.0), 1e-12)
        q = tl.div_rn(x, scale[:, None])
        q = tl.minimum(tl.maximum(tl.where(q < 0, -tl.floor(-q + 0.5), tl.floor(q + 0.5)), -127.0), 127.0)
        tl.store(Q + offs, q.to(tl.int8), mask=keep)
        tl.store(S + rows, scale, mask=rows < R)

    @triton.jit
    def _load_e4m3(ptr, mask):
        """An E4M3 tile: as it is on a GPU, decoded to float32 under the interpreter (a uint8 view)."""
        if _HW_ROUND:  # noqa: SIM108 - a statement: Triton 3.6 rejects two returns of other types
            out = tl.load(ptr, mask=mask, other=0.0)
        else:
            out = _e4m3(tl.load(ptr, mask=mask, other=0).to(tl.int32))
        return out

    @triton.jit
    def _to_e4m3(x):
        if _HW_ROUND:  # noqa: SIM108 - a statement: Triton 3.6 rejects two returns of other types
            out = x.to(tl.float8e4nv)
        else:
            out = _round_e4m3(x)
        return out

    @triton.jit
    def _attention_8bit(Q, SQ, K, SK, V, SV, Out, M, N, qk_scale, p_scale,
                        D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PV_FP8: tl.constexpr):
        """One (BM queries, one batch-head) tile over every key: Q (BH, M, D) and K (BH, N, D) in INT8
        with their scales SQ (BH, M) and SK (BH, N); V^T (BH, D, N) in E4M3 with SV (BH, D) when
        ``PV_FP8``, else V (BH, N, D) in bfloat16 (SV unread)."""
        pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        rows = offs_m < M
        q = tl.load(Q + bh * M * D + offs_m[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0)
        sq = tl.load(SQ + bh * M + offs_m, mask=rows, other=0.0) * qk_scale
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for start in range(0, N, BN):
            offs_n = start + tl.arange(0, BN)
            valid = offs_n < N
            k = tl.load(K + bh * N * D + offs_n[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0)
            sk = tl.load(SK + bh * N + offs_n, mask=valid, other=0.0)
            # int32 on a GPU; the interpreter's float32 sum of products <= 127^2 x D is exact
            s = _dot(q, tl.trans(k)).to(tl.float32) * sq[:, None] * sk[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if PV_FP8:
                vt = _load_e4m3(V + bh * D * N + offs_d[:, None] * N + offs_n[None, :], valid[None, :])
                acc = acc * alpha[:, None] + tl.dot(_to_e4m3(p * p_scale), tl.trans(vt))
            else:
                v = tl.load(V + bh * N * D + offs_n[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
                acc = acc * alpha[:, None] + _dot(_bf16(p), v)
            m_i = m_new
        if PV_FP8:
            acc = acc * (tl.load(SV + bh * D + offs_d)[None, :] / p_scale)
        out = acc / l_i[:, None]
        tl.store(Out + bh * M * D + offs_m[:, None] * D + offs_d[None, :], _bf16(out), mask=rows[:, None])


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_rows_torch`` of a contiguous (R, D) tensor by one Triton kernel (the interpreter's too)."""
    r, d = x.shape
    q = torch.empty((r, d), dtype=torch.int8, device=x.device)
    s = torch.empty((r,), dtype=torch.float32, device=x.device)
    if r:
        _int8_rows[(triton.cdiv(r, ROWS),)](x.contiguous(), q, s, r, D=d, BR=ROWS)
    return q, s


def attention_8bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "fp8",
                   block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for (B, H, L, D) bfloat16 tensors (no mask): q k^T in INT8 (the keys
    K-smoothed), P V in E4M3 (``pv="fp8"``) or bfloat16 (``"bf16"``)."""
    if triton is None:
        raise RuntimeError("8-bit attention needs Triton")
    if pv not in ("fp8", "bf16"):
        raise ValueError(f"pv must be fp8 or bf16; got {pv!r}")
    b, h, m, d = q.shape
    n = k.shape[2]
    if d % 16 or d & (d - 1):
        raise ValueError(f"the head dimension must be a power of two and a multiple of 16; got {d}")
    k = k - k.mean(dim=2, keepdim=True, dtype=torch.float32).to(k.dtype)
    q8, sq = int8_rows(q.reshape(-1, d))
    k8, sk = int8_rows(k.reshape(-1, d))
    if pv == "fp8":
        v8, sv = quantize_rows(v.transpose(-1, -2).reshape(-1, n))  # per head and channel, over the keys
        v8 = v8 if q.is_cuda else v8.view(torch.uint8)  # the interpreter decodes the bytes itself
    else:
        v8, sv = v.contiguous(), sq  # sv: any float32 pointer, unread
    out = torch.empty_like(q)
    grid = (triton.cdiv(m, block_m), b * h)
    extra = {} if q.device.type == "cpu" else {"num_warps": 8, "num_stages": 2}
    _attention_8bit[grid](q8, sq, k8, sk, v8, sv, out, m, n, math.log2(math.e) / math.sqrt(d), P_SCALE,
                          D=d, BM=block_m, BN=block_n, PV_FP8=pv == "fp8", **extra)
    return out
