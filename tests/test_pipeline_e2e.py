"""`dvc repro` in a copy of the repository, as a user runs it."""
import json
import sqlite3
import sys

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from longlive_core.tracking.lineage import digest_lines
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video

from .conftest import run

pytestmark = pytest.mark.slow


def report(repo, stage):
    return json.loads((repo / f"reports/{stage}/run.json").read_text())


def test_dvc_repro_runs_demo_data_and_ingest_end_to_end(repo_copy):
    repo = repo_copy
    out = run([sys.executable, "-m", "dvc", "repro", "ingest"], repo)
    assert "Running stage 'demo_data'" in out.stdout and "Running stage 'ingest'" in out.stdout

    truth = json.loads((repo / "data/demo/truth.json").read_text())
    raw = repo / "data/demo/raw"
    m = pd.read_parquet(repo / "data/ingest/manifest.parquet")
    assert sorted(m["path"]) == sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*.mp4"))
    assert dict(zip(m["path"], m["status"])) == truth["expected_status"]
    assert (m.loc[m["status"] == "quarantined", "reason"].str.len() > 0).all()
    assert "city night/café scène.mp4" in set(m["path"])

    # MLflow: one run per stage, with lineage
    head = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longlive-pipeline")
    runs = {r.data.tags["dvc.stage"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"demo_data", "ingest"}
    ingest_run = runs["ingest"]
    assert ingest_run.info.run_id == report(repo, "ingest")["mlflow_run_id"]
    assert ingest_run.data.tags["git.commit"] == head
    assert ingest_run.data.tags["git.dirty"] == "false"
    expected_digest = digest_lines(f"{r.path}\t{r.video_id}" for r in m.itertuples(index=False))
    assert ingest_run.data.tags["input.source.sha256"] == expected_digest
    assert ingest_run.data.params["ingest.source"] == "data/demo/raw"
    assert ingest_run.data.metrics["status_ok"] == 5 and ingest_run.data.metrics["videos_per_s"] > 0
    names = {a.path for a in client.list_artifacts(ingest_run.info.run_id)}
    assert {"manifest.parquet", "run.json"} <= names
    assert "input.params.sha256" in runs["demo_data"].data.tags

    # unchanged rerun: ingest runs (it must look for new files) but reuses all its work
    before = (repo / "data/ingest/manifest.parquet").read_bytes()
    out = run([sys.executable, "-m", "dvc", "repro", "ingest"], repo)
    assert "Stage 'demo_data' didn't change, skipping" in out.stdout
    s = report(repo, "ingest")
    assert (s["hashed"], s["probed"], s["reused"]) == (0, 0, 9)
    assert (repo / "data/ingest/manifest.parquet").read_bytes() == before

    # a new file is probed alone; a removed one leaves the manifest
    write_video(raw / "late/new one.mp4", VideoSpec("x", (ShotSpec(36, 0.2, "square", 4),)), 24, 320, 192)
    run([sys.executable, "-m", "dvc", "repro", "--single-item", "ingest"], repo)
    s = report(repo, "ingest")
    assert (s["hashed"], s["probed"], s["status_ok"]) == (1, 1, 6)
    (raw / "late/new one.mp4").unlink()
    run([sys.executable, "-m", "dvc", "repro", "--single-item", "ingest"], repo)
    assert "late/new one.mp4" not in set(pd.read_parquet(repo / "data/ingest/manifest.parquet")["path"])

    # the pipeline run links the stage runs and carries dvc.lock
    run(["longlive-record-pipeline"], repo)
    pipeline = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags["dvc.stage"] == "pipeline"]
    assert len(pipeline) == 1
    tags = pipeline[0].data.tags
    assert tags["stage.ingest.run_id"] == report(repo, "ingest")["mlflow_run_id"]
    assert {"dvc.lock", "params.yaml", "dvc.yaml"} <= {a.path for a in client.list_artifacts(pipeline[0].info.run_id)}
    with sqlite3.connect(repo / "mlflow.db") as db:
        assert db.execute("select count(*) from runs").fetchone()[0] == 6  # 2 + 3 ingest reruns + pipeline


def test_dvc_repro_shots_end_to_end(repo_copy):
    repo = repo_copy
    run([sys.executable, "-m", "dvc", "repro", "shots"], repo)
    truth = json.loads((repo / "data/demo/truth.json").read_text())
    shots = pd.read_parquet(repo / "data/shots/shots.parquet")
    rejected = pd.read_parquet(repo / "data/shots/rejected.parquet")
    for v in truth["videos"]:
        rows = pd.concat([shots[shots["path"] == v["path"]], rejected[rejected["path"] == v["path"]]])
        cuts = list(rows.groupby("scene_index")["start_frame"].min().sort_index().iloc[1:])
        assert len(cuts) == len(v["cut_frames"]) and all(abs(a - b) <= 1 for a, b in zip(cuts, v["cut_frames"]))
    assert list(rejected["reason"]) == ["too short: 6 frames < 12"]
    assert list((repo / "data/shots/clips").glob("*.tar"))  # shards, not one file per clip
    s = report(repo, "shots")
    assert (s["videos_split"], s["shots"]) == (5, len(shots))
    # ingest reruns (always_changed) but writes the same manifest, so shots is not redone
    out = run([sys.executable, "-m", "dvc", "repro", "shots"], repo)
    assert "Stage 'shots' didn't change, skipping" in out.stdout
    # a forced rerun reuses every finished video
    run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "shots"], repo)
    assert report(repo, "shots")["videos_reused"] == 5


