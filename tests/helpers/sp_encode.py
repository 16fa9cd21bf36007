"""Run under torchrun: every rank encodes its chunk of one random clip with the tiny VAE through
encode_shot's path (Comm.exchange over gloo on the CPU, or NCCL with argv[3] = cuda, one GPU per
rank); rank 0 writes the assembled latents and the full single-process encode to the safetensors
file named by argv[1]; argv[2] is the halo."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from longlive_core.distributed.launch import join_process_group
from longlive_core.latents.encode import Comm, encode_shot
from longlive_core.models.vae import build_vae, encode_video, frames_to_input
from longlive_core.video.normalize import NormalizedClip


def main() -> None:
    device = torch.device("cpu")
    if len(sys.argv) > 3 and sys.argv[3] == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    join_process_group(device)
    comm = Comm(dist.get_rank(), dist.get_world_size(), device)
    torch.manual_seed(0)
    vae = build_vae("tiny").to(device)
    frames = np.random.default_rng(0).integers(0, 255, (4 * 80 + 1, 32, 32, 3), dtype=np.uint8)
    clip = NormalizedClip(frames, {"frames": len(frames), "trimmed_frames": 0, "repeated_frames": 0,
                                   "dropped_source_frames": 0, "rotated": 0, "portrait": 0})
    counts = {k: 0 for k in ("latents_kept", "latents_encoded", "latents_encoded_max_rank", "frames_encoded",
                             "frames_trimmed", "frames_repeated", "frames_dropped", "rotated_shots",
                             "portrait_shots")}
    halo = int(sys.argv[2])
    z = encode_shot(vae, clip, halo, comm, device, counts)
    if comm.rank == 0:
        full = encode_video(vae, frames_to_input(frames, device)).cpu()
        save_file({"chunked": z.contiguous(), "full": full.contiguous(),
                   "max_rank": torch.tensor(counts["latents_encoded_max_rank"])}, sys.argv[1])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
