"""The recipes' names and the default skip list, for params validation: nothing here imports torch."""
from __future__ import annotations

RECIPE_NAMES = ("bf16", "nvfp4", "nvfp4-4over6")  # quant.recipe.RECIPES holds each one's settings
NVFP4_RECIPE_NAMES = ("nvfp4", "nvfp4-4over6")
# the linear layers every recipe keeps in high precision (the paper keeps these in BF16)
DEFAULT_SKIP = ("*embed*", "*patch_embedding*", "*time_projection*", "*head*", "*norm*")
