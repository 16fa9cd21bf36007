"""FP8 (E4M3) attention forward through cuDNN's fused FP8 SDPA (the ``sdpa_fp8`` node of the cuDNN
frontend's Python graph API, package ``nvidia-cudnn-frontend``, module ``cudnn``): Hopper's FP8 tensor
cores for both products, inference only (no mask, no causal, no dropout, no backward).

Numerics, per call (all scales stay on the device: no host sync):

- Q, K and V in E4M3, each with one float32 scale per tensor (descale = amax / 448, codes = x / descale;
  ``attention_fp8_io``: on CUDA two Triton launches per tensor, where torch's passes took 3.3 ms of 5.9
  on the H200). Generation keeps a chunk's K and V codes over its passes (``attention_fp8_window``):
  their descales are twice amax / 448 there (``attention_fp8_io.HEADROOM``), and a later pass
  quantizes its own rows only, one launch each for K and V. K is smoothed first: its mean over the
  tokens, per head and channel, is subtracted (softmax ignores a shift every key shares, and real keys
  carry a per-channel offset that would eat the range), as ``attention_8bit`` does. V is smoothed too: its
  mean over the tokens is subtracted and added back to the output (exact: every row of P sums to 1).
  Hopper's FP8 tensor cores add each product into the accumulator at limited precision, and a P V
  over 28,160 keys whose V shares an offset grows a sum that the later products vanish against:
  measured on the H200 (``bench/fp8_attention_layers.py``, random 5B weights, layers 1-29), every row
  of the output came out about half of BF16's (relative error 0.48-0.55); ``bench/fp8_accumulation.py``
  models the accumulator (each step's products aligned to the largest exponent, 13 bits kept, truncated
  toward zero) and matches the kernel within 10% where exact sums are 89% off. With V smoothed the
  model's error is 0.08%; the kernel's with V smoothed is not measured yet.
- S = Q K^T x descale_q x descale_k / sqrt(D) in float32 inside the kernel; P = exp(S - running max),
  in (0, 1], times ``P_SCALE`` = 448 into E4M3 for P V (descale 1 / 448).
- O in E4M3: on Hopper cuDNN writes an FP8 O only (a BF16 O needs Blackwell and cuDNN >= 9.13, the
  frontend's ``sdpa_support_surface.h``), scaled by ``O_HEADROOM`` / descale_v (|O| <= max |V|: a
  convex combination of V's rows; of the smoothed V's here), then dequantized here to the input's dtype.
  The O rounding is a third E4M3 rounding on top of Q K^T's and P's. With a kept window's doubled
  descale, O's codes reach about 112, not 224: a later pass's own V rows may reach 448 x descale_v.

Emulated in float32 on the CPU against float64 attention (two heads of 128, 512 queries over 28,160 keys,
N(0, 1) with a per-channel key offset): relative L2 error 6.0% (Q K^T in E4M3 alone 4.7%, P 2.6%, V and
O 2.6% each; 7.9% without K-smoothing); queries 3x sharper 10%.

Graphs are built once per (shapes, strides, device) and kept in a bounded LRU. ``longlive generate``
uses it with ``generate.attention: fp8`` (the KV cache's ``attention``), through ``attention_fp8_window``:
a chunk's window is quantized on its first pass and kept, and the later passes quantize their own rows
only (``attention_fp8_io.FP8Window``); bench/attention_kernels.py has
its speed, bench/generate_product.py the loop's, bench/fp8_attention_layers.py its error per layer.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict

import torch

from longlive_core.infer.attention_fp8_io import FP8Window, dequantized_output, smoothed_e4m3
from longlive_core.quant.fp8 import E4M3_MAX

# The frontend's FP8 SDPA forward support surface (include/cudnn_frontend/node/sdpa_support_surface.h):
# backend 9.1.0 or newer, never 9.10.0, compute capability 9.0 or newer, head dims multiples of 16 up to 256.
MIN_BACKEND = 90100
BROKEN_BACKENDS = (91000,)
MIN_CAPABILITY = (9, 0)
MAX_HEAD_DIM = 256
# P = exp(S - running max) is at most 1, so P x 448 fills E4M3's range exactly and probabilities down to
# 2^-6 / 448 (~3.5e-5 of the row's largest) keep all their mantissa bits. Amax_S (the node's output)
# measures P before this scale: it stays <= 1. Transformer Engine's delayed scaling lands on the same
# scale (448 / amax_s); the frontend's own tests use a conservative 32 (a power of two, a quarter of 128).
P_SCALE = E4M3_MAX
# O's scale is half of V's: a P rounded up by E4M3 can carry O a few percent past amax(V), and E4M3 has
# no infinity to saturate to; the halved scale costs one binade at the bottom of the range only.
O_HEADROOM = 0.5
CACHE_SIZE = 32  # graphs kept, one per (shapes, strides, device): building one plans and compiles

_lock = threading.Lock()
_graphs: OrderedDict = OrderedDict()
_handles: dict[int, object] = {}
_constants: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_import: list = []  # [module or None, why it did not import]
_ready: set[int] = set()  # devices ``unavailable_reason`` passed: once per process, not per layer and pass


def _cudnn():
    """The ``cudnn`` module, imported once; None when it does not import (with the reason kept)."""
    if not _import:
        try:
            import cudnn
        except Exception as exc:  # noqa: BLE001 - a missing wheel, a missing libcudnn, a too-old frontend
            _import.extend([None, f"{type(exc).__name__}: {exc}"])
        else:
            _import.extend([cudnn, ""])
    return _import[0]


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None where ``attention_fp8`` can run on ``device`` (default: the current CUDA device), else what is
    missing, every missing piece named."""
    missing = []
    cudnn = _cudnn()
    if cudnn is None:
        missing.append(f"the cuDNN frontend (pip nvidia-cudnn-frontend, module cudnn) does not import ({_import[1]})")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        missing.append(f"the tensors are on {device.type}, not a CUDA device")
    elif not torch.cuda.is_available():
        missing.append("no CUDA device")
    else:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            missing.append(f"compute capability {capability[0]}.{capability[1]} (FP8 SDPA needs 9.0, Hopper, or newer)")
    if cudnn is not None:
        try:
            version = cudnn.backend_version()
        except Exception as exc:  # noqa: BLE001 - libcudnn not loadable
            missing.append(f"no cuDNN backend library ({type(exc).__name__}: {exc})")
        else:
            if version < MIN_BACKEND or version in BROKEN_BACKENDS:
                missing.append(f"cuDNN backend {cudnn.backend_version_string()} (FP8 SDPA needs 9.1.0 or newer, "
                               "not 9.10.0)")
    return "; ".join(missing) or None


