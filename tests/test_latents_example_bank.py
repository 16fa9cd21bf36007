"""Prompt enhancement's example bank made from the latent cache: the train split's captions, each once,
none empty, pooled as generate pools a prompt, and in the model folder's identity."""
from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from longlive_core.config import ConfigError
from longlive_core.infer.enhance import ExampleBank
from longlive_core.latents.encode import INDEX_COLUMNS
from longlive_core.latents.example_bank import example_bank
from longlive_core.models.identity import weights_sha256
from longlive_core.models.text import SCENE_TRANSITION

TOKENS, DIM = 8, 16
# sample_id -> (split, the prompts its shots were encoded with: shot_prompts' prefix on later shots)
SAMPLES = {
    "a": ("train", ["a red kite", SCENE_TRANSITION + "a city street"]),
    "b": ("train", ["a city street", SCENE_TRANSITION + "a red kite"]),  # both again, the other way round
    "c": ("train", ["", SCENE_TRANSITION, "  "]),  # a sample without captions: shot_prompts of ""
    "v": ("val", ["a held-out caption"]),
}


def make_cache(root, shard="shard-00000.safetensors"):
    """The cache's layout, each text embedding zero past its caption's tokens (as models/text.py makes
    it), stored in bfloat16; returns {text_key: the float32 embedding as stored}."""
    g = torch.Generator().manual_seed(0)
    (root / "shards").mkdir(parents=True)
    tensors, rows = {}, []
    for sample_id, (split, prompts) in SAMPLES.items():
        for k, prompt in enumerate(prompts):
            e = torch.randn(TOKENS, DIM, generator=g)
            e[1 + (len(prompt) % (TOKENS - 1)):] = 0
            key = f"{sample_id}/{k}/text"
            tensors[key] = e.to(torch.bfloat16)
            rows.append({"sample_id": sample_id, "shot": k, "video_id": sample_id, "shot_index": k, "shard": shard,
                         "latents_key": f"{sample_id}/{k}/latents", "text_key": key, "latent_shape": [1, 1, 1, 1],
                         "num_frames": 1, "caption": prompt, "split": split, "encode_key": "k", "fingerprint": "f"})
    save_file(tensors, str(root / "shards/shard-00000.safetensors"))
    pd.DataFrame(rows, columns=INDEX_COLUMNS).to_parquet(root / "index.parquet", index=False)
    return {k: v.float().numpy() for k, v in tensors.items()}


def test_the_bank_holds_each_train_caption_once_pooled_as_generate_pools_a_prompt(tmp_path):
    stored = make_cache(tmp_path / "latents")
    bank = example_bank(tmp_path / "latents", 100)
    assert bank.captions == ("a city street", "a red kite")  # no val caption, no empty one, no prefix shown
    # each from the shot that encoded it without the prefix: the text shown
    for caption, key in zip(bank.captions, ("b/0/text", "a/0/text")):
        e = stored[key]
        own = e[np.abs(e).sum(axis=1) > 0]  # the caption's own tokens: generate's mask
        mean = own.mean(axis=0)
        np.testing.assert_allclose(bank.embeddings[bank.captions.index(caption)], mean / np.linalg.norm(mean),
                                   rtol=1e-6)
    # over the cap, the captions of smallest SHA-256
    smallest = min(bank.captions, key=lambda c: hashlib.sha256(c.encode()).hexdigest())
    assert example_bank(tmp_path / "latents", 1).captions == (smallest,)
    assert example_bank(tmp_path / "latents", 0) is None


def test_the_bank_travels_with_the_folder_and_counts_in_its_identity(tmp_path):
    make_cache(tmp_path / "latents")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    without = weights_sha256(folder)
    bank = example_bank(tmp_path / "latents", 100)
    bank.save(folder)
    assert weights_sha256(folder) != without  # a new bank reaches evaluate and package
    shutil.copytree(folder, tmp_path / "bundle/model")  # as package copies the folder
    loaded = ExampleBank.load(tmp_path / "bundle/model")
    assert loaded.captions == bank.captions and np.array_equal(loaded.embeddings, bank.embeddings)


def test_no_train_caption_makes_no_bank_and_a_shard_outside_the_cache_is_refused(tmp_path):
    make_cache(tmp_path / "latents")
    index = pd.read_parquet(tmp_path / "latents/index.parquet")
    index.assign(split="val").to_parquet(tmp_path / "latents/index.parquet", index=False)
    assert example_bank(tmp_path / "latents", 100) is None
    make_cache(tmp_path / "other", shard="../../elsewhere.safetensors")
    with pytest.raises(ConfigError, match="outside"):
        example_bank(tmp_path / "other", 100)
    with pytest.raises(ConfigError, match="run encode_latents"):
        example_bank(tmp_path / "none", 100)
