"""Training checkpoints with ``torch.distributed.checkpoint``: every rank writes its own shards of the
model, the optimizer and the EMA; rank 0 then writes ``meta.json`` (the step, the run's digest,
counters) and renames the folder into place, so a checkpoint without ``meta.json`` or still under
its temporary name is from a killed save and is never read.

A run resumes from the newest checkpoint only when its digest equals the current run's (the params
that shape training, the latent index, the starting weights, the world layout). Otherwise every old
checkpoint, with the step history that belongs to it, is moved to ``set_aside/<digest>/`` (the last
set-aside run is kept, older ones are deleted) and the run starts fresh, saying why. The RNG needs
no saving: every draw of a step is keyed by (seed, step, slot) or reseeded from them. State that
differs from rank to rank and is not sharded model state (the error-recycling buffers) goes into one
safetensors file per rank beside the DCP shards; the digest holds the world layout, so a resumed
rank reads the file its predecessor wrote.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from longlive_core.io.atomic import TMP_PREFIX, write_bytes, write_json

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"step-(\d{8})")
META = "meta.json"
HISTORY = "history.jsonl"  # one JSON line per completed step, beside the checkpoints it belongs to
SET_ASIDE = "set_aside"


class CheckpointStore:
    def __init__(self, root: str | Path, digest: str, keep: int, model_keys: Callable[[str], bool] | None = None):
        """``model_keys``: which of the model's state-dict keys a checkpoint holds (default all; a
        distillation keeps its adapters, not the frozen backbone it rebuilds from its input)."""
        self.root, self.digest, self.keep, self.model_keys = Path(root), digest, keep, model_keys

    def _model_state(self, model, optimizer) -> tuple[dict, dict]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if self.model_keys is not None:
            model_sd = {k: v for k, v in model_sd.items() if self.model_keys(k)}
        return model_sd, optim_sd

    @property
    def history(self) -> Path:
        return self.root / HISTORY

    def _complete(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            m = STEP_DIR.fullmatch(path.name)
            if m and (path / META).is_file():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def resume_step(self) -> tuple[int, str]:
        """Rank 0: clears what killed saves left, sets aside another run's checkpoints; returns the
        step to resume from (0: fresh) and why. Other ranks learn the answer from ``agree``."""
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        for path in self.root.iterdir():  # a step folder without meta.json: a save killed after its rename
            if STEP_DIR.fullmatch(path.name) and not (path / META).is_file():
                shutil.rmtree(path)
        complete = self._complete()
        if not complete:
            self.history.unlink(missing_ok=True)
            return 0, "no checkpoint: starting fresh"
        step, path = complete[-1]
        meta = json.loads((path / META).read_text())
        if meta.get("digest") == self.digest:
            self._truncate_history(step)
            return step, f"resuming from {path} (step {step})"
        old = str(meta.get("digest", "unknown"))[:16]
        target = self.root / SET_ASIDE
        shutil.rmtree(target, ignore_errors=True)
        (target / old).mkdir(parents=True)
        for _, p in complete:
            os.replace(p, target / old / p.name)
        if self.history.exists():
            os.replace(self.history, target / old / HISTORY)
        return 0, (f"the checkpoints in {self.root} are from another run (digest {old}: its params, latent index, "
                   f"starting weights or world layout differ): set aside in {target / old}; starting fresh")

    def _truncate_history(self, step: int) -> None:
        """Drops the lines of steps after the checkpoint (a killed run logged them, then lost them)."""
        if not self.history.exists():
            return
        lines = [ln for ln in self.history.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["step"] <= step]
        if len(kept) != len(lines):
            write_bytes("".join(ln + "\n" for ln in kept).encode(), self.history)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def meta(self, step: int) -> dict[str, Any]:
        return json.loads((self.path(step) / META).read_text())

    def save(self, step: int, model, optimizer, extra_state: dict, meta: dict,
             rank_state: dict[str, torch.Tensor] | None = None) -> None:
        """Collective: every rank calls it. ``rank_state``: tensors of this rank alone (the
        error-recycling buffers), written as its own safetensors file."""
        tmp = self.root / f"{TMP_PREFIX}step-{step:08d}"
        model_sd, optim_sd = self._model_state(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, **extra_state}, checkpoint_id=str(tmp))
        if rank_state is not None:
            tmp.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in rank_state.items()}, str(tmp / _rank_file(dist.get_rank())))
        dist.barrier()
        if dist.get_rank() == 0:
            final = self.path(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_json({**meta, "step": step, "digest": self.digest}, final / META)
            for _, old in self._complete()[:-self.keep]:
                shutil.rmtree(old)
        dist.barrier()

    def load(self, step: int, model, optimizer, extra_state: dict) -> None:
        """Collective: restores the model, the optimizer and ``extra_state``'s tensors in place."""
        model_sd, optim_sd = self._model_state(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, **extra_state}
        dcp.load(state, checkpoint_id=str(self.path(step)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=self.model_keys is None))

    def load_rank_state(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's own tensors of the checkpoint (``save``'s ``rank_state``); empty if it had none."""
        path = self.path(step) / _rank_file(dist.get_rank())
        return load_file(str(path)) if path.is_file() else {}


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def agree(value: Any) -> Any:
    """Rank 0's value on every rank (a small object made by this job's rank 0)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