def available(device: torch.device | str | None = None) -> bool:
    """Whether ``attention_fp8`` can run on ``device``: cudnn imports, CUDA, compute capability >= 9.0 and a
    cuDNN backend with FP8 SDPA."""
    return unavailable_reason(device) is None


def _handle(cudnn, index: int):
    """One cuDNN handle per device (cuDNN binds a handle to the device current at its creation)."""
    handle = _handles.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _handles[index] = cudnn.create_handle()
    return handle


def _scalar_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_s, descale_s) as float32 (1, 1, 1, 1) device tensors, made once per device."""
    pair = _constants.get(device.index)
    if pair is None:
        pair = _constants[device.index] = (torch.full((1, 1, 1, 1), P_SCALE, device=device),
                                           torch.full((1, 1, 1, 1), 1.0 / P_SCALE, device=device))
    return pair


def _build(cudnn, handle, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out_shape: tuple[int, ...]):
    """An executable FP8 SDPA graph over q8, k8, v8's layouts (dims [B, H, S, D] with their strides): the
    graph, its tensors by name and its workspace bytes."""
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    t = {name: graph.tensor(name=name, dim=list(x.shape), stride=list(x.stride()), data_type=e4m3)
         for name, x in (("q", q8), ("k", k8), ("v", v8))}
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        t[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    t["o"], _, t["amax_s"], t["amax_o"] = graph.sdpa_fp8(
        t["q"], t["k"], t["v"], t["descale_q"], t["descale_k"], t["descale_v"], t["descale_s"], t["scale_s"],
        t["scale_o"], generate_stats=False, attn_scale=1.0 / math.sqrt(q8.shape[-1]), use_causal_mask=False,
        name="sdpa_fp8")
    strides = [math.prod(out_shape[i + 1:]) for i in range(len(out_shape))]  # contiguous, as o8 is allocated
    t["o"].set_output(True).set_dim(list(out_shape)).set_stride(strides).set_data_type(e4m3)
    for name in ("amax_s", "amax_o"):  # outputs the fused kernel writes, as in the frontend's FP8 samples
        t[name].set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return graph, t, graph.get_workspace_size()


@dataclasses.dataclass(frozen=True)
class FP8Inputs:
    """Q, K (smoothed) and V (smoothed) in E4M3 with their float32 descales, V's mean over the keys (added
    back to the output) and the output's dtype: what the fused kernel reads."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor
    offset: torch.Tensor
    dtype: torch.dtype


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raises where the kernel cannot run here or cannot take these shapes, saying which."""
    if not (q.is_cuda and q.device.index in _ready):
        reason = unavailable_reason(q.device)
        if reason is not None:
            raise RuntimeError(f"cuDNN FP8 attention is unavailable here: {reason}")
        _ready.add(q.device.index)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != v.shape[2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k and v must have one length and q, k one head dimension; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    for d in (q.shape[-1], v.shape[-1]):
        if d % 16 or d > MAX_HEAD_DIM:
            raise ValueError(f"FP8 SDPA needs head dimensions that are multiples of 16 up to {MAX_HEAD_DIM}; got {d}")
    if not (k.device == v.device == q.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")


def quantized_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> FP8Inputs:
    """The checks and the quantization ``attention_fp8`` runs before its kernel (bench/attention_kernels.py
    times the kernel apart from them)."""
    _check(q, k, v)
    # K and V smoothed in float32 (no rounding before the E4M3 one); V's mean is added back to the output
    q8, descale_q, _ = smoothed_e4m3(q, smooth=False)
    k8, descale_k, _ = smoothed_e4m3(k, smooth=True)
    v8, descale_v, offset = smoothed_e4m3(v, smooth=True)
    return FP8Inputs(q8, k8, v8, descale_q, descale_k, descale_v, offset, q.dtype)


def _attend(x: FP8Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel over ``x`` and its output dequantized: (output, amax_s (max P before its scale),
    amax_o (max |O|))."""
    cudnn = _cudnn()
    q8, k8, v8 = x.q8, x.k8, x.v8
    device = q8.device if q8.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    scale_o = O_HEADROOM / x.descale_v
    scale_s, descale_s = _scalar_constants(device)
    out_shape = (*q8.shape[:-1], v8.shape[-1])

    key = (tuple(q8.shape), q8.stride(), tuple(k8.shape), k8.stride(), tuple(v8.shape), v8.stride(), device.index)
    with _lock, torch.cuda.device(device):
        handle = _handle(cudnn, device.index)
        entry = _graphs.get(key)
        if entry is None:
            try:
                entry = _build(cudnn, handle, q8, k8, v8, out_shape)
            except Exception as exc:
                shapes = f"q {tuple(q8.shape)}, k {tuple(k8.shape)}, v {tuple(v8.shape)}"
                raise RuntimeError(f"cuDNN could not build an FP8 SDPA graph for {shapes} on "
                                   f"{torch.cuda.get_device_name(device)}: {exc}") from exc
            _graphs[key] = entry
            while len(_graphs) > CACHE_SIZE:
                _graphs.popitem(last=False)
        else:
            _graphs.move_to_end(key)
        graph, t, workspace_bytes = entry
        o8 = torch.empty(out_shape, dtype=torch.float8_e4m3fn, device=device)
        amax_s = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
        amax_o = torch.empty_like(amax_s)
        workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=device)
        pack = {t["q"]: q8, t["k"]: k8, t["v"]: v8, t["descale_q"]: x.descale_q, t["descale_k"]: x.descale_k,
                t["descale_v"]: x.descale_v, t["descale_s"]: descale_s, t["scale_s"]: scale_s, t["scale_o"]: scale_o,
                t["o"]: o8, t["amax_s"]: amax_s, t["amax_o"]: amax_o}
        # the kernel runs on torch's current stream, ordered after the quantization above and before the dequantization
        cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
        graph.execute(pack, workspace, handle=handle)
    return dequantized_output(o8, x.descale_v / O_HEADROOM, x.offset, x.dtype), amax_s, amax_o


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_fp8``'s output with the kernel's amax_s (max P before its scale) and amax_o (max |O|)."""
    return _attend(quantized_inputs(q, k, v))


def attention_fp8_quantized(x: FP8Inputs) -> torch.Tensor:
    """``attention_fp8`` over inputs ``quantized_inputs`` made: the kernel and its output's dequantization."""
    return _attend(x)[0]


def attention_fp8_window(q: torch.Tensor, window: FP8Window) -> torch.Tensor:
    """``attention_fp8`` over a window already in E4M3 (``FP8Window``: a chunk's later passes quantize only
    their own rows into it): only ``q`` is quantized here."""
    _check(q, window.k8, window.v8)
    q8, descale_q, _ = smoothed_e4m3(q, smooth=False)
    return _attend(FP8Inputs(q8, window.k8, window.v8, descale_q, window.descale_k, window.descale_v,
                             window.v_mean, q.dtype))[0]


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for (B, H, L, D) tensors (bfloat16 in production; the keys may be far longer
    than the queries) by cuDNN's fused FP8 SDPA: (B, H, Lq, Dv) in q's dtype. Raises RuntimeError naming what
    is missing where ``available()`` is False."""
    return _forward(q, k, v)[0]
