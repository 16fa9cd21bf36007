"""NVFP4 quantization: bit-exact against hand-worked vectors and an independent scalar reference
of the published formulas (REFERENCE.md §3), RHT, stochastic rounding and Four-Over-Six."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from longlive_core.quant import quantize_nvfp4
from longlive_core.quant.hadamard import hadamard16, inverse_rht, rht, rht_matrix
from longlive_core.quant.nvfp4 import E2M1_VALUES, decode_e2m1, unpack_codes

F32 = np.float32


# ---- an independent scalar reference: numpy float32 arithmetic, Python rounding ----------------
def e4m3_ref(v: float) -> float:
    """Nearest E4M3 value to 0 <= v <= 448, ties to even (3 mantissa bits, subnormals below 2^-6)."""
    if v == 0:
        return 0.0
    exp = max(math.frexp(v)[1] - 1, -6)
    step = 2.0 ** (exp - 3)
    return round(v / step) * step  # round(): ties to even


def e2m1_ref(v: float) -> int:
    mags = E2M1_VALUES
    a = abs(v)
    best = min(range(8), key=lambda i: (abs(mags[i] - a), i % 2))  # a tie goes to the even code
    return best | (8 if v < 0 else 0)


def reference(x: np.ndarray, tile_rows: int = 1) -> tuple[np.ndarray, np.ndarray, float]:
    """(codes (M, K), scales (M, K//16) as float, amax) from the formulas, element by element."""
    x = x.astype(F32)
    m, k = x.shape
    amax = F32(np.abs(x).max())
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(F32(448 * 6) / amax)
    if amax == 0 or s_enc == 0:
        s_enc = F32(1)
    s_enc = F32(min(s_enc, np.finfo(F32).max))
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, k // 16))
    for i in range(m):
        r0 = i - i % tile_rows
        for b in range(k // 16):
            bamax = F32(np.abs(x[r0:r0 + tile_rows, b * 16:(b + 1) * 16]).max())
            t = F32(bamax * F32(s_enc * F32(1 / 6)))
            s_dec = e4m3_ref(float(min(t, F32(448))))
            with np.errstate(divide="ignore"):
                enc = F32(F32(1) / F32(F32(s_dec) * F32(F32(1) / s_enc)))
            enc = F32(min(enc, np.finfo(F32).max))
            scales[i, b] = s_dec
            for j in range(b * 16, (b + 1) * 16):
                with np.errstate(over="ignore"):
                    v = F32(np.clip(F32(x[i, j] * enc), -6, 6))
                codes[i, j] = e2m1_ref(float(v))
    return codes, scales, float(amax)


def check_against_reference(x: torch.Tensor, tile=(1, 16)) -> None:
    q = quantize_nvfp4(x, tile=tile, backend="torch")
    codes, scales, amax = reference(x.float().numpy(), tile[0])
    assert np.array_equal(unpack_codes(q.codes).numpy(), codes)
    assert np.array_equal(q.scales.float().numpy(), scales)
    assert q.amax.item() == amax and q.amax.dtype == torch.float32
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float8_e4m3fn


# ---- hand-worked ---------------------------------------------------------------------------
def test_hand_worked_block():
    # global amax 2688 = 448 * 6 makes S_enc = 1; a block whose amax is 6 then gets S_dec = 1, so its
    # codes are plain E2M1 roundings of the values, ties to even.
    row0 = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.1, -0.0, 0.3, 2.9, -5.5, 4.2, 1.0]
    row1 = [2688.0] + [0.0] * 15
    q = quantize_nvfp4(torch.tensor([row0, row1]), backend="torch")
    assert q.amax.item() == 2688.0
    assert q.scales.float().tolist() == [[1.0], [448.0]]
    codes = unpack_codes(q.codes).tolist()
    assert codes[0] == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 0, 1, 5, 15, 6, 2]
    assert codes[1] == [7] + [0] * 15
    assert q.codes[0, :2].tolist() == [0 | 2 << 4, 2 | 4 << 4]  # element 2i low nibble, 2i+1 high
    assert q.dequantize()[1, 0].item() == 2688.0


def test_all_zero_and_underflowing_blocks():
    q = quantize_nvfp4(torch.zeros(16, 32), backend="torch")
    assert q.amax.item() == 0 and (q.codes == 0).all() and (q.scales.float() == 0).all()
    assert (q.dequantize() == 0).all()
    # a block far below the global amax gets S_dec = 0; the formulas then give enc = FLT_MAX, so its
    # non-zero values saturate to +-6 and dequantize to 0
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16], x[0, 17] = 1e30, 1e-12, -1e-12
    check_against_reference(x)
    q = quantize_nvfp4(x, backend="torch")
    assert q.scales.float()[0, 1] == 0 and unpack_codes(q.codes)[0, 16:18].tolist() == [7, 15]
    assert (q.dequantize()[0, 16:] == 0).all()


