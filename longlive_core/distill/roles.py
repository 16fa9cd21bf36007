"""The three models of DMD distillation: the generator, the fake score (the critic) and the real score.

:class:`LoRARoles` (what ``distill_dmd`` runs): one frozen backbone, its linear layers held packed
in NVFP4 under an NVFP4 recipe (codes and scales, no master weight), with two peft LoRA adapters:
the generator's (named ``default``, so peft saves it at an adapter folder's root) and the fake
score's; the real score is the backbone with the adapters off. :class:`FullRoles`: three full
copies, the generator and the fake score trained whole, as self-forcing distils without adapters:
the baseline of the memory comparison. Both hand out the ``WanDiT`` a role runs as (FSDP shards
those modules) and keep every trainable parameter ``requires_grad`` throughout: a role's forward
touches only its own, and FSDP fixes at its first forward which parameters get gradients.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from longlive_core.distill.config import LoRASettings
from longlive_core.distill.lora import lora_config
from longlive_core.models.wan_dit import WanDiT
from longlive_core.quant.recipe import ConversionReport, convert_linears

GENERATOR, FAKE = "default", "fake"


class LoRARoles:
    def __init__(self, base: WanDiT, lora: LoRASettings, recipe: str, skip: tuple[str, ...],
                 keep_last_blocks: int = 0):
        from peft import get_peft_model

        base.requires_grad_(False)
        self.conversion: ConversionReport = convert_linears(base, recipe, skip=skip, keep_last_blocks=keep_last_blocks,
                                                            packed=True)
        self.lora_config = lora_config(lora.rank, lora.alpha, lora.dropout)
        self.peft = get_peft_model(base, self.lora_config, adapter_name=GENERATOR)
        self.peft.add_adapter(FAKE, self.lora_config)
        self.dit = base  # peft wrapped its layers in place
        self._trainable()

    @property
    def modules(self) -> list[WanDiT]:
        return [self.dit]

    @property
    def checkpointed(self) -> nn.Module:
        return self.dit

    def _adapter_params(self, name: str) -> list[nn.Parameter]:
        # looked up on each call: FSDP replaces the parameters with sharded ones
        return [p for n, p in self.dit.named_parameters() if "lora_" in n and f".{name}." in n]

    def generator_params(self) -> list[nn.Parameter]:
        return self._adapter_params(GENERATOR)

    def critic_params(self) -> list[nn.Parameter]:
        return self._adapter_params(FAKE)

    def _trainable(self) -> None:
        for p in self.generator_params() + self.critic_params():
            p.requires_grad_(True)

    @contextlib.contextmanager
    def _adapter(self, name: str) -> Iterator[WanDiT]:
        self.peft.set_adapter(name)
        self._trainable()  # peft freezes the adapters it does not activate
        yield self.dit

    def generator(self):
        return self._adapter(GENERATOR)

    def fake(self):
        return self._adapter(FAKE)

    @contextlib.contextmanager
    def real(self) -> Iterator[WanDiT]:
        try:
            with self.peft.disable_adapter():
                yield self.dit
        finally:
            self._trainable()  # enabling the adapters again freezes the inactive one

    def is_checkpointed(self, key: str) -> bool:
        """The keys of the adapters' state: all a distillation checkpoint holds of the model."""
        return "lora_" in key

    def generator_adapter(self) -> dict[str, torch.Tensor]:
        """Collective: the generator's adapter whole, keyed as peft saves an adapter (rank 0; empty
        elsewhere)."""
        from peft import get_peft_model_state_dict
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.dit, options=options)
        if not state:
            return {}
        return get_peft_model_state_dict(self.peft, state_dict={f"base_model.model.{k}": v for k, v in state.items()},
                                         adapter_name=GENERATOR)


class FullRoles:
    """Three full copies in the compute precision of the run (no quantized backbone)."""

    def __init__(self, base: WanDiT):
        base.requires_grad_(False)
        self.conversion = ConversionReport("bf16")
        self.models = nn.ModuleDict({"generator": copy.deepcopy(base).requires_grad_(True),
                                     "fake": copy.deepcopy(base).requires_grad_(True), "real": base})

    @property
    def modules(self) -> list[WanDiT]:
        return list(self.models.values())

    @property
    def checkpointed(self) -> nn.Module:
        return self.models

    def generator_params(self) -> list[nn.Parameter]:
        return list(self.models["generator"].parameters())

    def critic_params(self) -> list[nn.Parameter]:
        return list(self.models["fake"].parameters())

    @contextlib.contextmanager
    def _role(self, name: str) -> Iterator[WanDiT]:
        yield self.models[name]

    def generator(self):
        return self._role("generator")

    def fake(self):
        return self._role("fake")

    def real(self):
        return self._role("real")

    def is_checkpointed(self, key: str) -> bool:
        return not key.startswith("real.")
