"""Attention over an NVFP4 KV cache that reads the cache as it is stored: a Triton kernel that loads
each tile of E2M1 codes and E4M3 block scales, dequantizes it in registers and attends (online
softmax, as flash attention), then attends over the chunk's own keys and values in bfloat16. The
torch path (``kv_quant.QuantizedChunk.dequantize``) writes the whole window out in bfloat16 for
every pass of every layer: 3.56x the bytes the codes take, read back again by SDPA.

A tile's values are code x block scale x (1 / the chunk's global scale) in float32, rounded once to
bfloat16 for the tensor cores; the torch path rounds the global scale to bfloat16 first, so the two
differ in the last bit of some values, and the kernel's are the closer to the exact dequantization.
The codes of the cached chunks are concatenated per call (0.28x the bytes of the dequantized copy
the torch path makes). On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1)
for the tests; generation there takes the torch path.

Not used by generation: on the H200 it measured 15.7 ms for one chunk over the paper's window against
5.6 ms for the torch path and 3.5 ms for SDPA over a bf16 cache (bench/attention_kernels.py, in
bench/RESULTS.md): every query tile decodes the whole window again on the CUDA cores. What the cache
reads through is ``window``: the dequantized window written in one pass, by one launch a chunk
(``dequantized_window`` for NVFP4 chunks, ``dequantized_fp8_window`` for FP8's), the same bits as
the torch path, then SDPA. Those launches are bound by their instructions more than by their bytes:
the NVFP4 one divides twice a block of 16 rather than once an element (``_e2m1_times``), which
made its read 2.16x faster on an H100, read then SDPA there as fast as the BF16 cache's in-place read
in one run (bench/RESULTS.md).
"""
from __future__ import annotations

import functools
import math

import torch

from longlive_core.infer.kv_quant import FP8Chunk, QuantizedChunk
from longlive_core.quant import triton_kernels
from longlive_core.quant.nvfp4 import BLOCK
from longlive_core.quant.triton_launch import CachedLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring Triton
    triton = None

BLOCK_M, BLOCK_N = 128, 64  # queries x keys per step: a 128 x 128 float32 accumulator over 8 warps


