"""A cuBLASLt GEMM whose output scale is a device scalar: ``alpha * (a @ b) + bias`` with bfloat16
(or any cuBLASLt-supported) operands, float32 accumulation and alpha applied in float32 before the
output is rounded, as a real NVFP4 GEMM applies its global decode scales. torch exposes no GEMM
with a device-side alpha for these dtypes, and a host-side alpha would need a device sync per GEMM;
without it the product must round-trip through float32 memory to be scaled.

The library is the libcublasLt torch itself loaded (found in this process's memory map), called
through ctypes. Each shape gets a plan once per thread: the matmul descriptor (device-side alpha
and beta, the operand transposes, the bias epilogue), the four matrix layouts and the algorithm the
heuristic picks, under a preference that keeps split-K partial sums in float32 (the reference adds
in float32). A call then costs the host one cuBLASLt call and the output's allocation: the
per-call handle mode switches of cublasGemmEx (bench/RESULTS.md, iteration 8) are gone, and the bias
is added by the epilogue instead of being copied into the output first. The workspace is allocated
per call from torch's caching allocator on the current stream, so streams and CUDA graph captures
order it as they order any tensor.
"""
from __future__ import annotations

import collections
import ctypes
import threading

import torch

from longlive_core.devices import made_current

_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68  # cublasComputeType_t
_R_32F = 0  # cudaDataType_t of the scale (alpha, beta)
_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
# (operand dtype, output dtype) pairs cuBLASLt computes with CUBLAS_COMPUTE_32F
_PAIRS = {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
          (torch.float16, torch.float32), (torch.float32, torch.float32)}
_MAX_INT = 2**31 - 1
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t and their values (cublasLt.h)
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 2, 3, 4, 7, 8
_POINTER_MODE_DEVICE = 1
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES, _PREF_REDUCTION_SCHEME_MASK = 1, 3
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
# split-K partial sums in float32, as the reference adds: CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE only (the
# INPLACE scheme reduces in the output buffer, so in bfloat16 for bfloat16 outputs); algorithms without
# split-K (scheme NONE) pass any mask
_REDUCTION_COMPUTE_TYPE = 2
_MAX_WORKSPACE = 32 * 2**20  # fixed: torch's CUBLAS_WORKSPACE_CONFIG applies to its own handles only
_MAX_PLANS = 256  # per thread; a least recently used plan is destroyed beyond it (token counts vary)


class CublasError(RuntimeError):
    pass


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_handles: dict[int, ctypes.c_void_p] = {}
_constants: dict[tuple[int, float], torch.Tensor] = {}
_local = threading.local()  # plans per thread: a plan's bias pointer is set per call


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is not None:  # every GEMM asks: no lock once loaded
        return _lib
    with _lock:
        if _lib is None:
            torch.cuda.current_blas_handle()  # makes torch load its libcublas (and libcublasLt) if it has not yet
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libcublasLt.so" in line}
            if not paths:
                raise CublasError("libcublasLt is not loaded in this process although torch has CUDA; "
                                  "the device-alpha GEMM needs the cuBLASLt that torch uses")
            if len(paths) > 1:  # another package loaded its own copy: take the one torch's soname resolves to
                paths = {f"libcublasLt.so.{torch.version.cuda.split('.')[0]}"}
            lib = ctypes.CDLL(paths.pop())
            i, p, u64, i64, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
            pp = ctypes.POINTER(p)
            signatures = {
                "cublasLtCreate": [pp],
                "cublasLtMatmulDescCreate": [pp, i, i],
                "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
                "cublasLtMatmulDescDestroy": [p],
                "cublasLtMatrixLayoutCreate": [pp, i, u64, u64, i64],
                "cublasLtMatrixLayoutDestroy": [p],
                "cublasLtMatmulPreferenceCreate": [pp],
                "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
                "cublasLtMatmulPreferenceDestroy": [p],
                "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_Heuristic),
                                                   ctypes.POINTER(i)],
                "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_Algo), p, sz, p],
            }
            for name, argtypes in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            _lib = lib
        return _lib


