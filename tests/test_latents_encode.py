"""encode_samples on its own: a failing shot skips its sample and is reported; shards and index."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from longlive_core.config import ConfigError, from_mapping
from longlive_core.latents.encode import Comm, EncodeLatentsConfig, encode_samples
from longlive_core.shots.clips import ShardWriter
from longlive_core.video.synth import encode_frames


def clip_bytes(tmp_path, n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(n)]
    path = tmp_path / f"c{seed}.mp4"
    encode_frames(path, frames, fps=24, width=32, height=32, crf=18)
    return path.read_bytes()


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_a_failing_shot_skips_its_sample_and_the_rest_are_encoded(tmp_path, store_dtype):
    clips = tmp_path / "clips"
    writer = ShardWriter(clips, 1 << 30)
    shard = writer.add("v1/0000.mp4", clip_bytes(tmp_path, 17, 1))
    writer.add("v1/0001.mp4", clip_bytes(tmp_path, 9, 2))
    writer.add("v2/0000.mp4", b"not a video")
    writer.close()
    shots = pd.DataFrame({"video_id": ["v1", "v1", "v2"], "shot_index": [0, 1, 0], "clip_shard": [shard] * 3,
                          "clip_member": ["v1/0000.mp4", "v1/0001.mp4", "v2/0000.mp4"]})
    samples = pd.DataFrame({"sample_id": ["a", "b"], "video_id": ["v1", "v2"], "shot_indices": [[0, 1], [0]],
                            "captions": [["one", "two"], ["broken"]], "split": ["train", "val"]})
    cfg = from_mapping(EncodeLatentsConfig, {"clip": {"height": 32, "width": 32}, "text_max_length": 16,
                                             "store_dtype": store_dtype}, "encode_latents")
    out = tmp_path / "latents"
    counts = encode_samples(samples, shots, clips, out / "shards", out / "index.parquet", out / "failed.parquet",
                            cfg, Comm())
    assert (counts["samples_encoded"], counts["samples_failed"], counts["shots_encoded"]) == (1, 1, 2)
    failed = pd.read_parquet(out / "failed.parquet")
    assert list(failed["sample_id"]) == ["b"] and "shot 0" in failed["reason"][0]
    index = pd.read_parquet(out / "index.parquet")
    assert list(index["sample_id"]) == ["a", "a"] and [list(s) for s in index["latent_shape"]] == [
        [48, 5, 2, 2], [48, 3, 2, 2]]  # 17 frames -> 5 latents, 9 -> 3
    assert [p.name for p in (out / "shards").iterdir()] == ["shard-00000.safetensors"]
    stored = load_file(out / "shards" / "shard-00000.safetensors")
    assert {t.dtype for t in stored.values()} == {getattr(torch, store_dtype)} and len(stored) == 4
    again = encode_samples(samples, shots, clips, out / "shards", out / "index.parquet", out / "failed.parquet",
                           cfg, Comm())
    assert (again["samples_encoded"], again["samples_reused"], again["samples_failed"]) == (0, 1, 1)


def test_encode_params_are_checked():
    with pytest.raises(ConfigError, match="multiples of 32"):
        from_mapping(EncodeLatentsConfig, {"clip": {"height": 48, "width": 64}}, "encode_latents")
    with pytest.raises(ConfigError, match="split must be"):
        from_mapping(EncodeLatentsConfig, {"split": "test"}, "encode_latents")
