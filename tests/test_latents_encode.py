"""encode_samples on its own: a failing shot skips its sample and is reported; shards and index."""
from __future__ import annotations

import dataclasses
import hashlib

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


DIGESTS: dict[str, str] = {}  # clip member -> SHA-256 of its bytes, as the shots stage records it


def make_inputs(tmp_path):
    """Two samples: "a" (two good shots of v1) and "b" (v2's one shot, not a video)."""
    clips = tmp_path / "clips"
    writer = ShardWriter(clips, 1 << 30)
    members = {"v1/0000.mp4": clip_bytes(tmp_path, 17, 1), "v1/0001.mp4": clip_bytes(tmp_path, 9, 2),
               "v2/0000.mp4": b"not a video", "v1/0000-recut.mp4": clip_bytes(tmp_path, 13, 3)}
    for member, data in members.items():
        shard = writer.add(member, data)
    writer.close()
    DIGESTS.update({m: hashlib.sha256(d).hexdigest() for m, d in members.items()})
    shots = pd.DataFrame({"video_id": ["v1", "v1", "v2"], "shot_index": [0, 1, 0], "clip_shard": [shard] * 3,
                          "clip_member": ["v1/0000.mp4", "v1/0001.mp4", "v2/0000.mp4"],
                          "start_frame": [0, 17, 0], "end_frame": [17, 26, 9]})
    shots["clip_sha256"] = shots["clip_member"].map(DIGESTS)
    samples = pd.DataFrame({"sample_id": ["a", "b"], "video_id": ["v1", "v2"], "shot_indices": [[0, 1], [0]],
                            "captions": [["one", "two"], ["broken"]], "split": ["train", "val"]})
    return clips, shots, samples


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_a_failing_shot_skips_its_sample_and_the_rest_are_encoded(tmp_path, store_dtype):
    clips, shots, samples = make_inputs(tmp_path)
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


def test_a_rerun_redoes_what_changed_and_drops_what_left(tmp_path):
    clips, shots, samples = make_inputs(tmp_path)
    samples = samples[samples["sample_id"] == "a"].reset_index(drop=True)
    cfg = from_mapping(EncodeLatentsConfig, {"clip": {"height": 32, "width": 32}, "text_max_length": 16},
                       "encode_latents")
    out = tmp_path / "latents"

    def run(samples, shots):
        counts = encode_samples(samples, shots, clips, out / "shards", out / "index.parquet",
                                out / "failed.parquet", cfg, Comm())
        return counts, pd.read_parquet(out / "index.parquet")

    first, index = run(samples, shots)
    # later shots' prompts carry the scene-transition prefix; the empty prompt is stored once, for guidance
    assert first["samples_encoded"] == 1 and list(index["caption"]) == ["one", "The scene transitions. two"]
    assert load_file(out / "empty_prompt.safetensors")["text"].shape == (16, 32)
    # a changed split is metadata: the latents stay, the index follows (no val rows left in train);
    # a temporary a killed run left behind is cleared
    (out / "shards" / ".tmp-shard-00009.safetensors.abc").write_bytes(b"half")
    moved = samples.assign(split=["val"])
    counts, index = run(moved, shots)
    assert (counts["samples_encoded"], counts["samples_reused"]) == (0, 1) and set(index["split"]) == {"val"}
    assert not list((out / "shards").glob(".tmp-*")) and counts["samples_stale"] == 0
    # an edited caption re-embeds the sample; the shard only it used is deleted
    edited = moved.assign(captions=[["one", "changed"]])
    counts, index = run(edited, shots)
    assert (counts["samples_encoded"], counts["samples_stale"], counts["shards_removed"]) == (1, 1, 1)
    assert list(index["caption"]) == ["one", "The scene transitions. changed"]
    assert sorted(p.name for p in (out / "shards").iterdir()) == list(index["shard"].unique())
    # a re-cut clip (another member, another frame range) re-encodes with the new frames
    recut = shots.copy()
    recut.loc[0, ["clip_member", "end_frame", "clip_sha256"]] = ["v1/0000-recut.mp4", 13, DIGESTS["v1/0000-recut.mp4"]]
    counts, index = run(edited, recut)
    assert counts["samples_encoded"] == 1 and list(index["latent_shape"][0]) == [48, 4, 2, 2]  # 13 frames -> 4
    # a smaller selection keeps what was encoded; a sample gone from the samples table leaves the
    # index, and its shard goes
    narrow = dataclasses.replace(cfg, split="train")
    counts = encode_samples(edited, recut, clips, out / "shards", out / "index.parquet", out / "failed.parquet",
                            narrow, Comm())
    assert counts["samples_selected"] == 0 and len(pd.read_parquet(out / "index.parquet")) == 2
    counts, index = run(edited.iloc[:0], recut)
    assert counts["samples_dropped"] == 1 and index.empty and not list((out / "shards").iterdir())


def test_weights_identity_follows_the_bytes_and_reads_unchanged_files_once(tmp_path, monkeypatch):
    import os

    from longlive_core.models import weights as w

    memo = tmp_path / "memo.json"
    assert w.weights_identity("tiny") == "tiny"
    (tmp_path / "vae").mkdir()
    weights = tmp_path / "vae" / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = w.weights_identity(tmp_path / "vae", memo)
    reads = []
    monkeypatch.setattr(w, "digest_file", lambda p, _sha=w.digest_file: reads.append(p) or _sha(p))
    assert w.weights_identity(tmp_path / "vae", memo) == first and reads == []  # memoised: nothing read
    os.utime(weights, ns=(1, 1))  # touched, the same bytes: read again, the same weights
    assert w.weights_identity(tmp_path / "vae", memo) == first and len(reads) == 1
    weights.write_bytes(b"y" * 10)  # new weights of the same size, copied with their old times kept
    os.utime(weights, ns=(1, 1))
    assert w.weights_identity(tmp_path / "vae", memo) != first
    assert w.weights_identity(tmp_path / "vae", None) == w.weights_identity(tmp_path / "vae", memo)
    with pytest.raises(w.CheckpointError, match="no weights at"):
        w.weights_identity(tmp_path / "missing", memo)


def test_only_rank_0_loads_the_text_encoder_and_the_callers_random_stream_is_kept():
    from longlive_core.latents.encode import make_models

    cfg = EncodeLatentsConfig(text_max_length=16)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    vae0, text0 = make_models(cfg, torch.device("cpu"), rank=0)
    assert torch.equal(torch.rand(3), want)  # building the tiny models did not reseed the caller
    vae1, text1 = make_models(cfg, torch.device("cpu"), rank=1)
    assert text1 is None and text0 is not None and next(text0.model.parameters()).dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(vae0.state_dict().values(), vae1.state_dict().values()))