def test_dvc_repro_iqa_filter_scores_every_usable_shot_once(repo_copy):
    repo = repo_copy
    run([sys.executable, "-m", "dvc", "repro", "iqa_filter"], repo)
    shots = pd.read_parquet(repo / "data/shots/shots.parquet")
    scores = pd.read_parquet(repo / "data/iqa/scores.parquet")
    assert len(scores) == len(shots)
    assert not scores.duplicated(["video_id", "shot_index"]).any()  # counts conserved
    assert (scores["iqa_metric"] == "piqe").all()
    good = (scores["iqa_score"] <= 68.0) & (scores["motion_score"] >= 0.01)
    assert (scores["kept"] == good).all() and 0 < scores["kept"].sum() < len(scores)
    static = scores[scores["reject_reason"].str.startswith("static")]
    assert list(static["path"]) == ["nature/forest_walk.mp4"]  # the demo's one static shot
    assert report(repo, "iqa_filter")["scored"] == len(shots)
    # a threshold change re-decides from the cache, without scoring again
    text = (repo / "params.yaml").read_text().replace("piqe: 68.0", "piqe: 100.0")
    (repo / "params.yaml").write_text(text)
    run([sys.executable, "-m", "dvc", "repro", "iqa_filter"], repo)
    assert report(repo, "iqa_filter")["scored"] == 0
    assert pd.read_parquet(repo / "data/iqa/scores.parquet")["kept"].sum() == len(shots) - 1  # all but the static


def test_dvc_repro_assemble_matches_captions_and_splits_by_video(repo_copy):
    repo = repo_copy
    run([sys.executable, "-m", "dvc", "repro", "assemble"], repo)
    truth = json.loads((repo / "data/demo/truth.json").read_text())
    samples = pd.read_parquet(repo / "data/samples/samples.parquet")
    scores = pd.read_parquet(repo / "data/iqa/scores.parquet").set_index(["video_id", "shot_index"])
    assert len(samples) > 0 and set(samples["split"]) == {"train", "val"}
    assert not set(samples.loc[samples["split"] == "train", "video_id"]) & set(
        samples.loc[samples["split"] == "val", "video_id"])
    by_path = {v["path"]: v for v in truth["videos"]}
    for s in samples.itertuples(index=False):
        assert s.duration_s >= 1.5 and len(s.shot_indices) <= 4 and s.bucket
        video = by_path[s.path]
        for idx, caption in zip(s.shot_indices, s.captions):
            shot = scores.loc[(s.video_id, idx)]
            assert shot["kept"]
            if video["caption_form"] == "shots":  # the true shot that holds this piece gives the caption
                mid = (shot["start_frame"] + shot["end_frame"]) / 2
                (true,) = [t for t in video["shots"] if t["start_frame"] <= mid < t["end_frame"]]
                assert caption == true["caption"]
            elif video["caption_form"] == "none":
                assert caption == ""
    report_dir = repo / "reports/curation"
    counts = json.loads((report_dir / "counts.json").read_text())
    assert counts["kept_shots"] == int(scores["kept"].sum()) and counts["samples"] == len(samples)
    assert counts["reject_reasons"]["too short"] == 1
    reasons = counts["reject_reasons"]
    assert reasons.get("quality", 0) + reasons.get("static", 0) == int((~scores["kept"]).sum())
    assert reasons["static"] == 1
    for name in ("shot_length", "iqa_score", "motion_score", "contact_best", "contact_borderline", "contact_rejected"):
        assert (report_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    run_id = report(repo, "assemble")["mlflow_run_id"]
    assert "curation/index.md" in {a.path for a in client.list_artifacts(run_id, "curation")}


def read_shards(directory):
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(directory.glob("shard-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_dvc_repro_encode_latents_and_two_ranks_agree_with_one(repo_copy):
    repo = repo_copy
    run([sys.executable, "-m", "dvc", "repro", "encode_latents"], repo)
    samples = pd.read_parquet(repo / "data/samples/samples.parquet")
    index = pd.read_parquet(repo / "data/latents/index.parquet")
    assert len(index) == sum(len(s) for s in samples["shot_indices"])  # one row per shot of every sample
    tensors = read_shards(repo / "data/latents/shards")
    assert len(tensors) == 2 * len(index)
    for s in samples.itertuples(index=False):
        rows = index[index["sample_id"] == s.sample_id].sort_values("shot")
        assert list(rows["shot_index"]) == list(s.shot_indices) and list(rows["caption"]) == list(s.captions)
        for r in rows.itertuples(index=False):
            z, text = tensors[r.latents_key], tensors[r.text_key]
            assert (r.num_frames - 1) % 4 == 0 and list(z.shape) == [48, 1 + (r.num_frames - 1) // 4, 4, 8]
            assert list(r.latent_shape) == list(z.shape) and text.shape == (64, 32)
            assert (text[len(r.caption.encode()) + 1:] == 0).all()  # zero past the caption's bytes + EOS
    rep = report(repo, "encode_latents")
    assert rep["samples_encoded"] == len(samples) and rep["samples_failed"] == 0 and rep["halo"] == 28
    assert pd.read_parquet(repo / "data/latents/failed.parquet").empty

    # a rerun encodes nothing new
    run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "encode_latents"], repo)
    assert (report(repo, "encode_latents")["samples_encoded"], report(repo, "encode_latents")["samples_reused"]) == (
        0, len(samples))

    # the same data on two ranks (torchrun, gloo): the same latents
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("  sp: 1  ", "  sp: 2  "))
    for p in (repo / "data/latents/shards").glob("*"):
        p.unlink()
    (repo / "data/latents/index.parquet").unlink()
    run([sys.executable, "-m", "dvc", "repro", "encode_latents"], repo)
    two = read_shards(repo / "data/latents/shards")
    assert report(repo, "encode_latents")["ranks"] == 2 and two.keys() == tensors.keys()
    for k, v in tensors.items():
        assert (two[k] - v).abs().max() <= 1e-5 * max(1.0, v.abs().max().item()), k
