"""DVC stage `encode_latents`: every selected sample's shots -> VAE latents and caption embeddings in
safetensors shards under data/latents/shards/, with data/latents/index.parquet (one row per shot)
and data/latents/failed.parquet. With encode_latents.sp = P > 1 the module re-launches itself under
torchrun with P ranks (each encodes on its own device; they exchange through NCCL on GPUs, gloo on
the CPU): Balanced-SP chunk-halo encoding."""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys

import pandas as pd

from longlive_core.config import ConfigError, load_params, stage_config
from longlive_core.devices import pick_device
from longlive_core.distributed.launch import join_process_group, torchrun_command, under_torchrun
from longlive_core.latents.encode import Comm, EncodeLatentsConfig, encode_samples
from longlive_core.parallel import DaskConfig, make_executor
from longlive_core.progress import setup_logging
from longlive_core.tracking.lineage import digest_file
from tasks.paths import CLIPS, LATENT_INDEX, LATENT_SHARDS, LATENTS_FAILED, SAMPLES, SHOTS
from tasks.stage import run_stage


@dataclasses.dataclass(frozen=True)
class Prepared:
    encode: EncodeLatentsConfig
    dask: DaskConfig


def config(params) -> Prepared:
    cfg = stage_config(EncodeLatentsConfig, "encode_latents", params)
    dask = DaskConfig.from_params(params)
    if dask.remote(cfg.executor):
        if cfg.device == "auto":  # each worker would decide, and the text encoder's dtype (in the cache key) with it
            raise ConfigError("encode_latents.device must be cpu or cuda with a remote Dask cluster (dask.address)")
    else:  # a GPU asked for and absent: said before anything starts
        pick_device(cfg.device, "encode_latents.device")
    return Prepared(cfg, dask)


def encode(p: Prepared, comm: Comm) -> dict:
    cfg = p.encode
    executor = None if comm.world > 1 else make_executor(cfg.executor, cfg.workers, p.dask, gpu=cfg.device == "cuda")
    return encode_samples(pd.read_parquet(SAMPLES), pd.read_parquet(SHOTS), CLIPS, LATENT_SHARDS, LATENT_INDEX,
                          LATENTS_FAILED, cfg, comm, executor)


def body(p: Prepared, run, comm: Comm):
    run.set_tags({"input.samples.sha256": digest_file(SAMPLES), "input.shots.sha256": digest_file(SHOTS),
                  "encode.executor": p.encode.executor, "encode.workers": str(p.encode.workers)})
    counts = encode(p, comm)
    run.log_metrics(counts)
    run.log_artifact(LATENT_INDEX)
    run.log_artifact(LATENTS_FAILED)
    return counts


def one_line(s) -> str:
    return (f"{s['samples_encoded']} samples encoded ({s['shots_encoded']} shots, {s['frames_encoded']} frames, "
            f"{s['frames_per_s']} frames/s), {s['samples_reused']} reused, {s['samples_failed']} failed; "
            f"{s['ranks']} rank(s), halo {s['halo']}, encoded/kept latents {s['halo_overhead']}")


def main() -> None:
    setup_logging()
    try:
        p = config(load_params())
        cfg = p.encode
    except ConfigError as exc:
        print(f"encode_latents: {exc}", file=sys.stderr)
        sys.exit(2)
    if cfg.sp > 1 and not under_torchrun():  # re-launch as P ranks of this node
        cmd = torchrun_command("tasks.encode_latents", 1, cfg.sp)
        os.execvp(cmd[0], cmd)
    comm = Comm()
    if under_torchrun():
        import torch.distributed as dist

        device = pick_device(cfg.device, "encode_latents.device")  # on GPUs each rank's chunk latents go GPU to GPU
        # rank 0 loads the text encoder alone before the first collective: wait longer than NCCL's 10 min
        join_process_group(device, timeout=datetime.timedelta(hours=1))
        comm = Comm(dist.get_rank(), dist.get_world_size(), device)
        if comm.world != cfg.sp:
            raise ConfigError(f"encode_latents.sp is {cfg.sp} but torchrun started {comm.world} ranks")
    try:
        if comm.rank == 0:
            code = run_stage("encode_latents", config, lambda c, run: body(c, run, comm), one_line)
        else:
            encode(p, comm)
            code = 0
    finally:
        if comm.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
