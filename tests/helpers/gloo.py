"""The ``gloo_world`` fixture: a process group of one rank (gloo) in this pytest process, so trainers
and checkpoint stores run in-process, as one rank of a torchrun job (multi-rank equality tests still
go through torchrun). conftest.py imports it; on a GPU machine without the curation stack, load it
alone: ``pytest --noconftest -p tests.helpers.gloo tests/test_checkpointing.py``."""
from __future__ import annotations

import socket

import pytest


@pytest.fixture(scope="session")
def gloo_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
