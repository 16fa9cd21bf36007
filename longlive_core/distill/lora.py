"""LoRA adapters over the frozen DiT (peft), and merging one into the weights in high precision.

The generator and the fake score of distillation are two peft adapters on one frozen backbone; the
real score is the backbone with adapters off. ``merge_w4a4`` merges the generator's adapter into the
AR weights in float32 before it quantizes them.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

# the linear layers of every block that adapters attach to (not the embeddings, the time projection or the head)
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def lora_config(rank: int, alpha: float, dropout: float = 0.0):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS))


def merge_adapter(base: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """``base`` with the peft adapter saved in ``adapter_dir`` merged into its weights (in the base's
    own precision: give it float32 masters), adapters removed. Only safetensors adapters are read."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"{adapter_dir} holds no adapter_model.safetensors (a peft adapter saved with "
                                "safe_serialization): run distill_dmd first")
    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    return model.merge_and_unload()