@functools.cache
def available() -> bool:
    """Triton and a GPU with bfloat16 tensor cores (compute capability 8.0+)."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


if triton is not None:
    # Triton's CPU interpreter multiplies bfloat16 tiles as their raw bits and truncates its casts to
    # bfloat16: there the operands are float32 tiles holding the bfloat16 values, rounded to nearest as
    # the GPU's convert rounds (quant/triton_kernels.py's helpers)
    from longlive_core.quant.nvfp4_decode import _e2m1_times, _e4m3
    from longlive_core.quant.triton_kernels import _HW_ROUND, _f32, _round_bf16

    @triton.jit
    def _bf16(x):
        """A float32 tile as a tensor-core operand: bfloat16, rounded to nearest."""
        if _HW_ROUND:  # noqa: SIM108 - a statement: Triton 3.6 rejects two returns of other types
            out = x.to(tl.bfloat16)
        else:
            out = _round_bf16(x)
        return out

    @triton.jit
    def _dot(a, b):
        if _HW_ROUND:  # noqa: SIM108 - a statement: Triton 3.6 rejects two returns of other types
            out = tl.dot(a, b)
        else:
            out = tl.dot(_f32(a), _f32(b))
        return out

    @triton.jit
    def _e4m3_converted(b, CONVERT: tl.constexpr):
        """``_e4m3`` by the GPU's convert where ``CONVERT`` (6 SASS instructions an element in the FP8
        window kernel for sm_90, 21 by the bits' arithmetic), else ``_e4m3``: Triton has FP8 types from
        sm_89 only, and the CPU interpreter none. (The NVFP4 kernel decodes a scale a block of 16 and
        keeps ``_e4m3``: there the convert measured no fewer.)"""
        if CONVERT:  # noqa: SIM108 - a statement: Triton 3.6 rejects two returns of other types
            out = b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            out = _e4m3(b)
        return out

    @triton.jit
    def _dequant_tile(C, S, G, offs_n, valid, sc_n, ss_n, D: tl.constexpr, BN: tl.constexpr):
        """(BN, D) bfloat16: the tokens ``offs_n`` of one head's codes ``C`` (D/2 bytes a token, element
        2i in the low nibble), block scales ``S`` (D/16 bytes) and per-token decode scales ``G``."""
        offs_h = tl.arange(0, D // 2)
        offs_s = tl.arange(0, D // 16)
        c = tl.load(C + offs_n[:, None] * sc_n + offs_h[None, :], mask=valid[:, None], other=0).to(tl.int32)
        s = _e4m3(tl.load(S + offs_n[:, None] * ss_n + offs_s[None, :], mask=valid[:, None], other=0).to(tl.int32))
        g = tl.load(G + offs_n, mask=valid, other=0.0)[:, None]
        q0, q1 = (s * g)[:, :, None], (1.5 * s * g)[:, :, None]
        c = tl.reshape(c, (BN, D // 16, 8))
        lo = _e2m1_times(c & 15, q0, q1)
        hi = _e2m1_times(c >> 4, q0, q1)
        return _bf16(tl.reshape(tl.join(lo, hi), (BN, D)))

    @triton.jit
    def _dequantize_rows(C, S, E, Out, N, row0, out_tokens, D: tl.constexpr, BN: tl.constexpr):
        """BN tokens of one batch-head's codes C (BH, N, D/8 int32 words: eight codes each, element 8w + j in
        nibble j) and scale bytes S (BH, N, D/16) of one chunk, divided by the chunk's S_enc (E, float32)
        as bfloat16, into rows [row0, row0 + N) of Out (BH, out_tokens, D): code x scale / S_enc rounded
        once in float32 (``_e2m1_times``: two divisions a block of 16), then to bfloat16, as torch's
        bfloat16 division does (``QuantizedChunk.dequantize``): the same bits."""
        pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        offs_n = pid * BN + tl.arange(0, BN)
        valid = offs_n < N
        offs_w = tl.arange(0, D // 8)
        offs_s = tl.arange(0, D // 16)
        w = tl.load(C + bh * N * (D // 8) + offs_n[:, None] * (D // 8) + offs_w[None, :], mask=valid[:, None],
                    other=0)
        s = _e4m3(tl.load(S + bh * N * (D // 16) + offs_n[:, None] * (D // 16) + offs_s[None, :], mask=valid[:, None],
                          other=0).to(tl.int32))
        enc = _bf16(tl.load(E)).to(tl.float32)
        q0 = tl.div_rn(s, enc)[:, :, None, None]
        q1 = tl.div_rn(1.5 * s, enc)[:, :, None, None]  # 1.5 S is exact: S has at most 4 significant bits
        w = tl.reshape(w.to(tl.uint32, bitcast=True), (BN, D // 16, 2, 1))  # a block of 16: two words
        n = ((w >> (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, None, :]) & 15).to(tl.int32, bitcast=True)
        x = tl.reshape(_e2m1_times(n, q0, q1), (BN, D))
        tl.store(Out + bh * out_tokens * D + (row0 + offs_n[:, None]) * D + tl.arange(0, D)[None, :], _bf16(x),
                 mask=valid[:, None])

    @triton.jit
    def _shifted_rows(X, Mean, Out, M, H, sxb, sxh, sxl, row0, out_tokens, D: tl.constexpr, BN: tl.constexpr):
        """BN tokens of one batch-head of X (B, H, M, D: any strides, the channels contiguous) less Mean
        (1, H, 1, D, float32) into rows [row0, row0 + M) of Out (BH, out_tokens, D): the difference in
        float32 rounded once to bfloat16, as ``smoothed`` computes it: the same bits."""
        pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        offs_n = pid * BN + tl.arange(0, BN)
        valid = offs_n < M
        offs_d = tl.arange(0, D)
        x = _f32(tl.load(X + (bh // H) * sxb + (bh % H) * sxh + offs_n[:, None].to(tl.int64) * sxl + offs_d[None, :],
                         mask=valid[:, None], other=0.0))
        x = x - tl.load(Mean + (bh % H) * D + offs_d)[None, :]
        tl.store(Out + bh * out_tokens * D + (row0 + offs_n[:, None]) * D + offs_d[None, :], _bf16(x),
                 mask=valid[:, None])

    @triton.jit
    def _dequantize_fp8_rows(C, S, Out, N, row0, out_tokens, D: tl.constexpr, BN: tl.constexpr,
                             CONVERT: tl.constexpr):
        """BN tokens of one batch-head's E4M3 code bytes C (BH, N, D) times their float32 scales S (BH, N),
        into rows [row0, row0 + N) of Out (BH, out_tokens, D): the product in float32, rounded once to
        bfloat16, as ``FP8Chunk.dequantize`` computes it: the same bits."""
        pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        offs_n = pid * BN + tl.arange(0, BN)
        valid = offs_n < N
        offs_d = tl.arange(0, D)
        c = _e4m3_converted(tl.load(C + bh * N * D + offs_n[:, None] * D + offs_d[None, :], mask=valid[:, None],
                                    other=0).to(tl.int32), CONVERT)
        x = c * tl.load(S + bh * N + offs_n, mask=valid, other=0.0)[:, None]
        tl.store(Out + bh * out_tokens * D + (row0 + offs_n[:, None]) * D + offs_d[None, :], _bf16(x),
                 mask=valid[:, None])

    @triton.jit
    def _softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale):
        s = _dot(q, tl.trans(k)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(_bf16(p), v)
        return m_new, l_i, acc

    @triton.jit
    def _nvfp4_cache_attention(Q, KC, KS, KG, VC, VS, VG, K2, V2, Out, N, M, M2, qk_scale,
                               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """One (BM queries, one batch-head) tile: the N cached tokens from codes, then the chunk's own
        M2 in bfloat16. Every tensor is contiguous, (batch x heads, tokens, ...)."""
        pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        rows = offs_m[:, None] < M
        q = tl.load(Q + bh * M * D + offs_m[:, None] * D + offs_d[None, :], mask=rows, other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for start in range(0, N, BN):
            offs_n = start + tl.arange(0, BN)
            valid = offs_n < N
            k = _dequant_tile(KC + bh * N * (D // 2), KS + bh * N * (D // 16), KG, offs_n, valid, D // 2, D // 16,
                              D, BN)
            v = _dequant_tile(VC + bh * N * (D // 2), VS + bh * N * (D // 16), VG, offs_n, valid, D // 2, D // 16,
                              D, BN)
            m_i, l_i, acc = _softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale)
        for start in range(0, M2, BN):
            offs_n = start + tl.arange(0, BN)
            valid = offs_n < M2
            tile = bh * M2 * D + offs_n[:, None] * D + offs_d[None, :]
            k = tl.load(K2 + tile, mask=valid[:, None], other=0.0)
            v = tl.load(V2 + tile, mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale)
        out = acc / l_i[:, None]
        tl.store(Out + bh * M * D + offs_m[:, None] * D + offs_d[None, :], _bf16(out), mask=rows)

    # a window read launches one kernel a cached chunk a layer a pass (2,520 over a 5-chunk video): through
    # CachedLaunch, not Triton's fn[grid] and its tens of microseconds of host time a launch
    _rows_launcher = CachedLaunch(_dequantize_rows)
    _fp8_rows_launcher = CachedLaunch(_dequantize_fp8_rows)
    _shifted_launcher = CachedLaunch(_shifted_rows)


def smoothed(k: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``k`` less the K-smoothing ``mean`` (1, H, 1, D) in float32, back in k's dtype (None: ``k``)."""
    return k if mean is None else (k.float() - mean).to(k.dtype)


