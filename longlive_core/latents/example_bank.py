"""Prompt enhancement's example bank (``infer/enhance.py``: ``ExampleBank``) made from the latent cache:
the train split's captions, each once, with the umT5 embeddings the cache holds for them, pooled as
``longlive generate --enhance`` pools a prompt's (``pooled_prompt``), so prompts and captions are
compared in one space. ``merge_w4a4`` writes it into models/w4a4/, which ``package`` copies whole into
the bundle's model folder: a bundle user gets examples without the latent cache."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
from safetensors import safe_open

from longlive_core.config import ConfigError
from longlive_core.data.roots import resolve_inside
from longlive_core.infer.enhance import ExampleBank, pooled_prompt
from longlive_core.models.text import SCENE_TRANSITION

SPLIT = "train"  # the captions the model learned from; the val split stays held out of what ships with it


def example_bank(latent_dir: str | Path, limit: int) -> ExampleBank | None:
    """At most ``limit`` distinct non-empty captions of the cache's train split and their pooled
    embeddings, None when there are none (or ``limit`` is 0).

    A caption is kept as the captioner wrote it: later shots were encoded with the scene-transition
    prefix in front, which the rewrite's prompt file adds again by itself. Where a caption was encoded
    both ways, the embedding kept is the one without the prefix (the text shown); among equals, the
    first by (sample, shot). Over ``limit``, the captions of smallest SHA-256 are kept: a choice that
    does not follow the index's order and mostly stays put as the cache grows."""
    root = Path(latent_dir)
    index_path = root / "index.parquet"
    if not index_path.is_file():
        raise ConfigError(f"{index_path} is missing: run encode_latents first (dvc repro encode_latents)")
    if limit <= 0:
        return None
    index = pd.read_parquet(index_path, columns=["sample_id", "shot", "shard", "text_key", "caption", "split"])
    rows = index[index["split"] == SPLIT].copy()
    prompt = rows["caption"].fillna("").astype(str)
    rows["text"] = prompt.str.removeprefix(SCENE_TRANSITION).str.strip()
    rows["prefixed"] = prompt.str.startswith(SCENE_TRANSITION)
    rows = rows[rows["text"] != ""].sort_values(["prefixed", "sample_id", "shot"], kind="stable")
    rows = rows.drop_duplicates("text", keep="first")
    if rows.empty:
        return None
    rows["digest"] = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in rows["text"]]
    rows = rows.sort_values("digest").head(limit).sort_values("text")
    vectors: dict[str, np.ndarray] = {}
    for shard, group in rows.groupby("shard", sort=True):
        try:
            path = resolve_inside(root / "shards", str(shard))
        except ValueError as exc:
            raise ConfigError(f"{index_path} names shard {shard!r} outside {root / 'shards'}") from exc
        with safe_open(str(path), framework="pt") as f:  # "pt": the cache may store bfloat16, numpy has none
            for key, text in zip(group["text_key"], group["text"]):
                vectors[text] = pooled_prompt(f.get_tensor(key).float().numpy())
    captions = tuple(rows["text"])
    return ExampleBank(captions, np.stack([vectors[c] for c in captions]))