def _checked(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cublasStatus_t {status}")


# the current stream's raw handle without building a torch.cuda.Stream object per call (Triton's
# launcher reads it the same way)
_current_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else \
    (lambda index: torch.cuda.current_stream(index).cuda_stream)


def _handle(device: torch.device) -> ctypes.c_void_p:
    """One cuBLASLt handle per device, made with that device current (callers make it so)."""
    handle = _handles.get(device.index)
    if handle is None:
        _library()  # outside the lock, which it takes itself
        with _lock:
            if device.index not in _handles:
                h = ctypes.c_void_p()
                _checked(_library().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
                _handles[device.index] = h
            handle = _handles[device.index]
    return handle


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


def _alignment(ptr: int) -> int:
    """The largest power of two (up to 256) that divides a device address: the heuristic only
    offers algorithms whose vector loads that alignment allows."""
    return min(ptr & -ptr, 256) if ptr else 256


def _set(setter, obj, attr: int, value: ctypes._SimpleCData, what: str) -> None:
    _checked(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


class _Plan:
    """The descriptor, layouts and algorithm of one GEMM shape (cuBLASLt's column-major view:
    out^T (n x m) = op(b^T) (n x k) @ op(a^T) (k x m))."""

    def __init__(self, device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype, m: int, n: int, k: int,
                 op_a: int, ld_a: int, op_b: int, ld_b: int, bias: torch.Tensor | None,
                 aligns: tuple[int, int, int]):
        self.desc, self.layouts = ctypes.c_void_p(), []
        self.bias_ptr = ctypes.c_void_p()
        try:
            self._build(device, dtype, out_dtype, m, n, k, op_a, ld_a, op_b, ld_b, bias, aligns)
        except BaseException:
            self.destroy()
            raise

    def _build(self, device, dtype, out_dtype, m, n, k, op_a, ld_a, op_b, ld_b, bias, aligns) -> None:
        lib = _library()
        _checked(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F),
                 "cublasLtMatmulDescCreate")
        setter = lib.cublasLtMatmulDescSetAttribute
        _set(setter, self.desc, _DESC_POINTER_MODE, ctypes.c_int32(_POINTER_MODE_DEVICE), "pointer mode")
        _set(setter, self.desc, _DESC_TRANSA, ctypes.c_int32(op_b), "transa")
        _set(setter, self.desc, _DESC_TRANSB, ctypes.c_int32(op_a), "transb")
        _set(setter, self.desc, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_DEFAULT if bias is None else _EPILOGUE_BIAS),
             "epilogue")
        if bias is not None:  # the heuristic reads the bias pointer's alignment from the descriptor
            self.set_bias(bias)
        dt, out_dt = _DTYPES[dtype], _DTYPES[out_dtype]
        shape_b = (n, k) if op_b == _OP_N else (k, n)
        shape_a = (k, m) if op_a == _OP_N else (m, k)
        for type_, (rows, cols), ld in ((dt, shape_b, ld_b), (dt, shape_a, ld_a), (out_dt, (n, m), n)):
            layout = ctypes.c_void_p()
            _checked(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), type_, rows, cols, ld),
                     "cublasLtMatrixLayoutCreate")
            self.layouts.append(layout)
        self.layout_b, self.layout_a, self.layout_out = self.layouts
        pref = ctypes.c_void_p()
        _checked(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            psetter = lib.cublasLtMatmulPreferenceSetAttribute
            _set(psetter, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_MAX_WORKSPACE), "workspace")
            _set(psetter, pref, _PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_COMPUTE_TYPE),
                 "reduction scheme")
            align_a, align_b, align_out = aligns  # cuBLASLt's A is our b, its B our a, C and D the output
            for name, value in (("a", align_b), ("b", align_a), ("c", align_out), ("d", align_out)):
                _set(psetter, pref, _PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(value), "alignment")
            found, count = _Heuristic(), ctypes.c_int()
            _checked(lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), self.desc, self.layout_b, self.layout_a,
                                                        self.layout_out, self.layout_out, pref, 1,
                                                        ctypes.byref(found), ctypes.byref(count)),
                     "cublasLtMatmulAlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            raise CublasError(f"cuBLASLt offers no algorithm for {m}x{k} @ {k}x{n} {dtype} -> {out_dtype} "
                              f"(ops {op_a}, {op_b}, leading dims {ld_a}, {ld_b}, alignments {aligns})")
        self.algo, self.workspace = found.algo, found.workspace_size

    def set_bias(self, bias: torch.Tensor) -> None:
        self.bias_ptr.value = bias.data_ptr()
        _set(_library().cublasLtMatmulDescSetAttribute, self.desc, _DESC_BIAS_POINTER, self.bias_ptr, "bias pointer")

    def destroy(self) -> None:
        lib = _library()
        for layout in self.layouts:
            lib.cublasLtMatrixLayoutDestroy(layout)
        if self.desc:
            lib.cublasLtMatmulDescDestroy(self.desc)
        self.layouts, self.desc = [], ctypes.c_void_p()


