"""The quantized hot paths never make the host wait for the GPU: a synchronous host-to-device copy
(``torch.tensor(value, device="cuda")``) or a read of a device value stalls the CPU until every queued
kernel has run, and the GPU then idles while the next ones are launched. Each path runs once to build
its kernels and constants, then again under CUDA's sync check, which raises on any such wait."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def twice(step) -> None:
    step()  # kernels compiled, constants copied to the device
    with no_host_sync():
        step()


@pytest.mark.parametrize("quant", [{"format": "nvfp4", "four_over_six": "mse"},  # production's
                                   {"format": "nvfp4"}, {"format": "fp8"}])
def test_a_quantized_kv_cache_writes_and_reads_without_a_host_sync_on_the_gpu(quant):
    from longlive_core.infer.kv_cache import KVCache
    from longlive_core.infer.kv_quant import KVQuantConfig

    torch.manual_seed(0)
    cache = KVCache(2, 16, window=6, quant=KVQuantConfig(**quant))

    def chunk() -> None:  # a write pass of 2 frames over both layers: each reads the window, then appends
        with cache.write(2):
            for layer in range(2):
                q, k, v = (torch.randn(1, 4, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                cache.for_layer(layer)(q, k, v, None)

    chunk()
    twice(chunk)


def test_the_nvfp4_training_linear_runs_forward_and_backward_without_a_host_sync_on_the_gpu():
    from longlive_core.quant import RECIPES, NVFP4Linear

    torch.manual_seed(0)
    layer = NVFP4Linear.from_linear(nn.Linear(256, 128).cuda().bfloat16(), RECIPES["nvfp4"])
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    twice(lambda: layer(x).float().square().sum().backward())


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4-4over6"])
def test_the_packed_w4a4_linear_runs_forward_and_backward_without_a_host_sync_on_the_gpu(recipe):
    from longlive_core.quant import RECIPES
    from longlive_core.quant.packed import PackedNVFP4Linear

    torch.manual_seed(0)
    rtn = dataclasses.replace(RECIPES[recipe], grad_stochastic=False)
    layer = PackedNVFP4Linear.from_linear(nn.Linear(256, 128).cuda().bfloat16(), rtn)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    twice(lambda: layer(x).float().square().sum().backward())
    with torch.no_grad():  # the operator a compiled inference graph calls
        twice(lambda: torch.ops.longlive.packed_nvfp4_linear(
            x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias,
            rtn.four_over_six, rtn.backend, None))


def test_the_fp8_linear_runs_without_a_host_sync_on_the_gpu():
    from longlive_core.quant.fp8 import FP8Linear

    torch.manual_seed(0)
    layer = FP8Linear.from_linear(nn.Linear(256, 128).cuda().bfloat16())
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        twice(lambda: layer(x))
