"""Low-precision numerics: NVFP4 quantization (bit-exact), the emulated NVFP4 GEMM path for
training, model conversion by recipe name, and per-layer SQNR.

Public API (the training, distillation and merge code call these):

- ``quantize_nvfp4(x, tile=(1, 16), rht=False, stochastic=False, four_over_six=None,
  generator=None) -> NVFP4Tensor`` (``.codes``, ``.scales``, ``.amax``, ``.dequantize()``):
  :mod:`longlive_core.quant.nvfp4` documents the exact numerics.
- ``convert_linears(model, recipe, skip=DEFAULT_SKIP, keep_last_blocks=0) -> ConversionReport``:
  recipes ``bf16`` (nothing converted), ``nvfp4`` (TE's recipe: W 16x16 RNE, activations 1x16
  RNE, output gradients 1x16 stochastic, RHT on both wgrad inputs), ``nvfp4-4over6`` (the same
  with Four-Over-Six scales on the forward operands).
- ``NVFP4Linear``, ``NVFP4Recipe``: the converted layer and its settings.
- ``set_forward_high_precision(model, on)``: the precision schedule's switch (forward GEMMs in the
  input's precision, dgrad and wgrad NVFP4).
- ``set_amax_group(model, group)``: sequence parallelism's tensor-wide amaxes max-reduced over the
  ranks that split the tokens (round-to-nearest results then equal one rank's).
- ``record_sqnr(model)``: per-layer SQNR of weights, activations and output gradients.
- ``quantize_partial`` / ``emulated_mm``: the GEMM building blocks, for code that quantizes its own
  operands (attention, the W4A4 merge).

On CUDA the quantization runs in Triton kernels (``backend="triton"``, bit-identical to the torch
reference for round-to-nearest) and the GEMM is one cuBLASLt call per product; elsewhere both run in
eager PyTorch. Nothing in a layer's step waits for the GPU and the stochastic-rounding seed is
drawn on the device, so a training step with converted layers can be captured in a CUDA graph.
"""
import importlib

# name -> the module that defines it: imported when first asked for, so importing a light module of
# this package (``quant.config``, recipe names for params) does not pull in torch and Triton
_EXPORTS = {
    "emulated_mm": "gemm", "quantize_partial": "gemm", "NVFP4Linear": "linear", "NVFP4Recipe": "linear",
    "SQNRRecord": "numerics", "record_sqnr": "numerics", "NVFP4Tensor": "nvfp4", "quantize_nvfp4": "nvfp4",
    "DEFAULT_SKIP": "config", "RECIPES": "recipe", "ConversionReport": "recipe", "convert_linears": "recipe",
    "set_amax_group": "recipe", "set_forward_high_precision": "recipe",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