def _plans() -> collections.OrderedDict:
    plans = getattr(_local, "plans", None)
    if plans is None:
        plans = _local.plans = collections.OrderedDict()
    return plans


def supported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether scaled_mm runs this product (CUDA, not ROCm; a dtype pair cuBLASLt takes; non-empty)."""
    return (a.is_cuda and torch.version.hip is None and b.device == a.device and a.dtype == b.dtype
            and (a.dtype, out_dtype) in _PAIRS and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
            and min(a.shape[0], a.shape[1], b.shape[1]) > 0 and max(*a.shape, *b.shape) <= _MAX_INT)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * (a @ b) (+ bias)`` as a new (M, N) row-major tensor of ``out_dtype``: a (M, K) and
    b (K, N) CUDA matrices (any mix of row- and column-major), alpha a float32 device scalar, bias an
    (N,) vector of ``out_dtype`` (added to the float32 result before it is rounded)."""
    if not supported(a, b, out_dtype):
        raise ValueError(f"scaled_mm takes two non-empty 2-D CUDA matrices with matching inner dims and an "
                         f"(operand, output) dtype pair in {sorted((str(i), str(o)) for i, o in _PAIRS)}; got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype} -> {out_dtype}")
    if alpha.device != a.device or alpha.dtype != torch.float32 or alpha.numel() != 1:
        raise ValueError("alpha must be a float32 scalar on the operands' device")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.dtype != out_dtype or bias.device != a.device):
        raise ValueError(f"bias must be a ({b.shape[1]},) {out_dtype} vector on the operands' device; got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    return scaled_mm_unchecked(a, b, alpha, out_dtype, bias)


def scaled_mm_unchecked(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_mm for a caller that has checked ``supported(a, b, out_dtype)`` and made alpha a
    float32 scalar on a's device and bias an (N,) vector of out_dtype there itself (emulated_mm)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    bb, op_b, ld_b = _operand(b)
    aa, op_a, ld_a = _operand(a)
    if bias is not None:
        bias = bias.contiguous()
    aligns = (_alignment(aa.data_ptr()), _alignment(bb.data_ptr()), _alignment(out.data_ptr()))
    key = (a.device.index, a.dtype, out_dtype, m, n, k, op_a, ld_a, op_b, ld_b, aligns,
           None if bias is None else _alignment(bias.data_ptr()))
    plans = _plans()
    with made_current(a):  # the handle, the stream and the call all on the operands' device
        lib = _library()
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _Plan(a.device, a.dtype, out_dtype, m, n, k, op_a, ld_a, op_b, ld_b, bias, aligns)
            while len(plans) > _MAX_PLANS:
                plans.popitem(last=False)[1].destroy()
        else:
            plans.move_to_end(key)
            if bias is not None:
                plan.set_bias(bias)
        workspace = torch.empty(plan.workspace, dtype=torch.uint8, device=a.device) if plan.workspace else None
        beta = _constant(a.device, 0.0)
        _checked(lib.cublasLtMatmul(_handle(a.device), plan.desc, alpha.data_ptr(), bb.data_ptr(), plan.layout_b,
                                    aa.data_ptr(), plan.layout_a, beta.data_ptr(), out.data_ptr(), plan.layout_out,
                                    out.data_ptr(), plan.layout_out, ctypes.byref(plan.algo),
                                    None if workspace is None else workspace.data_ptr(), plan.workspace,
                                    _current_stream(a.device.index)), "cublasLtMatmul")
    return out
