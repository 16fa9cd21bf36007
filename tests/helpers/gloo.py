"""The ``gloo_world`` fixture: a process group of one rank (gloo) in this pytest process, so trainers
and checkpoint stores run in-process, as one rank of a torchrun job (multi-rank equality tests still
go through torchrun). conftest.py imports it; on a GPU machine without the curation stack, load it
alone: ``pytest --noconftest -p tests.helpers.gloo tests/test_checkpointing.py``."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gloo_world():
    import torch
    import torch.distributed as dist

    from longlive_core.distributed.launch import join_process_group

    if not dist.is_initialized():
        join_process_group(torch.device("cpu"), alone=True)  # as a one-rank stage makes its group
    yield
