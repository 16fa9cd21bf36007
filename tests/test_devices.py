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


def test_a_device_constant_is_made_once_and_serves_autograd_whatever_mode_asked_first():
    from longlive_core.devices import device_constant

    values = (0.25, -0.5, 4.0)
    with torch.inference_mode():  # e.g. a video generated before a training step in one process
        first = device_constant(values, torch.device("cpu"))
    assert not first.is_inference() and first.tolist() == list(values)
    assert device_constant(values, "cpu") is first  # the host copies it once
    x = torch.ones(3, requires_grad=True)
    (x * first).sum().backward()  # autograd saves it for the backward
    assert x.grad.tolist() == list(values)
    assert device_constant(values, "cpu", torch.float64).dtype == torch.float64
