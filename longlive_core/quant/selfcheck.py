"""Checks that the Triton kernels compute what the torch reference does, on this machine's GPU.

    python -m longlive_core.quant.selfcheck [--part rows slices blocks gemm rht launch]   # raises on any mismatch

Round-to-nearest results must be bit-identical (codes, scales, amax, the GEMM's partial operands);
stochastic rounding must be reproducible from a generator and unbiased. Run as a module (and in
the GPU tests) every launch also checks that the cached launch (:mod:`.triton_launch`) runs the
kernel Triton itself would pick. The tests run the same checks on the CPU under Triton's
interpreter (where launches are Triton's own), and on a GPU where there is one.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from longlive_core.quant import cublas, triton_kernels, triton_launch
from longlive_core.quant.gemm import emulated_mm, operand_amaxes, quantize_partial
from longlive_core.quant.linear import NVFP4Linear, NVFP4Recipe
from longlive_core.quant.nvfp4 import quantize_torch, unpack_codes

CONFIGS = [(dtype, tile, rht, fos) for dtype in (torch.float32, torch.bfloat16) for tile in ((1, 16), (16, 16))
           for rht in (False, True) for fos in (None, "mse", "mae")]
# Under the CPU interpreter (about 2 s a configuration and kernel) each tile, RHT and block-scale choice once, in
# the input dtype their indices' parity picks: every pair of choices still meets (the dtype only changes the
# kernel's load); the GPU checks all of CONFIGS
INTERPRETER_CONFIGS = [(dtype, tile, rht, fos) for dtype, tile, rht, fos in CONFIGS
                       if (dtype == torch.bfloat16) == bool((((1, 16), (16, 16)).index(tile) + rht
                                                             + (None, "mse", "mae").index(fos)) % 2)]


def same_bits(a, b) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
            and torch.equal(a.amax.cpu(), b.amax.cpu()))


def check_kernels(device: str, m: int = 48, k: int = 160, kernels: tuple[str, ...] = triton_kernels.KERNELS) -> None:
    """Every kernel (row tiles, slices, register blocks) wherever it applies."""
    tiles = {use: dict(t) for use, t in triton_kernels.BLOCK_TILES.items()}
    amax_tile = dict(triton_kernels.AMAX_TILE)
    if triton_kernels.INTERPRETING:  # the CPU interpreter runs every lane of a tile: keep tiles small there
        for t in triton_kernels.BLOCK_TILES.values():
            t.update(BM=32, G=8)  # few programs; both axes still end mid-tile
        triton_kernels.AMAX_TILE.update(BLOCK_SIZE=256, ITERS=2)
    try:
        for kernel in kernels:
            triton_kernels.FORCE_KERNEL = kernel
            check_configs(device, m, k)
    finally:
        triton_kernels.FORCE_KERNEL = None
        for use, t in tiles.items():
            triton_kernels.BLOCK_TILES[use].update(t)
        triton_kernels.AMAX_TILE.update(amax_tile)


def check_configs(device: str, m: int, k: int) -> None:
    """Every configuration, bit for bit, on inputs with outliers, underflow and odd tile counts."""
    g = torch.Generator().manual_seed(0)
    for dtype, tile, rht, fos in INTERPRETER_CONFIGS if triton_kernels.INTERPRETING else CONFIGS:
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2)
        x[1, 3], x[7, 16:32] = 5e4, torch.linspace(-3e-7, 3e-7, 16)
        x[9, 32:48] = torch.linspace(-2e-39, 2e-39, 16)  # subnormal in float32 and bfloat16
        x = x.to(dtype).to(device)
        ref = quantize_torch(x, tile, rht, False, fos)
        got = triton_kernels.quantize(x, tile, rht, False, fos)
        assert same_bits(ref, got), (dtype, tile, rht, fos)
        # a transposed view is quantized along its other axis without a copy, to the same bits
        xt = x.t().contiguous().t()
        assert same_bits(quantize_torch(xt.contiguous(), tile, rht, False, fos),
                         triton_kernels.quantize(xt, tile, rht, False, fos)), ("strided", dtype, tile, rht, fos)
        if fos is not None and triton_kernels.FORCE_KERNEL in (None, "rows"):
            # global amaxes so small that dequantized values fall below float32's normal range (the 4/6 error
            # sums round there), the second one clamping S_enc at FLT_MAX
            for tiny in (1e-33, 1e-37):
                xs = (x.float() * (tiny / x.float().abs().amax())).to(dtype)
                assert same_bits(quantize_torch(xs, tile, rht, False, fos), triton_kernels.quantize(
                    xs, tile, rht, False, fos)), ("tiny", tiny, dtype, tile, rht, fos)
        if fos is None and tile == (1, 16) and not rht:  # both amaxes of a tensor and of its transpose in one pass
            for view in (x, x.t()):
                got = triton_kernels.amaxes(view)
                assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(operand_amaxes(view, "torch"), got)), dtype
        if fos is None:
            pr, dr = quantize_partial(x, tile, rht, backend="torch")
            pt, dt = quantize_partial(x, tile, rht, backend="triton")
            assert torch.equal(pr, pt) and torch.equal(dr, dt), ("partial", dtype, tile, rht)
            pt2, _ = quantize_partial(x.t(), tile if tile == (1, 16) else (16, 16), rht, backend="triton")
            assert pt2.stride() == x.t().stride()  # written in the input's own layout
            assert torch.equal(pt2, quantize_partial(x.t().contiguous(), tile, rht, backend="torch")[0])
            if tile == (1, 16):  # another operand's decode scale multiplied in by the kernel: the torch bits
                times = torch.tensor(0.7, device=device)
                for view in (x, x.t()):
                    alpha = quantize_partial(view, tile, rht, backend="triton", times=times)[1]
                    want = quantize_partial(view.contiguous(), tile, rht, backend="torch")[1] * times
                    assert torch.equal(alpha, want), ("times", dtype, rht)
    # stochastic rounding: reproducible from a generator, unbiased, on the two neighbouring values
    x = torch.randn(*((16, 32) if triton_kernels.INTERPRETING else (32, 64)), generator=g).to(device)
    a = triton_kernels.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(5))
    b = triton_kernels.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.codes, b.codes)
    a, b = (triton_kernels.quantize(x, stochastic=True, generator=g) for _ in range(2))
    assert not torch.equal(a.codes, b.codes)  # each call draws anew from the generator
    # 200 draws in one call (the interpreter's launches cost more than its elements): repeated rows keep x's amax and
    # block scales, and every element draws its own bits
    draws = triton_kernels.quantize(x.repeat(200, 1), stochastic=True, generator=g).dequantize().view(200, *x.shape)
    rne = quantize_torch(x).dequantize()
    rmse = lambda d: (d - x).square().mean().sqrt()  # noqa: E731
    assert rmse(draws.mean(0)) < rmse(rne) / 4
    assert rmse(draws[:50].mean(0)) < rmse(rne)
    if device == "cuda":  # a generator on the GPU seeds the kernel too
        triton_kernels.quantize(x, stochastic=True, generator=torch.Generator(device).manual_seed(5))
        check_sr_in_cuda_graph(x)
    check_edge_inputs(device)
    check_ties(device)


def check_rht_paths(device: str, m: int = 1024, k: int = 4096) -> None:
    """The RHT paths of the slice and block kernels alone, at a real size (a quick check after a
    change to the transform): codes, strided codes, transposed partials and the one-pass amaxes."""
    g = torch.Generator().manual_seed(1)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2)).to(dtype).to(device)
            xt = x.t().contiguous().t()
            for kernel in ("blocks", "slices"):
                triton_kernels.FORCE_KERNEL = kernel
                assert same_bits(quantize_torch(x, rht=True), triton_kernels.quantize(x, rht=True)), (dtype, kernel)
                assert same_bits(quantize_torch(xt.contiguous(), rht=True), triton_kernels.quantize(xt, rht=True))
                assert torch.equal(quantize_partial(x.t(), rht=True, backend="triton")[0],
                                   quantize_partial(x.t().contiguous(), rht=True, backend="torch")[0]), (dtype, kernel)
            for view in (x, x.t()):
                assert all(torch.equal(a.cpu(), b.cpu()) for a, b in
                           zip(operand_amaxes(view, "torch"), triton_kernels.amaxes(view))), dtype
    finally:
        triton_kernels.FORCE_KERNEL = None


def check_sr_in_cuda_graph(x: torch.Tensor) -> None:
    """The seed is drawn on the device, so a captured stochastic quantize draws anew on each replay."""
    triton_kernels.quantize_partial(x, stochastic=True)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        part, _ = triton_kernels.quantize_partial(x, stochastic=True)
    graph.replay()
    first = part.clone()
    graph.replay()
    assert not torch.equal(first, part), "a CUDA graph replay reused the stochastic-rounding draws"


def check_ties(device: str) -> None:
    """Codes of values on and around E2M1's rounding ties, hand-worked and then dense: a global amax
    of 5.25 gives S_enc = 512, and blocks whose amax is 3 then get enc = 2 exactly, so an element
    x becomes y = 2x. A block of ties (and -0.0) must give the codes worked out by hand, and a dense
    sweep of float32 y in [0, 6] (every 64th bit pattern on a GPU, every 65536th under the
    interpreter, plus 64 on each side of every tie) the torch path's codes."""
    ties = torch.tensor([3, .125, .375, .625, .875, 1.25, 1.75, 2.5, -.125, -.375, -.625, -2.5, 0, -0., .0625, 2.75])
    want = torch.tensor([7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 14, 0, 0, 0, 7], dtype=torch.uint8)
    x = torch.zeros(16, 32)
    x[0, 16], x[1, :16], x[2, :16] = 5.25, ties, -ties
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(device)
        ref = quantize_torch(xd)
        assert torch.equal(unpack_codes(ref.codes[1, :8].cpu()), want), "hand-worked ties"
        assert same_bits(ref, triton_kernels.quantize(xd)), ("ties", dtype)
    stride = 1 << (16 if triton_kernels.INTERPRETING else 6)
    top = torch.tensor(6.0).view(torch.int32).item()
    bits = [torch.arange(0, top + 1, stride, dtype=torch.int32)]
    for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        b = torch.tensor(tie).view(torch.int32).item()
        bits.append(torch.arange(b - 64, b + 65, dtype=torch.int32))
    y = torch.cat(bits).view(torch.float32)
    y = torch.cat([y, y.new_zeros(-y.numel() % 150)]).view(-1, 10, 15)
    blocks = torch.cat([torch.full((y.shape[0], 10, 1), 3.0), y / 2], dim=2)  # each block's amax is 3
    x = torch.cat([blocks.view(-1, 160), torch.full((1, 160), 5.25)]).to(device)  # the global amax
    assert same_bits(quantize_torch(x), triton_kernels.quantize(x)), "dense sweep around the ties"