# ---- against the scalar reference ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_matches_the_reference_of_the_formulas(dtype, tile):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g) * torch.exp(torch.randn(32, 64, generator=g) * 3)
    x[5, 7] = 3e4  # one huge outlier
    x[9, 16:32] = torch.linspace(-2e-6, 2e-6, 16)  # near underflow
    x[10, :16] = -torch.rand(16, generator=g) * 1e-3  # negatives that round to zero
    check_against_reference(x.to(dtype), tile)


def test_16x16_tiles_share_one_scale_per_tile():
    x = torch.randn(32, 48)
    q = quantize_nvfp4(x, tile=(16, 16), backend="torch")
    s = q.scales.float()
    assert (s[:16] == s[0]).all() and (s[16:] == s[16]).all()
    # the same numbers come out of the transposed copy: row- and column-wise agree
    qt = quantize_nvfp4(x.t().contiguous(), tile=(16, 16), backend="torch")
    assert torch.equal(qt.dequantize().t(), q.dequantize())


def test_bad_inputs_are_refused():
    for bad, match in ((torch.randn(4, 20), "multiple of 16"), (torch.randn(4, 16, 2), "2-D"),
                       (torch.randn(4, 16, dtype=torch.float16), "float32 or bfloat16")):
        with pytest.raises(ValueError, match=match):
            quantize_nvfp4(bad, backend="torch")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(8, 16), tile=(16, 16), backend="torch")


# ---- RHT -----------------------------------------------------------------------------------
def test_rht_is_orthogonal_and_matches_the_matrix():
    h = hadamard16()
    assert torch.equal(h @ h.t(), 16 * torch.eye(16, dtype=torch.float64))
    m = rht_matrix()
    assert torch.allclose(m @ m.t(), torch.eye(16, dtype=torch.float64), atol=0)
    x = torch.randn(8, 64)
    want = (x.double().view(8, 4, 16) @ m).view(8, 64)
    assert torch.allclose(rht(x).double(), want, rtol=0, atol=1e-6)
    assert torch.allclose(inverse_rht(rht(x)), x, atol=1e-6)
    xb = x.bfloat16()
    assert rht(xb).dtype == torch.bfloat16
    want_b = (xb.double().view(8, 4, 16) @ m).view(8, 64)
    assert ((rht(xb).double() - want_b).abs() <= want_b.abs() * 2**-8).all()  # one bf16 rounding


def test_rht_quantization_takes_amax_after_the_transform():
    x = torch.zeros(4, 32)
    x[0, 3] = 8.0  # an isolated outlier spreads over its block: amax 8 -> 2
    q = quantize_nvfp4(x, rht=True, backend="torch")
    assert q.amax.item() == 2.0 and q.rht
    assert torch.allclose(q.dequantize(inverse_rht=True), x, atol=1e-6)
    check_against_reference(rht(x))  # the same numbers as quantizing the transformed tensor
    assert torch.equal(q.codes, quantize_nvfp4(rht(x), backend="torch").codes)


# ---- stochastic rounding ---------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_and_reproducible():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g)
    draws = torch.stack([quantize_nvfp4(x, stochastic=True, generator=g, backend="torch").dequantize()
                         for _ in range(400)])
    nearest = quantize_nvfp4(x, backend="torch").dequantize()
    rmse_mean = (draws.mean(0) - x).square().mean().sqrt()
    rmse_rne = (nearest - x).square().mean().sqrt()
    assert rmse_mean < rmse_rne / 5  # the mean converges on x; nearest rounding's bias does not go away
    assert (draws.mean(0) - x).mean().abs() < 2e-3
    # TE's own criterion: the mean of 50 draws beats round-to-nearest
    assert (draws[:50].mean(0) - x).square().mean().sqrt() < rmse_rne
    a = quantize_nvfp4(x, stochastic=True, generator=torch.Generator().manual_seed(7), backend="torch")
    b = quantize_nvfp4(x, stochastic=True, generator=torch.Generator().manual_seed(7), backend="torch")
    assert torch.equal(a.codes, b.codes)
    # every element takes one of two neighbouring values (a block's amax can sit just outside them:
    # when its E4M3 scale rounds down the scaled amax exceeds 6 and is clamped)
    lo, hi = draws.min(0).values, draws.max(0).values
    assert ((draws == lo) | (draws == hi)).all() and (hi > lo).any()


