"""``longlive generate``'s engine under torchrun, for the sequence-parallel inference test: the latents
every chunk hands to the frame stream, sharded over the ranks and in one process.

    torchrun --nproc_per_node=P -m tests.helpers.generate_worker SPEC.json OUT_DIR

SPEC.json holds {"runs": [{"name", "model", "prompts", "generate": {...}, "embedding_fails"?}, ...]}. Every
rank runs the prompt file as ``Generator.prepare`` sets it up, with the SequenceShard of the P ranks; then rank 0 alone
runs it again unsharded while the others wait. Rank 0 writes OUT_DIR/<name>/latents.safetensors
("sp<P>" and "sp1": each chunk's x0 as the stream got it, stacked, (chunks, C, F_c, h, w) float32) and
stats.json (each run's chunks, shot starts and KV bytes per token).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from longlive_core.config import from_mapping
from longlive_core.distributed.ulysses import WHOLE, SequenceShard
from longlive_core.infer.engine import GenerateConfig
from longlive_core.infer.generate import Generator
from tests.helpers.worker import main_over_runs


class LatentRecorder:
    """A frame stream's stand-in: keeps each chunk's latents instead of decoding them."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.new_shots: list[bool] = []

    def put(self, z: torch.Tensor, new_shot: bool) -> None:
        self.chunks.append(z.detach().to(torch.float32, copy=True))
        self.new_shots.append(new_shot)


def record(spec: dict, shard: SequenceShard) -> tuple[torch.Tensor, dict] | None:
    cfg = from_mapping(GenerateConfig, spec["generate"], "generate")
    with Generator(Path(spec["model"]), cfg, shard) as generator:
        # rank 0 embeds the prompts for every rank: no other rank loads the text encoder
        assert (generator.text is None) == (shard.rank != 0), (shard.rank, generator.text)
        run = generator.prepare(Path(spec["prompts"])).run
        recorder = LatentRecorder() if shard.rank == 0 else None
        stats = run(stream=recorder)
    if recorder is None:
        return None
    return torch.stack(recorder.chunks), {"chunks": stats.chunks, "new_shots": recorder.new_shots,
                                          "kv_bytes_per_token": stats.kv_bytes_per_token}


def embedding_fails(spec: dict, out: Path) -> None:
    """Rank 0's text encoder raises as it embeds the prompts: each rank writes what it raised to
    OUT_DIR/<name>/rank<r>.txt (the others must not wait for the embeddings)."""
    cfg = from_mapping(GenerateConfig, spec["generate"], "generate")
    shard = SequenceShard(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    with Generator(Path(spec["model"]), cfg, shard) as generator:
        if shard.rank == 0:
            def broken():
                raise ValueError("a prompt the tokenizer cannot take")

            generator.text.on = broken
        try:
            generator.prepare(Path(spec["prompts"]))
            raised = "nothing"
        except Exception as e:  # noqa: BLE001 -- what each rank raised is the result
            raised = f"{type(e).__name__}: {e}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{shard.rank}.txt").write_text(raised)
    dist.barrier()


def run_one(spec: dict, out: Path) -> None:
    if spec.get("embedding_fails"):
        return embedding_fails(spec, out)
    size = dist.get_world_size()
    sharded = record(spec, SequenceShard(dist.get_rank(), size, dist.group.WORLD))
    whole = record(spec, WHOLE) if dist.get_rank() == 0 else None
    dist.barrier()
    if whole is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    save_file({f"sp{size}": sharded[0], "sp1": whole[0]}, str(out / "latents.safetensors"))
    (out / "stats.json").write_text(json.dumps({f"sp{size}": sharded[1], "sp1": whole[1]}))


if __name__ == "__main__":
    main_over_runs(run_one)
