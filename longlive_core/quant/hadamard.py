"""The 16-point random Hadamard transform (RHT) NVFP4 applies before quantizing for a wgrad GEMM.

Each 16-element block ``b`` along the last axis becomes ``b @ (diag(s) @ H16 / 4)``, where H16 is
the Sylvester Hadamard matrix and ``s`` Transformer Engine's fixed sign vector. The matrix is
orthogonal, so applying it to both inputs of a GEMM along the reduction axis leaves the product
unchanged while spreading outliers over their block.

The product is computed as a matmul computes it: every element is first multiplied by its sign
times 1/4 (exact, short of float32 subnormals), then a fast Walsh-Hadamard butterfly adds the
products in float32 (four stages of pairwise sums and differences, in a fixed order: H16's own
signs are its subtractions), and the result is rounded once to the input dtype. That is the
float32 accumulation the spec asks of the bfloat16 matmul, and because every output is a fixed
sequence of IEEE operations the Triton kernels reproduce it bit for bit.
"""
from __future__ import annotations

import torch

from longlive_core.quant.constants import device_constant

SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
BLOCK = 16
BUTTERFLY_STRIDES = (1, 2, 4, 8)


def hadamard16() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries +-1), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """diag(s) @ H16 / 4: what each 16-element block is multiplied by on the right."""
    signs = torch.tensor(SIGNS, dtype=torch.float64)
    return (signs[:, None] * hadamard16() / 4).to(dtype)


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """x @ H16 along the last axis (length a multiple of 16), by pairwise sums and differences."""
    shape = x.shape
    for h in BUTTERFLY_STRIDES:
        v = x.reshape(*shape[:-1], shape[-1] // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(shape)
    return x


def _signs(like: torch.Tensor) -> torch.Tensor:
    return device_constant(SIGNS, like.device)


def rht(x: torch.Tensor) -> torch.Tensor:
    """Applies the RHT to every 16-element block along the last axis; returns x's dtype."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the RHT works on blocks of {BLOCK} along the last axis; got length {x.shape[-1]}")
    xf = x.float().reshape(*x.shape[:-1], -1, BLOCK) * (_signs(x) * 0.25)
    return _butterfly(xf).reshape(x.shape).to(x.dtype)


def inverse_rht(y: torch.Tensor) -> torch.Tensor:
    """The inverse (the transpose: H16 @ diag(s) / 4), in float32 arithmetic; returns y's dtype."""
    yf = y.float().reshape(*y.shape[:-1], -1, BLOCK)
    return (_butterfly(yf) * 0.25 * _signs(y)).reshape(y.shape).to(y.dtype)
