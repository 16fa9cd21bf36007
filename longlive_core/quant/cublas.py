"""A cuBLAS GEMM whose output scale is a device scalar: ``alpha * (a @ b) + beta * c`` with bfloat16
(or any cuBLAS-supported) operands, float32 accumulation and alpha applied in float32 before the
output is rounded, as a real NVFP4 GEMM applies its global decode scales. torch exposes no GEMM
with a device-side alpha for these dtypes, and a host-side alpha would need a device sync per GEMM;
without it the product must round-trip through float32 memory to be scaled.

The library is the libcublas torch itself loaded (found in this process's memory map), called
through ctypes on torch's own handle for the current thread and stream (so torch's stream and
workspace apply), switched to device-side scalars and float32 reductions for the one call and
restored after it.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from longlive_core.devices import made_current

_OP_N, _OP_T = 0, 1
_POINTER_MODE_DEVICE = 1
# split-K partial sums in float32, not in the (bfloat16) output type: the reference adds in float32
_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
# (operand dtype, output dtype) pairs cublasGemmEx computes with CUBLAS_COMPUTE_32F
_PAIRS = {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
          (torch.float16, torch.float32), (torch.float32, torch.float32)}
_MAX_INT = 2**31 - 1  # cuBLAS takes int dimensions and leading dimensions

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_constants: dict[tuple[int, float], torch.Tensor] = {}


class CublasError(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is not None:  # every GEMM asks: no lock once loaded
        return _lib
    with _lock:
        if _lib is None:
            torch.cuda.current_blas_handle()  # makes torch load its libcublas if it has not yet
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
            if not paths:
                raise CublasError("libcublas is not loaded in this process although torch has CUDA; "
                                  "the device-alpha GEMM needs the cuBLAS that torch uses")
            if len(paths) > 1:  # another package loaded its own copy: take the one torch's soname resolves to
                paths = {f"libcublas.so.{torch.version.cuda.split('.')[0]}"}
            lib = ctypes.CDLL(paths.pop())
            i, p, ip = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
            signatures = {"cublasGetPointerMode_v2": [p, ip], "cublasSetPointerMode_v2": [p, i],
                          "cublasGetMathMode": [p, ip], "cublasSetMathMode": [p, i],
                          "cublasGemmEx": [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]}
            for name, argtypes in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            _lib = lib
        return _lib


def _checked(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cublasStatus_t {status}")


def _constant(device: torch.device, value: float) -> torch.Tensor:
    """beta as a device scalar, made once per device; not cached when first needed inside a CUDA
    graph capture (there the fill is only recorded, and its memory belongs to that graph)."""
    key = (device.index, value)
    if key in _constants:
        return _constants[key]
    tensor = torch.full((), value, dtype=torch.float32, device=device)
    if not torch.cuda.is_current_stream_capturing():
        _constants[key] = tensor
    return tensor


def _operand(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, cuBLAS op, leading dimension) presenting logical (r, c) ``t`` as the column-major
    (c, r) matrix the row-major product needs: row-major memory as is, column-major transposed."""
    r, c = t.shape
    if t.stride(1) == 1 and max(c, 1) <= t.stride(0) <= _MAX_INT:
        return t, _OP_N, t.stride(0)
    if t.stride(0) == 1 and max(r, 1) <= t.stride(1) <= _MAX_INT:
        return t, _OP_T, t.stride(1)
    t = t.contiguous()
    return t, _OP_N, max(c, 1)


def supported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether scaled_mm runs this product (CUDA, not ROCm; a dtype pair cuBLAS takes; non-empty)."""
    return (a.is_cuda and torch.version.hip is None and b.device == a.device and a.dtype == b.dtype
            and (a.dtype, out_dtype) in _PAIRS and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
            and min(a.shape[0], a.shape[1], b.shape[1]) > 0 and max(*a.shape, *b.shape) <= _MAX_INT)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
              c: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * (a @ b) (+ c)`` as a new (M, N) row-major tensor of ``out_dtype``: a (M, K) and
    b (K, N) CUDA matrices (any mix of row- and column-major), alpha a float32 device scalar,
    c (M, N) (beta = 1; it is copied into the output first, so broadcast views such as a bias row are
    materialized and another dtype is rounded to out_dtype, as ``c.to(out_dtype)`` rounds it)."""
    if not supported(a, b, out_dtype):
        raise ValueError(f"scaled_mm takes two non-empty 2-D CUDA matrices with matching inner dims and an "
                         f"(operand, output) dtype pair in {sorted((str(i), str(o)) for i, o in _PAIRS)}; got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype} -> {out_dtype}")
    if alpha.device != a.device or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ValueError("alpha must be a float32 scalar on the operands' device")
    return scaled_mm_unchecked(a, b, alpha, out_dtype, c)


def scaled_mm_unchecked(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
                        c: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_mm for a caller that has checked ``supported(a, b, out_dtype)`` and made alpha a
    float32 scalar on a's device itself (emulated_mm): the checks cost the host ~6 us per GEMM."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if c is not None:
        out.copy_(c)
    beta = _constant(a.device, 0.0 if c is None else 1.0)
    # row-major out = a @ b is column-major out^T = b^T a^T: cuBLAS gets (b, a) with m = n, n = m
    bb, op_b, ld_b = _operand(b)
    aa, op_a, ld_a = _operand(a)
    lib = _library()
    with made_current(a):  # the handle, its stream and the call all on the operands' device
        handle = ctypes.c_void_p(torch.cuda.current_blas_handle())  # torch sets its stream and workspace
        pointer_mode, math_mode = ctypes.c_int(), ctypes.c_int()
        _checked(lib.cublasGetPointerMode_v2(handle, ctypes.byref(pointer_mode)), "cublasGetPointerMode")
        _checked(lib.cublasGetMathMode(handle, ctypes.byref(math_mode)), "cublasGetMathMode")
        try:
            _checked(lib.cublasSetPointerMode_v2(handle, _POINTER_MODE_DEVICE), "cublasSetPointerMode")
            _checked(lib.cublasSetMathMode(handle, _MATH_DISALLOW_REDUCED_PRECISION_REDUCTION), "cublasSetMathMode")
            dt = _DTYPES[a.dtype]
            _checked(lib.cublasGemmEx(handle, op_b, op_a, n, m, k, alpha.data_ptr(), bb.data_ptr(), dt, ld_b,
                                      aa.data_ptr(), dt, ld_a, beta.data_ptr(), out.data_ptr(), _DTYPES[out_dtype],
                                      n, _COMPUTE_32F, _GEMM_DEFAULT), "cublasGemmEx")
        finally:  # torch's handle goes back as it was: its own calls pass host scalars
            lib.cublasSetPointerMode_v2(handle, pointer_mode.value)
            lib.cublasSetMathMode(handle, math_mode.value)
    return out