def check_edge_inputs(device: str) -> None:
    """No rows: empty outputs as on the torch path; a wrong shape: the same message as there."""
    empty = torch.zeros(0, 32, device=device)
    assert same_bits(quantize_torch(empty), triton_kernels.quantize(empty))
    part, dec = triton_kernels.quantize_partial(empty)
    ref_part, ref_dec = quantize_partial(empty, backend="torch")
    assert part.shape == ref_part.shape and torch.equal(dec.cpu(), ref_dec.cpu())
    amax = torch.tensor(3.0)  # a given amax decides the decode scale even of an empty tensor
    assert torch.equal(triton_kernels.quantize_partial(empty, amax=amax)[1].cpu(),
                       quantize_partial(empty, backend="torch", amax=amax)[1].cpu())
    times = torch.tensor(0.7, device=device)  # and the product with another operand's decode scale
    assert torch.equal(triton_kernels.quantize_partial(empty, amax=amax, times=times)[1].cpu(),
                       quantize_partial(empty, backend="torch", amax=amax, times=times)[1].cpu())
    # a tensor of subnormals only: its encode scale saturates at FLT_MAX on both paths
    for dtype in (torch.float32, torch.bfloat16):
        tiny = (torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1e-39).to(dtype).to(device)
        for rht in (False, True):
            got = triton_kernels.quantize(tiny, rht=rht)
            assert same_bits(quantize_torch(tiny, rht=rht), got), ("subnormal", dtype, rht)
    # signed zeros: a negative x whose product x * enc underflows gets code 0, as -0.0 does (y < 0 is
    # false for both); a huge amax makes enc tiny (the block kernel's path for small S_enc), a plain one
    # leaves -0.0 inputs and the RHT's zeros to its other path
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(4, 32)
        x[0, 0], x[0, 1], x[0, 2] = 2.0**126, 2.0**126, 2.0**-100  # after the RHT: -2^-102 beside 2^125
        x[1, 0], x[1, 1:16] = 2.0**126, -(2.0**-100)
        small = torch.zeros(4, 32)
        small[0, 0], small[1, :16], small[2, 16:] = 1.0, -0.0, -torch.linspace(0, 1, 16)
        for rht in (False, True):
            for xd in (x.to(dtype).to(device), small.to(dtype).to(device)):
                assert same_bits(quantize_torch(xd, rht=rht), triton_kernels.quantize(xd, rht=rht)), (dtype, rht)
    # a NaN anywhere makes the amaxes and the decode scale NaN on both paths (it is not skipped),
    # also where it comes after a larger finite max (the amax passes skip atomics below the max)
    x = torch.randn(32, 64, device=device)
    x[5, 7] = float("nan")
    n = 128 if triton_kernels.INTERPRETING else 512  # several programs of each amax pass (small tiles there)
    late = torch.randn(n, n, device=device)
    late[0, :16], late[-1, -1] = 3e38, float("nan")
    for view in (x, x.t(), late, late.t()):
        assert all(a.isnan() for a in triton_kernels.amaxes(view)), "amaxes skipped a NaN"
        assert triton_kernels.global_amax(view, False).isnan() and triton_kernels.global_amax(view, True).isnan()
    for view in (x, x.t()):
        assert triton_kernels.quantize_partial(view)[1].isnan() and quantize_partial(view, backend="torch")[1].isnan()
    for bad in (torch.zeros(2, 3, 32, device=device), torch.zeros(4, 24, device=device)):
        for fn in (triton_kernels.quantize, triton_kernels.quantize_partial):
            try:
                fn(bad)
            except ValueError as exc:
                assert "quantize_nvfp4 takes a 2-D" in str(exc) or "multiple of 16" in str(exc), exc
            else:
                raise AssertionError(f"{fn.__name__} accepted shape {tuple(bad.shape)}")