def _place_own(out: torch.Tensor, own: torch.Tensor, shift: torch.Tensor | None, block_n: int) -> None:
    """The window's last rows: ``own``, less ``shift`` where given (``smoothed``'s bits in one launch, where
    torch makes a float32 copy, a subtraction, a cast and the copy into the window)."""
    b, h, m, d = own.shape
    if shift is None:
        out[:, :, out.shape[2] - m:] = own
        return
    if tuple(shift.shape) != (1, h, 1, d):
        raise ValueError(f"the smoothing mean must be (1, {h}, 1, {d}); got {tuple(shift.shape)}")
    own = own if own.stride(-1) == 1 else own.contiguous()
    if m:
        _shifted_launcher[(triton.cdiv(m, block_n), b * h)](own, shift.float().contiguous(), out, m, h,
                                                            own.stride(0), own.stride(1), own.stride(2),
                                                            out.shape[2] - m, out.shape[2], D=d, BN=block_n)


def _stacked(chunks: list[QuantizedChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunks' codes and scales laid end to end over the tokens, and 1 / S_enc of each token's
    chunk (float32)."""
    codes = torch.cat([c.codes for c in chunks], dim=2)
    scales = torch.cat([c.scales for c in chunks], dim=2).view(torch.uint8)
    decode = torch.cat([torch.reciprocal(c.encode_scale.float()).expand(c.tokens) for c in chunks])
    return codes.contiguous(), scales.contiguous(), decode.contiguous()


def dequantized_window(chunks: list[QuantizedChunk], own: torch.Tensor, block_n: int = BLOCK_N,
                       shift: torch.Tensor | None = None) -> torch.Tensor:
    """[the chunks dequantized; ``own``, less ``shift`` where given] along the tokens as one
    (B, H, N + M, D) bfloat16 tensor: one launch a chunk reads its codes and writes its rows of the window once, where
    ``QuantizedChunk.dequantize`` and a concatenation make several passes (and laying the chunks' codes
    end to end first, one launch for all, copied them once more: 4.17 ms against the FP8 window's 4.06
    on the H200); bit for bit what ``torch.cat([c.dequantize(bf16) ...] + [smoothed(own, shift)])`` gives."""
    if triton is None:
        raise RuntimeError("the NVFP4 window kernel needs Triton")
    b, h, m, d = own.shape
    if d % BLOCK or d & (d - 1) or own.dtype != torch.bfloat16:
        raise ValueError(f"a bfloat16 window whose head dimension is a power of two and a multiple of {BLOCK}; "
                         f"got {own.dtype}, {d}")
    n = sum(c.tokens for c in chunks)
    out = torch.empty((b, h, n + m, d), dtype=torch.bfloat16, device=own.device)
    row = 0
    for c in chunks:
        if c.tokens:
            codes, scales = c.codes.contiguous().view(torch.int32), c.scales.contiguous().view(torch.uint8)
            _rows_launcher[(triton.cdiv(c.tokens, block_n), b * h)](codes, scales, c.encode_scale.float(), out,
                                                                    c.tokens, row, n + m, D=d, BN=block_n)
        row += c.tokens
    _place_own(out, own, shift, block_n)
    return out


def dequantized_fp8_window(chunks: list[FP8Chunk], own: torch.Tensor, block_n: int = BLOCK_N,
                           shift: torch.Tensor | None = None) -> torch.Tensor:
    """[the FP8 chunks dequantized; ``own``, less ``shift`` where given] along the tokens as one
    (B, H, N + M, D) bfloat16 tensor, one launch a chunk, each reading its codes once and writing its
    rows of the window once (the torch path makes float32 copies and concatenates): bit for bit what
    ``torch.cat([c.dequantize(bf16) ...] + [smoothed(own, shift)])`` gives."""
    if triton is None:
        raise RuntimeError("the FP8 window kernel needs Triton")
    b, h, m, d = own.shape
    if d & (d - 1) or own.dtype != torch.bfloat16:
        raise ValueError(f"a bfloat16 window whose head dimension is a power of two; got {own.dtype}, {d}")
    n = sum(c.tokens for c in chunks)
    out = torch.empty((b, h, n + m, d), dtype=torch.bfloat16, device=own.device)
    convert = own.is_cuda and triton_kernels.available()  # Triton's FP8 types (sm_89+)
    row = 0
    for c in chunks:
        if c.tokens:
            codes, scales = c.codes.contiguous().view(torch.uint8), c.scales.contiguous()
            _fp8_rows_launcher[(triton.cdiv(c.tokens, block_n), b * h)](codes, scales, out, c.tokens, row, n + m,
                                                                        D=d, BN=block_n, CONVERT=convert)
        row += c.tokens
    _place_own(out, own, shift, block_n)
    return out


def window(chunks: list, own: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """[the cached chunks, dequantized to ``own``'s dtype; ``own`` less the K-smoothing mean ``shift`` where
    given (``smoothed``)] along the tokens: NVFP4 chunks on a GPU
    through ``dequantized_window`` (read then SDPA 1.5x faster than by torch's passes on an H100, and in
    that run as fast as the BF16 cache's in-place read: bench/RESULTS.md), FP8 chunks through
    ``dequantized_fp8_window``, anything else through torch; the same bits either way."""
    d = own.shape[-1]
    if chunks and own.is_cuda and own.dtype == torch.bfloat16 and available() and d & (d - 1) == 0:
        if d % BLOCK == 0 and all(isinstance(c, QuantizedChunk) for c in chunks):
            return dequantized_window(chunks, own, BLOCK_N, shift)
        if all(isinstance(c, FP8Chunk) for c in chunks):
            return dequantized_fp8_window(chunks, own, BLOCK_N, shift)
    return torch.cat([c.dequantize(own.dtype) for c in chunks] + [smoothed(own, shift)], dim=2)


def nvfp4_cache_attention(q: torch.Tensor, past_k: list[QuantizedChunk], past_v: list[QuantizedChunk],
                          k: torch.Tensor, v: torch.Tensor, block_m: int = BLOCK_M, block_n: int = BLOCK_N
                          ) -> torch.Tensor:
    """softmax(q [K_cache; k]^T / sqrt(D)) [V_cache; v] for (B, H, L, D) bfloat16 ``q``, ``k``, ``v`` (the
    chunk's own keys as the cache holds them: K-smoothed where it is) and a non-empty NVFP4 cache."""
    if triton is None:
        raise RuntimeError("the fused NVFP4 cache attention needs Triton")
    b, h, m, d = q.shape
    if d % BLOCK or d & (d - 1):
        raise ValueError(f"the head dimension must be a power of two and a multiple of {BLOCK}; got {d}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise ValueError(f"bfloat16 queries, keys and values only; got {q.dtype}, {k.dtype}, {v.dtype}")
    kc, ks, kg = _stacked(past_k)
    vc, vs, vg = _stacked(past_v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    grid = (triton.cdiv(m, block_m), b * h)
    extra = {} if q.device.type == "cpu" else {"num_warps": 8, "num_stages": 2}
    _nvfp4_cache_attention[grid](q, kc, ks, kg, vc, vs, vg, k, v, out, kc.shape[2], m, k.shape[2],
                                 math.log2(math.e) / math.sqrt(d), D=d, BM=block_m, BN=block_n, **extra)
    return out
