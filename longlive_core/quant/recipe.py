"""Recipes by name, and converting a model's ``nn.Linear`` layers to one.

``convert_linears(model, "nvfp4", skip=..., keep_last_blocks=k)`` swaps each eligible
``nn.Linear`` for an :class:`~longlive_core.quant.linear.NVFP4Linear` that shares its parameters
(state-dict keys unchanged). A layer stays as it is when its name matches a ``skip`` glob
(embeddings, patch embedding, head: the paper keeps these in BF16), when it is in the last
``keep_last_blocks`` entries of the ``blocks_attr`` ModuleList, or when its dimensions are not
multiples of 16. The report says which layers were converted and why the others were not.
Recipe ``bf16`` converts nothing. ``convert_linears_fp8`` applies the same rules for FP8 W8A8
inference layers (``quant/fp8.py``), which are not a training recipe.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging

from torch import nn

from longlive_core.quant.config import DEFAULT_SKIP, NVFP4_RECIPE_NAMES, RECIPE_NAMES
from longlive_core.quant.linear import NVFP4Linear, NVFP4Recipe
from longlive_core.quant.packed import PackedNVFP4Linear

log = logging.getLogger(__name__)

RECIPES: dict[str, NVFP4Recipe | None] = {
    "bf16": None,
    "nvfp4": NVFP4Recipe(),
    "nvfp4-4over6": NVFP4Recipe(four_over_six="mse"),
}
assert tuple(RECIPES) == RECIPE_NAMES and tuple(k for k, v in RECIPES.items() if v) == NVFP4_RECIPE_NAMES


@dataclasses.dataclass
class ConversionReport:
    recipe: str
    converted: list[str] = dataclasses.field(default_factory=list)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        return f"recipe {self.recipe}: {len(self.converted)} linear layers converted, {len(self.kept)} kept"


def _last_block_prefixes(model: nn.Module, blocks_attr: str, keep_last_blocks: int) -> tuple[str, ...]:
    if keep_last_blocks <= 0:
        return ()
    blocks = model.get_submodule(blocks_attr)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"keep_last_blocks needs model.{blocks_attr} to be an nn.ModuleList")
    n = len(blocks)
    return tuple(f"{blocks_attr}.{i}." for i in range(max(0, n - keep_last_blocks), n))


def convert_linears(model: nn.Module, recipe: str, skip: tuple[str, ...] = DEFAULT_SKIP,
                    keep_last_blocks: int = 0, blocks_attr: str = "blocks",
                    overrides: dict | None = None, packed: bool = False) -> ConversionReport:
    """Converts ``model`` in place under ``recipe`` (a key of RECIPES); ``overrides`` replaces
    fields of the recipe (e.g. ``{"backend": "torch"}``). ``packed``: frozen layers held as NVFP4
    codes and scales with no master weight (:class:`~longlive_core.quant.packed.PackedNVFP4Linear`),
    for distillation's backbone and the W4A4 model."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown quantization recipe {recipe!r}; known: {', '.join(RECIPES)}")
    report = ConversionReport(recipe)
    config = RECIPES[recipe]
    if config is None:
        return report
    if overrides:
        config = dataclasses.replace(config, **overrides)
    layer = PackedNVFP4Linear if packed else NVFP4Linear
    return _replace(model, report, eligible_linears(model, report, skip, keep_last_blocks, blocks_attr),
                    lambda linear: layer.from_linear(linear, config))


def convert_linears_fp8(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, keep_last_blocks: int = 0,
                        blocks_attr: str = "blocks") -> ConversionReport:
    """The eligible linears (``convert_linears``' rules) as frozen FP8 W8A8 layers, for inference."""
    from longlive_core.quant.fp8 import FP8Linear

    report = ConversionReport("fp8")
    return _replace(model, report, eligible_linears(model, report, skip, keep_last_blocks, blocks_attr),
                    FP8Linear.from_linear)


def _replace(model: nn.Module, report: ConversionReport, targets: list[str], make) -> ConversionReport:
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))
        report.converted.append(name)
    log.info(report.summary())
    return report


def eligible_linears(model: nn.Module, report: ConversionReport, skip: tuple[str, ...], keep_last_blocks: int,
                     blocks_attr: str) -> list[str]:
    """The names of the ``nn.Linear`` layers to convert; the others go into ``report.kept`` with why."""
    last = _last_block_prefixes(model, blocks_attr, keep_last_blocks)
    targets = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in skip):
            report.kept[name] = "skip list"
        elif (name + ".").startswith(last) and last:
            report.kept[name] = f"one of the last {keep_last_blocks} blocks"
        elif module.in_features % 16 or module.out_features % 16:
            report.kept[name] = f"shape {module.out_features}x{module.in_features} is not a multiple of 16"
        else:
            targets.append(name)
    return targets


def set_forward_high_precision(model: nn.Module, on: bool) -> int:
    """Switches every converted layer's forward GEMM to the input's precision (``on``) or back to
    NVFP4; dgrad and wgrad stay NVFP4 either way. Returns how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    for layer in layers:
        layer.recipe = dataclasses.replace(layer.recipe, forward_high_precision=on)
    return len(layers)


def set_amax_group(model: nn.Module, group) -> int:
    """Every converted layer max-reduces its tensor-wide amaxes over ``group`` (the ranks that split
    the sequence), so their round-to-nearest results equal one rank's; None: local amaxes. Returns
    how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, (NVFP4Linear, PackedNVFP4Linear))]
    for layer in layers:
        layer.amax_group = group
    return len(layers)
