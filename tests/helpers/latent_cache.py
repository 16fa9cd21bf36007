"""A synthetic latent cache in encode_latents' layout (index.parquet, shards/, samples.parquet), for
training tests that should not wait for the curation stages."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_file

from longlive_core.latents.encode import INDEX_COLUMNS
from longlive_core.latents.files import EMPTY_PROMPT

TEXT_TOKENS, TEXT_DIM, CHANNELS, HEIGHT, WIDTH = 6, 32, 48, 4, 4


def make_cache(root: Path, samples: dict[str, tuple[str, list[int]]], weights: dict[str, float] | None = None,
               seed: int = 0, nan_in: str | None = None) -> Path:
    """``samples``: sample_id -> (split, latent frames of each shot). Latents are smooth random fields
    plus a per-shot offset, so a model can learn something; ``nan_in`` poisons one sample."""
    g = torch.Generator().manual_seed(seed)
    (root / "shards").mkdir(parents=True, exist_ok=True)
    tensors, rows, sample_rows = {}, [], []
    for sample_id, (split, frames) in sorted(samples.items()):
        for k, n in enumerate(frames):
            z = torch.randn(CHANNELS, n, HEIGHT, WIDTH, generator=g) * 0.5 + k
            if sample_id == nan_in:
                z[0, 0, 0, 0] = float("nan")
            text = torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g)
            lkey, tkey = f"{sample_id}/{k}/latents", f"{sample_id}/{k}/text"
            tensors[lkey], tensors[tkey] = z, text
            rows.append({"sample_id": sample_id, "shot": k, "video_id": sample_id, "shot_index": k,
                         "shard": "shard-00000.safetensors", "latents_key": lkey, "text_key": tkey,
                         "latent_shape": [CHANNELS, n, HEIGHT, WIDTH], "num_frames": 4 * n - 3,
                         "caption": f"caption {k}", "split": split, "encode_key": "k", "fingerprint": "f"})
        sample_rows.append({"sample_id": sample_id, "split": split,
                            "sample_weight": 1.0 if weights is None else weights[sample_id]})
    save_file(tensors, str(root / "shards" / "shard-00000.safetensors"))
    save_file({"text": torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g)}, str(root / EMPTY_PROMPT))
    pd.DataFrame(rows, columns=INDEX_COLUMNS).to_parquet(root / "index.parquet", index=False)
    pd.DataFrame(sample_rows).to_parquet(root / "samples.parquet", index=False)
    return root


# a small cache with multi-shot samples, a sample too short for a 2-frame chunk, and val samples
SMALL = {"a": ("train", [5, 4]), "b": ("train", [9]), "c": ("train", [3, 6, 2]), "short": ("train", [1]),
         "v1": ("val", [4, 4]), "v2": ("val", [6])}
