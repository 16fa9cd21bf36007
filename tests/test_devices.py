"""One device picker for every stage: auto, cpu, cuda (one GPU per torchrun rank); bad values say so."""
from __future__ import annotations

import pytest
import torch

from longlive_core.config import ConfigError
from longlive_core.devices import pick_device


def test_device_param_values():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="encode_latents.device must be auto, cpu or cuda"):
        pick_device("tpu", "encode_latents.device")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="iqa_filter.device is cuda but no CUDA device"):
            pick_device("cuda", "iqa_filter.device")