def check_emulated_linear(device: str = "cuda", tokens: int = 400) -> None:
    """The NVFP4 linear layer gives the same bits with either quantizer backend, forward and (with
    round-to-nearest gradients) backward; 400 tokens = 25 token blocks, 398 pads the wgrad operands."""
    g = torch.Generator(device=device).manual_seed(0)
    lin = nn.Linear(256, 512).to(device)
    x = torch.randn(4, tokens // 4, 256, device=device, dtype=torch.bfloat16, generator=g)
    outs = [NVFP4Linear.from_linear(lin, NVFP4Recipe(backend=b))(x) for b in ("torch", "triton")]
    assert torch.equal(*outs)
    ref = torch.nn.functional.linear(x.float(), lin.weight, lin.bias)
    assert (outs[0].float() - ref).norm() / ref.norm() < 0.2
    for n in (tokens, tokens - 2):
        xs = x.reshape(-1, 256)[:n]
        gy = torch.randn(n, 512, device=device, dtype=torch.bfloat16, generator=g)
        grads = []
        for b in ("torch", "triton"):
            xi = xs.detach().clone().requires_grad_()
            recipe = NVFP4Recipe(backend=b, grad_stochastic=False)
            layer = NVFP4Linear.from_linear(nn.Linear(256, 512).to(device), recipe)
            layer.load_state_dict(lin.state_dict())
            layer(xi).backward(gy)
            grads.append((xi.grad, layer.weight.grad, layer.bias.grad))
        assert all(torch.equal(a, b) for a, b in zip(*grads)), n


def gemm_error_ratio(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
                     bias: torch.Tensor | None) -> float:
    """max |got - want| over what the device GEMM may differ by from want = the float32 product
    scaled afterwards (+ bias cast to got's dtype): one rounding to got's dtype plus float32
    accumulation in another order (K * 2^-23 * |a| @ |b| * alpha). At most 1 passes."""
    want = torch.mm(a.float(), b.float()) * alpha
    if bias is not None:
        want = want + bias.to(got.dtype).float()
    slack = (torch.finfo(got.dtype).eps * want.abs()
             + a.shape[1] * 2**-23 * torch.mm(a.float().abs(), b.float().abs()) * alpha.abs())
    return ((got.float() - want).abs() / slack.clamp_min(torch.finfo(torch.float32).tiny)).max().item()


def check_scaled_gemm(device: str = "cuda") -> None:
    """The GEMM with the decode scales as a device-side alpha (cuBLASLt on CUDA) against the float32
    product scaled afterwards: every layout the linear layer uses, with and without bias, bfloat16
    and float32 outputs, a slice whose leading dimension exceeds its width."""
    g = torch.Generator(device=device).manual_seed(0)
    a, a_dec = quantize_partial(torch.randn(200, 96, device=device, generator=g))
    b, b_dec = quantize_partial(torch.randn(96, 160, device=device, generator=g), (16, 16))
    da, db = torch.rand((), device=device, generator=g) + 0.5, torch.rand((), device=device, generator=g) + 0.5
    col = lambda t: t.t().contiguous().t()  # noqa: E731  the same matrix, column-major
    layouts = {"NN": (a, b), "TN": (col(a), b), "NT": (a, col(b)), "TT": (col(a), col(b)),
               "sliced": (torch.cat([a, a], 1)[:, :96], b)}
    for name, (aa, bb) in layouts.items():
        for bias, out_dtype in ((None, torch.bfloat16), (torch.randn(160, device=device, generator=g), torch.bfloat16),
                                (None, torch.float32), (torch.randn(160, device=device, generator=g), torch.float32)):
            got = emulated_mm(aa, da, bb, db, bias, out_dtype)
            assert got.dtype == out_dtype and got.shape == (200, 160) and got.is_contiguous(), name
            ratio = gemm_error_ratio(got, aa, bb, da * db, bias)
            assert ratio <= 1.0, (name, bias is not None, out_dtype, ratio)
    nan = torch.full((), float("nan"), device=device)
    assert emulated_mm(a, nan, b, db, None, torch.bfloat16).isnan().all()  # a NaN decode scale is not hidden
    # one row or column; a column-major slice whose leading dimension exceeds its rows; Python float
    # scales; an output dtype the device GEMM does not take (float16 from bfloat16: the float32 path;
    # with the real decode scales, so that the product fits float16)
    wide = col(torch.cat([a, a], 0))[:200]
    for aa, bb in ((a[:1], b), (a, b[:, :1]), (wide, b)):
        got = emulated_mm(aa, 0.75, bb, 1.5, None, torch.bfloat16)
        assert gemm_error_ratio(got, aa, bb, torch.tensor(0.75 * 1.5, device=device), None) <= 1.0, aa.shape
    # operands and a bias at addresses only 2-byte aligned: cuBLASLt plans per alignment
    odd_a = torch.cat([a, a], 1)[:, 1:97]
    odd_bias = torch.randn(161, device=device, generator=g).bfloat16()[1:]
    got = emulated_mm(odd_a, da, b, db, odd_bias, torch.bfloat16)
    assert odd_a.data_ptr() % 4 and odd_bias.data_ptr() % 4
    assert gemm_error_ratio(got, odd_a, b, da * db, odd_bias) <= 1.0
    for bad in (odd_bias.float(), odd_bias[:-1], odd_bias.cpu()):
        try:
            cublas.scaled_mm(a, b, da.float(), torch.bfloat16, bad)
        except ValueError:
            continue
        raise AssertionError(f"scaled_mm took a bad bias: {tuple(bad.shape)} {bad.dtype} {bad.device}")
    # past the plan cache's bound the least recently used plan is destroyed, and planned anew when needed
    bound, cublas._MAX_PLANS = cublas._MAX_PLANS, 2
    try:
        for rows in (5, 6, 7, 5):  # shapes not planned before: each plans, 5 again after its eviction
            got = emulated_mm(a[:rows], da, b, db, None, torch.bfloat16)
            assert gemm_error_ratio(got, a[:rows], b, da * db, None) <= 1.0 and len(cublas._plans()) <= 2, rows
    finally:
        cublas._MAX_PLANS = bound
    half = emulated_mm(a, a_dec, b, b_dec, None, torch.float16)
    assert half.dtype == torch.float16 and gemm_error_ratio(half, a, b, a_dec * b_dec, None) <= 1.0
    # torch's own GEMMs afterwards are as before: the device-alpha GEMM changes no state of torch's handles
    c = torch.randn(200, 160, device=device)
    want = torch.addmm(c, a.float(), b.float(), alpha=2.0, beta=0.5)
    emulated_mm(a, da, b, db, None, torch.bfloat16)
    assert torch.equal(torch.addmm(c, a.float(), b.float(), alpha=2.0, beta=0.5), want)


def check_cached_launch(device: str = "cuda") -> None:
    """The cached launch's key against Triton's specialization: for arguments that differ in what
    Triton specializes on (alignment and dtype of a pointer, an int equal to 1, divisible by 16 or
    past int32, a constexpr, a compile option) it picks the kernel Triton picks; and a launch on an
    unaligned view computes what torch does."""
    launcher = triton_kernels._absmax_launcher
    base = torch.randn(4096 + 8, device=device)
    out = torch.zeros(64, dtype=torch.int32, device=device)
    tile = dict(BLOCK_SIZE=256, ITERS=2, num_warps=4)
    variants = [((base, 4096, out), tile), ((base[1:], 4096, out), tile), ((base[4:], 4096, out), tile),
                ((base.bfloat16(), 4096, out), tile), ((base, 1, out), tile), ((base, 17, out), tile),
                ((base, 2**31 + 16, out), tile), ((base, 2**31 + 1, out), tile), ((base, 2**63 + 16, out), tile),
                ((base, 4096, out[1:]), tile), ((base, 4096, out), {**tile, "ITERS": 4}),
                ((base, 4096, out), {**tile, "num_warps": 8})]
    picked = []
    for args, kwargs in variants:
        ours = launcher.kernel_for(args, kwargs)[1][0]
        assert ours is launcher.tritons_pick(args, kwargs), (args[1:], kwargs)
        picked.append(ours)
    assert len({id(k) for k in picked}) > 1  # the variations do reach different kernels
    x = base[1:4001]  # unaligned, launched through the cache (second call: a hit)
    for _ in range(2):
        got = triton_kernels.global_amax(x, False)
        assert torch.equal(got, x.abs().amax()), (got, x.abs().amax())


def main() -> None:
    parts = (*triton_kernels.KERNELS, "gemm", "rht", "launch")
    ap = argparse.ArgumentParser(description="GPU checks of the NVFP4 kernels against the torch reference")
    ap.add_argument("--part", choices=parts, nargs="+", default=parts,
                    help="a subset: rht, gemm and launch take ~30 s; the kernel parts compile every row-tile variant")
    args = ap.parse_args()
    triton_launch.VERIFY = True
    kernels = tuple(k for k in args.part if k in triton_kernels.KERNELS)
    if kernels:
        check_kernels("cuda", kernels=kernels)
        check_kernels("cuda", m=1024, k=4096, kernels=kernels)
    if "rht" in args.part:
        check_rht_paths("cuda")
    if "gemm" in args.part:
        check_emulated_linear("cuda")
        check_scaled_gemm("cuda")
    if "launch" in args.part:
        check_cached_launch("cuda")
    print(f"NVFP4 selfcheck passed: {' '.join(args.part)}")


if __name__ == "__main__":
    main()