# ---- Four-Over-Six ---------------------------------------------------------------------------
def block_errors(q, x):
    d = (q.dequantize() - x).view(x.shape[0], -1, 16)
    return d.square().sum(-1)


@pytest.mark.parametrize("kind", ["mse", "mae"])
def test_four_over_six_never_worse_per_block(kind):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    q = quantize_nvfp4(x, four_over_six=kind, backend="torch")
    assert q.scale_max == 256.0
    # each block's own "6" candidate under the same 256-based global scale
    from longlive_core.quant.nvfp4 import _encode, e2m1_rne, global_encode_scale, pack_codes
    xb = x.view(64, 8, 16)
    s_enc = global_encode_scale(q.amax, 256.0)
    s6, v6 = _encode(xb, xb.abs().amax(-1), s_enc, 1.0)
    six = type(q)(codes=pack_codes(e2m1_rne(v6).view(64, 128)), scales=s6, amax=q.amax, shape=(64, 128),
                  scale_max=256.0)
    d_q, d_6 = (q.dequantize() - x).view(64, 8, 16), (six.dequantize() - x).view(64, 8, 16)
    err = (lambda d: d.square().sum(-1)) if kind == "mse" else (lambda d: d.abs().sum(-1))
    assert (err(d_q) <= err(d_6) * (1 + 1e-6)).all()
    assert (q.scales.float() != s6.float()).any()  # some blocks did pick "4"


def test_four_over_six_beats_plain_nvfp4_on_data_with_outliers():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 256, generator=g)
    x[torch.rand(256, 256, generator=g) < 0.01] *= 30
    plain = (quantize_nvfp4(x, backend="torch").dequantize() - x).square().mean()
    fos = (quantize_nvfp4(x, four_over_six="mse", backend="torch").dequantize() - x).square().mean()
    assert fos < plain * 0.95, (fos, plain)


def test_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    assert decode_e2m1(codes).tolist() == [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]


def test_a_device_constant_is_made_once_and_serves_autograd_whatever_mode_asked_first():
    from longlive_core.quant.constants import device_constant

    values = (0.25, -0.5, 4.0)
    with torch.inference_mode():  # e.g. a video generated before a training step in one process
        first = device_constant(values, torch.device("cpu"))
    assert not first.is_inference() and first.tolist() == list(values)
    assert device_constant(values, "cpu") is first  # the host copies it once
    x = torch.ones(3, requires_grad=True)
    (x * first).sum().backward()  # autograd saves it for the backward
    assert x.grad.tolist() == list(values)
    assert device_constant(values, "cpu", torch.float64).dtype == torch.float64


def test_a_device_constant_first_asked_for_under_compile_in_a_checkpointed_region_is_not_cached():
    """Dynamo refuses a tensor made inside a checkpointed region that a side effect (the cache) keeps:
    a compiled NVFP4 block whose first quantize ran under the trace failed to compile (on the CPU, where
    the torch quantizer reads the E2M1 table), and passed only after an eager step had filled the cache."""
    import torch.utils.checkpoint as checkpoint

    from longlive_core.quant import constants

    values = (0.5, 1.75, -3.0)  # a table no other test asks for

    def scaled(x):
        return x * constants.device_constant(values, x.device).sum()

    x = torch.randn(4, requires_grad=True)
    step = torch.compile(lambda x: checkpoint.checkpoint(scaled, x, use_reentrant=False), backend="eager",
                         fullgraph=True)
    step(x).sum().backward()
    assert x.grad.tolist() == [-0.75] * 4
    assert not any(key[0] == values for key in constants._CONSTANTS)  # the trace's own constant, not kept
    assert constants.device_constant(values, x.device).tolist() == list(values)  # eager: made and kept
    assert any(key[0] == values for key in constants._CONSTANTS)
