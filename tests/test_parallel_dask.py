"""The Dask executor on a local cluster: the local executor's results, a dead worker's item run
again, an item that keeps killing workers failing alone, and shots split the same way."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from longlive_core.config import ConfigError, from_mapping
from longlive_core.parallel import DaskConfig, DaskExecutor, LocalProcessExecutor, make_executor

from .helpers.dask_items import always_die, die_once, root, slot_after_a_nap

pytestmark = pytest.mark.slow


def test_same_results_as_the_local_executor_and_failures_per_item():
    items = [4, -1, 9, 16, 25, 36]
    local = dict(LocalProcessExecutor(2).map_unordered(root, items))
    dask = dict(DaskExecutor(2).map_unordered(root, items))
    assert {k: v for k, v in dask.items() if k != -1} == {k: v for k, v in local.items() if k != -1}
    assert isinstance(dask[-1], ValueError) and str(dask[-1]) == str(local[-1])
    assert isinstance(make_executor("dask", 2), DaskExecutor)
    with pytest.raises(ConfigError, match="retries must be >= 0"):
        from_mapping(DaskConfig, {"retries": -1}, "dask")


def test_workers_are_numbered_so_each_can_take_its_own_gpu():
    from longlive_core.devices import pick_device
    from longlive_core.parallel import worker_slot

    assert worker_slot() == 0  # outside any pool
    for executor in (LocalProcessExecutor(2), DaskExecutor(2)):
        assert {slot for _, slot in executor.map_unordered(slot_after_a_nap, range(8))} == {0, 1}
    assert pick_device("cpu", slot=1).type == "cpu"


def test_a_killed_worker_loses_only_its_item_which_is_run_again(tmp_path):
    marker = str(tmp_path / "died")
    results = dict(DaskExecutor(2).map_unordered(die_once, [(marker, x) for x in range(6)]))
    assert {x: r for (_, x), r in results.items()} == {x: x * 10 for x in range(6)}
    assert (tmp_path / "died").exists()  # item 2 did kill a worker the first time


def test_an_item_that_keeps_killing_workers_fails_alone():
    from distributed.scheduler import KilledWorker

    results = dict(DaskExecutor(2, DaskConfig(retries=1)).map_unordered(always_die, [0, 1, 2, 3]))
    assert isinstance(results[1], KilledWorker)
    assert {k: v for k, v in results.items() if k != 1} == {0: 0, 2: 2, 3: 3}


def test_shots_on_a_local_dask_cluster_equal_the_local_executors(demo_copy, tmp_path):
    from longlive_core.data.ingest import IngestConfig, IngestState, ingest
    from longlive_core.data.sources import LocalSource
    from longlive_core.shots.detect import ShotsConfig
    from longlive_core.shots.split import split_videos

    from .test_shots import DEMO_SHOTS

    raw, _ = demo_copy
    m = ingest(LocalSource(raw).list(), from_mapping(IngestConfig, {"source": str(raw)}, "ingest"),
               IngestState(tmp_path / "ingest_state"), str(raw)).manifest
    cfg = from_mapping(ShotsConfig, DEMO_SHOTS, "shots")
    outs = {}
    for name, executor in (("local", LocalProcessExecutor(2)), ("dask", DaskExecutor(2))):
        out = split_videos(m, raw, cfg, tmp_path / name / "state", tmp_path / name / "clips", executor)
        outs[name] = out.shots.drop(columns=[c for c in out.shots.columns if "shard" in c]).sort_values(
            ["path", "start_frame"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(outs["dask"], outs["local"])


def test_iqa_scores_through_worker_processes_and_dask_equal_the_inline_ones(demo_shots, tmp_path):
    from longlive_core.iqa.metrics import IQAConfig
    from longlive_core.iqa.score import score_shots

    shots, clips = demo_shots
    cfg = from_mapping(IQAConfig, {"batch_size": 6}, "iqa_filter")  # 2 shots a task: several tasks
    outs = {}
    for name, executor in (("inline", make_executor("local", 1)), ("local", LocalProcessExecutor(2)),
                           ("dask", DaskExecutor(2))):
        out = score_shots(shots, clips, cfg, tmp_path / name, executor)
        assert out.counts["scored"] == len(shots)
        outs[name] = out.scores
    pd.testing.assert_frame_equal(outs["local"], outs["inline"])
    pd.testing.assert_frame_equal(outs["dask"], outs["inline"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the device tool)"))])
def test_latents_through_worker_processes_and_dask_equal_the_inline_ones(tmp_path, device):
    from safetensors.torch import load_file

    from longlive_core.latents.encode import Comm, EncodeLatentsConfig, encode_samples

    from .test_latents_encode import make_inputs

    clips, shots, samples = make_inputs(tmp_path)
    cfg = from_mapping(EncodeLatentsConfig, {"clip": {"height": 32, "width": 32}, "text_max_length": 16,
                                             "device": device}, "encode_latents")
    indexes, tensors = {}, {}
    for name, executor in (("inline", None), ("local", LocalProcessExecutor(2)),
                           ("dask", make_executor("dask", 2, gpu=device == "cuda"))):
        out = tmp_path / name
        counts = encode_samples(samples, shots, clips, out / "shards", out / "index.parquet", out / "failed.parquet",
                                cfg, Comm(), executor)
        assert (counts["samples_encoded"], counts["samples_failed"]) == (1, 1)  # "b" is not a video, wherever it runs
        assert list(pd.read_parquet(out / "failed.parquet")["sample_id"]) == ["b"]
        indexes[name] = pd.read_parquet(out / "index.parquet").drop(columns="shard")
        tensors[name] = {k: v for shard in sorted((out / "shards").iterdir()) for k, v in load_file(shard).items()}
        tensors[name]["empty"] = load_file(out / "empty_prompt.safetensors")["text"]
        if device == "cuda":  # the workers encoded on the GPU
            assert counts["peak_cuda_mb"] > 0
    for name in ("local", "dask"):
        pd.testing.assert_frame_equal(indexes[name], indexes["inline"])
        assert tensors[name].keys() == tensors["inline"].keys()
        for k, v in tensors["inline"].items():  # worker processes may run other thread counts: not bit-equal
            torch.testing.assert_close(tensors[name][k], v, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="use one"):
        from_mapping(EncodeLatentsConfig, {"sp": 2, "workers": 2}, "encode_latents")


def test_a_standing_clusters_config_file_holds_the_local_clusters_settings():
    import dask
    import distributed  # noqa: F401 - its defaults, which the file overrides
    import yaml

    from longlive_core.parallel import cluster_settings

    from .conftest import REPO

    file = yaml.safe_load((REPO / "infra" / "dask" / "distributed.yaml").read_text())
    merged = dask.config.merge(dask.config.config, file)
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    for key, value in cluster_settings(production["dask"]["retries"]).items():
        assert dask.config.get(key, config=merged) == value, key
    spawn = {k: v for k, v in dask.config.get("distributed.nanny.pre-spawn-environ", config=merged).items()
             if v is not None}
    assert "MALLOC_TRIM_THRESHOLD_" not in spawn and spawn["OMP_NUM_THREADS"] == 1
