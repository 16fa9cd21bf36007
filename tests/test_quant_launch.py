"""CachedLaunch's key: what it tells apart (the GPU identity check against Triton's own pick is
selfcheck.check_cached_launch, run on the device) and what it asks of a call site."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from longlive_core.quant import triton_kernels  # noqa: E402
from longlive_core.quant.triton_launch import CachedLaunch, _token  # noqa: E402


def test_token_separates_what_triton_specializes_on():
    base = torch.zeros(64)
    assert _token(base) != _token(base[1:])  # 16-byte alignment
    assert _token(base) == _token(base[4:])
    assert _token(base) != _token(base.bfloat16())
    # one representative per class: 1, divisible by 16 or not, int32, int64, uint64 range
    classes = [[1], [2, 17, -3], [16, 2**31 - 16, -(2**31)], [2**31, -(2**31) - 16], [2**31 + 1], [2**63]]
    tokens = [{_token(i) for i in members} for members in classes]
    assert all(len(t) == 1 for t in tokens) and len(set.union(*tokens)) == len(classes)
    assert _token(True) != _token(1) and _token(2.0) == _token(3.5)
    with pytest.raises(TypeError, match="positionally"):
        _token("x")


def test_call_site_must_name_every_trailing_parameter():
    if triton_kernels.INTERPRETING:
        pytest.skip("under the interpreter CachedLaunch is fn[grid]")
    launcher = CachedLaunch(triton_kernels._absmax_kernel)
    assert launcher.compiled and launcher.params == ["x_ptr", "n", "word_ptr", "BLOCK_SIZE", "ITERS"]
    assert launcher._trailing(3, {"BLOCK_SIZE": 8, "ITERS": 2, "num_warps": 4}) == (8, 2)
    with pytest.raises(TypeError, match="ITERS"):
        launcher._trailing(3, {"BLOCK_SIZE": 8})
    with pytest.raises(TypeError, match="'BLOCK_SIZE' positionally"):  # its key would not see the value
        launcher._trailing(4, {"ITERS": 2})
