"""`dvc repro` in a copy of the repository, as a user runs it: one run of the whole demo pipeline
(``demo_repro``) that every test reads, and variants that copy its workspace, change one thing and
rerun only what that change reaches."""
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import av
import pandas as pd
import psutil
import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationConfig
from mlflow.tracking import MlflowClient
from peft import PeftModel
from safetensors import safe_open

from longlive_core.config import load_params, stage_config
from longlive_core.infer.enhance import ExampleBank
from longlive_core.infer.model_folder import load_model_folder
from longlive_core.latents.encode import EncodeLatentsConfig
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.config import DIT_CONFIGS, DiTConfig
from longlive_core.models.text import SCENE_TRANSITION, shot_prompts
from longlive_core.quant.packed import PackedNVFP4Linear
from longlive_core.tracking.lineage import digest_lines
from longlive_core.train.online_latents import OnlineSource
from longlive_core.video.synth import ShotSpec, VideoSpec, write_video
from tasks.package import CONFIG_STAGES

from .conftest import cli_env, run, workspace_copy

pytestmark = pytest.mark.slow


def report(repo, stage):
    return json.loads((repo / f"reports/{stage}/run.json").read_text())


def repro(repo, *args):
    return run([sys.executable, "-m", "dvc", "repro", *args], repo)


def ran(out, stage) -> bool:
    return f"Running stage '{stage}'" in out.stdout


def test_ingest_lists_every_file_with_lineage_in_mlflow(demo_repro):
    repo = demo_repro
    truth = json.loads((repo / "data/demo/truth.json").read_text())
    raw = repo / "data/demo/raw"
    m = pd.read_parquet(repo / "data/ingest/manifest.parquet")
    assert sorted(m["path"]) == sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*.mp4"))
    assert dict(zip(m["path"], m["status"])) == truth["expected_status"]
    assert (m.loc[m["status"] == "quarantined", "reason"].str.len() > 0).all()
    assert "city night/café scène.mp4" in set(m["path"])

    head = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longlive-pipeline")
    runs = {r.data.tags["dvc.stage"]: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"demo_data", "weights", "ingest", "shots", "iqa_filter", "caption", "assemble",
                         "encode_latents", "train_ar", "distill_dmd", "merge_w4a4", "evaluate", "package"}
    ingest_run = runs["ingest"]
    assert ingest_run.info.run_id == report(repo, "ingest")["mlflow_run_id"]
    assert ingest_run.data.tags["git.commit"] == head
    assert ingest_run.data.tags["git.dirty"] == "false"
    expected_digest = digest_lines(f"{r.path}\t{r.video_id}" for r in m.itertuples(index=False))
    assert ingest_run.data.tags["input.source.sha256"] == expected_digest
    assert ingest_run.data.params["ingest.source"] == "data/demo/raw"
    assert ingest_run.data.metrics["status_ok"] == 5 and ingest_run.data.metrics["videos_per_s"] > 0
    assert {"manifest.parquet", "run.json"} <= {a.path for a in client.list_artifacts(ingest_run.info.run_id)}
    assert "input.params.sha256" in runs["demo_data"].data.tags


def test_ingest_reruns_cheaply_and_sees_new_and_removed_files(demo_repro, tmp_path):
    repo = workspace_copy(demo_repro, tmp_path / "repo")
    before = (repo / "data/ingest/manifest.parquet").read_bytes()
    out = repro(repo)  # ingest and weights run (they must look), reuse all their work, change nothing
    assert ran(out, "ingest") and ran(out, "weights") and not ran(out, "shots")
    s = report(repo, "ingest")
    assert (s["hashed"], s["probed"], s["reused"]) == (0, 0, 9)
    assert (repo / "data/ingest/manifest.parquet").read_bytes() == before

    raw = repo / "data/demo/raw"
    write_video(raw / "late/new one.mp4", VideoSpec("x", (ShotSpec(36, 0.2, "square", 4),)), 24, 320, 192)
    repro(repo, "--single-item", "ingest")
    s = report(repo, "ingest")
    assert (s["hashed"], s["probed"], s["status_ok"]) == (1, 1, 6)
    (raw / "late/new one.mp4").unlink()
    repro(repo, "--single-item", "ingest")
    assert "late/new one.mp4" not in set(pd.read_parquet(repo / "data/ingest/manifest.parquet")["path"])

    # the pipeline run links the stage runs and carries dvc.lock
    run(["longlive-record-pipeline"], repo)
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("longlive-pipeline")
    pipeline = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags["dvc.stage"] == "pipeline"]
    assert len(pipeline) == 1
    assert pipeline[0].data.tags["stage.ingest.run_id"] == report(repo, "ingest")["mlflow_run_id"]
    with sqlite3.connect(repo / "mlflow.db") as db:  # 13 stages, then 2 + 1 + 1 reruns, and the pipeline
        assert db.execute("select count(*) from runs").fetchone()[0] == 18


def test_shots_finds_the_known_cuts_and_links_its_clips_from_the_dvc_cache(demo_repro, tmp_path):
    repo = demo_repro
    truth = json.loads((repo / "data/demo/truth.json").read_text())
    shots = pd.read_parquet(repo / "data/shots/shots.parquet")
    rejected = pd.read_parquet(repo / "data/shots/rejected.parquet")
    for v in truth["videos"]:
        rows = pd.concat([shots[shots["path"] == v["path"]], rejected[rejected["path"] == v["path"]]])
        cuts = list(rows.groupby("scene_index")["start_frame"].min().sort_index().iloc[1:])
        assert len(cuts) == len(v["cut_frames"]) and all(abs(a - b) <= 1 for a, b in zip(cuts, v["cut_frames"]))
    assert list(rejected["reason"]) == ["too short: 6 frames, 0.250 s < 0.5 s"]
    shards = list((repo / "data/shots/clips").glob("*.tar"))
    assert shards and report(repo, "shots")["videos_split"] == 5
    # DVC links the clips from its cache rather than keeping a second copy
    assert all(os.stat(p).st_nlink == 2 for p in shards)

    # a lost state comes back from DVC's cache (`dvc pull` from a remote does the same), and a
    # forced rerun reuses every finished video
    variant = workspace_copy(repo, tmp_path / "repo")
    for p in (variant / "data/shots/state").iterdir():
        p.unlink()
    run([sys.executable, "-m", "dvc", "checkout", "data/shots/state"], variant)
    repro(variant, "--force", "--single-item", "shots")
    assert report(variant, "shots")["videos_reused"] == 5


def test_iqa_filter_scores_every_usable_shot_once_and_thresholds_recut_from_the_cache(demo_repro, tmp_path):
    repo = demo_repro
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

    variant = workspace_copy(repo, tmp_path / "repo")
    text = (variant / "params.yaml").read_text().replace("piqe: 68.0", "piqe: 100.0")
    (variant / "params.yaml").write_text(text)
    repro(variant, "iqa_filter")
    assert report(variant, "iqa_filter")["scored"] == 0
    assert pd.read_parquet(variant / "data/iqa/scores.parquet")["kept"].sum() == len(shots) - 1  # all but static


def test_assemble_matches_captions_and_splits_by_video(demo_repro):
    repo = demo_repro
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
        for idx, caption, source in zip(s.shot_indices, s.captions, s.caption_sources):
            shot = scores.loc[(s.video_id, idx)]
            assert shot["kept"]
            if video["caption_form"] == "shots":  # the true shot that holds this piece gives the caption
                mid = (shot["start_frame"] + shot["end_frame"]) / 2
                (true,) = [t for t in video["shots"] if t["start_frame"] <= mid < t["end_frame"]]
                assert caption == true["caption"] and source == "sidecar"
            elif video["caption_form"] == "none":  # no sidecar: the caption stage's model (tiny, random) wrote it
                assert caption and source == "model"
            else:
                assert source == "sidecar"
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


def test_caption_writes_the_models_captions_where_no_sidecar_has_one_and_reuses_them(demo_repro, tmp_path):
    repo = demo_repro
    forms = {v["path"]: v["caption_form"] for v in json.loads((repo / "data/demo/truth.json").read_text())["videos"]}
    captions = pd.read_parquet(repo / "data/captions/captions.parquet")
    scores = pd.read_parquet(repo / "data/iqa/scores.parquet")
    assert len(captions) == int(scores["kept"].sum()) and (captions["fail_reason"] == "").all()
    assert captions["caption"].str.len().gt(0).all()
    for r in captions.itertuples(index=False):
        assert r.caption_source == ("model" if forms[r.path] == "none" else "sidecar"), r.path
    model = captions[captions["caption_source"] == "model"]
    # the tiny model's random weights never stop on their own: every caption reached the bound and was cut
    assert len(model) and model["truncated"].all() and (model["caption_tokens"] <= 24).all()
    assert (model["tokens_per_s"] > 0).all()
    subjects = pd.read_parquet(repo / "data/captions/subjects.parquet")
    assert set(subjects["video_id"]) == set(captions["video_id"]) and not subjects["subjects_parsed"].any()
    assert json.loads((repo / "data/weights/caption.json").read_text())["weights"]["model"]["sha256"] == "tiny"
    rep = report(repo, "caption")
    assert (rep["captioned"], rep["reused"], rep["failed"]) == (len(model), 0, 0) and rep["tokens_per_s_mean"] > 0
    metrics = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").get_run(rep["mlflow_run_id"]).data.metrics
    assert {"tokens_per_s_mean", "noun_phrases_mean", "truncated", "failed"} <= set(metrics)
    counts = json.loads((repo / "reports/curation/counts.json").read_text())["captions"]
    assert (counts["model"], counts["sidecar"]) == (len(model), len(captions) - len(model))

    # a rerun reuses every caption; an edited prompt template (a DVC dep) captions every model shot again
    variant = workspace_copy(repo, tmp_path / "repo")
    repro(variant, "--force", "--single-item", "caption")
    assert (report(variant, "caption")["captioned"], report(variant, "caption")["reused"]) == (0, len(model))
    template = variant / "configs/caption/prompt.txt"
    template.write_text(template.read_text() + "Name the main colour first.\n")
    assert ran(repro(variant, "--single-item", "caption"), "caption")
    assert report(variant, "caption")["captioned"] == len(model)


def read_shards(directory):
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(directory.glob("shard-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_encode_latents_stores_every_shot_and_two_ranks_agree_with_one(demo_repro, tmp_path):
    repo = demo_repro
    samples = pd.read_parquet(repo / "data/samples/samples.parquet")
    index = pd.read_parquet(repo / "data/latents/index.parquet")
    assert len(index) == sum(len(s) for s in samples["shot_indices"])  # one row per shot of every sample
    tensors = read_shards(repo / "data/latents/shards")
    assert len(tensors) == 2 * len(index)
    for s in samples.itertuples(index=False):
        rows = index[index["sample_id"] == s.sample_id].sort_values("shot")
        assert list(rows["shot_index"]) == list(s.shot_indices)
        assert list(rows["caption"]) == shot_prompts(list(s.captions))
        for r in rows.itertuples(index=False):
            z, text = tensors[r.latents_key], tensors[r.text_key]
            assert (r.num_frames - 1) % 4 == 0 and list(z.shape) == [48, 1 + (r.num_frames - 1) // 4, 4, 8]
            assert list(r.latent_shape) == list(z.shape) and text.shape == (64, 32)
            assert (text[len(r.caption.encode()) + 1:] == 0).all()  # zero past the caption's bytes + EOS
    rep = report(repo, "encode_latents")
    assert rep["samples_encoded"] == len(samples) and rep["samples_failed"] == 0 and rep["halo"] == 28
    assert pd.read_parquet(repo / "data/latents/failed.parquet").empty

    variant = workspace_copy(repo, tmp_path / "repo")
    repro(variant, "--force", "--single-item", "encode_latents")  # a rerun encodes nothing new
    assert (report(variant, "encode_latents")["samples_encoded"],
            report(variant, "encode_latents")["samples_reused"]) == (0, len(samples))
    # the same data on two ranks (torchrun, gloo): the same latents
    params = (variant / "params.yaml").read_text()
    (variant / "params.yaml").write_text(params.replace("  sp: 1  ", "  sp: 2  "))
    for p in (variant / "data/latents/shards").glob("*"):
        p.unlink()
    (variant / "data/latents/index.parquet").unlink()
    out = repro(variant, "encode_latents")
    assert ran(out, "encode_latents") and not ran(out, "assemble")
    two = read_shards(variant / "data/latents/shards")
    assert report(variant, "encode_latents")["ranks"] == 2 and two.keys() == tensors.keys()
    for k, v in tensors.items():
        assert (two[k] - v).abs().max() <= 1e-5 * max(1.0, v.abs().max().item()), k


def test_an_edited_caption_and_re_encoded_clips_reach_every_later_stage(demo_repro, tmp_path):
    """What a stage's cache reuses must be what DVC sees as unchanged: a caption edited in place
    and clips encoded at another quality are new inputs for the samples, the scores and the latents."""
    repo = workspace_copy(demo_repro, tmp_path / "repo")
    old_scores = pd.read_parquet(repo / "data/iqa/scores.parquet")
    # the videos where a user keeps them, a folder of their own (demo_data's folder is a DVC output,
    # which DVC would restore): the same contents, so every stage after ingest reuses its work
    shutil.copytree(repo / "data/demo/raw", repo / "videos")
    params = (repo / "params.yaml").read_text().replace("  source: data/demo/raw ", "  source: videos ")
    (repo / "params.yaml").write_text(params)
    repro(repo)
    assert report(repo, "shots")["videos_reused"] == 5
    # now the edit in place, and clips at another quality
    edited = "a caption edited after the first run"
    (repo / "videos/city night/café scène.json").write_text(json.dumps({"caption": edited}))
    (repo / "params.yaml").write_text(params.replace("  clip_crf: 0 ", "  clip_crf: 30 "))
    out = repro(repo, "encode_latents")  # train_ar would train afresh on the new latents: its own tests
    assert all(ran(out, s) for s in ("ingest", "shots", "iqa_filter", "caption", "assemble", "encode_latents"))

    samples = pd.read_parquet(repo / "data/samples/samples.parquet")
    cafe = samples[samples["path"] == "city night/café scène.mp4"]
    assert len(cafe) and all(c == edited for cs in cafe["captions"] for c in cs)
    index = pd.read_parquet(repo / "data/latents/index.parquet")
    prompts = index.loc[index["sample_id"].isin(cafe["sample_id"]), "caption"]
    assert {p.removeprefix(SCENE_TRANSITION) for p in prompts} == {edited}
    # every clip is new (crf 30 is lossy), so every shot is scored afresh, none from the cache
    iqa = report(repo, "iqa_filter")
    scores = pd.read_parquet(repo / "data/iqa/scores.parquet")
    assert (iqa["scored"], iqa["reused"]) == (len(scores), 0)
    merged = scores.merge(old_scores, on=["video_id", "shot_index"], suffixes=("", "_old"))
    assert len(merged) == len(scores) and (merged["iqa_score"] != merged["iqa_score_old"]).any()
    assert report(repo, "encode_latents")["samples_reused"] == 0


def history(repo) -> list[dict]:
    return [json.loads(line) for line in (repo / "reports/train_ar/history.jsonl").read_text().splitlines()]


def test_train_ar_learns_writes_its_model_folder_and_resumes_after_a_kill(demo_repro, tmp_path):
    repo = demo_repro
    steps = history(repo)
    assert [h["step"] for h in steps] == list(range(1, 121))
    first, last = (sum(h["loss"] for h in part) / len(part) for part in (steps[:10], steps[-10:]))
    assert last < 0.75 * first, (first, last)  # the tiny model visibly learns the demo latents
    val = [h["val_loss"] for h in steps if "val_loss" in h]
    assert len(val) == 6 and val[-1] < val[0]
    config = json.loads((repo / "models/ar/config.json").read_text())
    assert config["latent"] == {"channels": 48, "chunk_frames": 4, "height": 4, "width": 8, "temporal_stride": 4,
                                "spatial_stride": 16}
    assert config["precision"]["recipe"] == "bf16" and config["lineage"]["git.commit"]
    dit = {k: tuple(v) if isinstance(v, list) else v for k, v in config["dit"].items() if k != "name"}
    model = load_dit(repo / "models/ar", DiTConfig(**dit))  # the folder alone rebuilds the model
    assert sum(p.numel() for p in model.parameters()) > 0
    rep = report(repo, "train_ar")
    assert rep["steps_run"] == 120 and rep["skipped_steps"] == 0 and rep["samples_train"] >= 1
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    metrics = client.get_run(rep["mlflow_run_id"]).data.metrics
    assert {"loss", "val_loss", "grad_norm", "tokens_per_s", "peak_memory_mb", "skipped_steps"} <= set(metrics)
    assert len(client.get_metric_history(rep["mlflow_run_id"], "loss")) == 120

    # run again with nothing left to train: the same weights, a config.json whose lineage has one more
    # step range, the same identity; nothing after train_ar is out of date
    same = workspace_copy(repo, tmp_path / "same")
    identity = (repo / "reports/train_ar/identity.json").read_bytes()
    repro(same, "--force", "--single-item", "train_ar")
    assert (report(same, "train_ar")["start_step"], report(same, "train_ar")["steps_run"]) == (120, 0)
    assert (same / "reports/train_ar/identity.json").read_bytes() == identity
    lineage = json.loads((same / "models/ar/config.json").read_text())["lineage"]["step_ranges"]
    assert [(r["from_step"], r["to_step"]) for r in lineage] == [(0, 120), (120, 120)]
    status = run([sys.executable, "-m", "dvc", "status", "distill_dmd", "merge_w4a4", "evaluate", "package"], same)
    assert "up to date" in status.stdout, status.stdout

    # more steps: the run continues from its last checkpoint; killed at any point, it continues again
    variant = workspace_copy(repo, tmp_path / "repo")
    params = (variant / "params.yaml").read_text()
    params = params.replace("  steps: 120\n", "  steps: 150\n").replace("  checkpoint_every: 40\n",
                                                                         "  checkpoint_every: 10\n")
    (variant / "params.yaml").write_text(params)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "train_ar"], cwd=variant, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = variant / "checkpoints/train_ar" / Path(rep["checkpoints"]).name  # steps and checkpoint_every
    marker = run_dir / "step-00000130/meta.json"  # change no number: the same run digest's folder
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # a step or two more, logged and then lost with the kill
    # the whole job, as a cluster kills it (torchrun's workers run in sessions of their own)
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    before_kill = {json.loads(line)["step"]: json.loads(line)["loss"]
                   for line in (run_dir / "history.jsonl").read_text().splitlines()}
    repro(variant, "train_ar")
    rep = report(variant, "train_ar")
    assert rep["start_step"] == 130 and rep["steps_run"] == 20
    resumed = history(variant)
    assert [h["step"] for h in resumed] == list(range(1, 151))
    assert [h["loss"] for h in resumed[:120]] == [h["loss"] for h in steps]
    assert all(resumed[s - 1]["loss"] == loss for s, loss in before_kill.items()), "resumed losses differ"


def test_distill_dmd_writes_a_peft_adapter_and_its_critic_fits_the_generator(demo_repro):
    repo = demo_repro
    steps = [json.loads(line) for line in (repo / "reports/distill_dmd/history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in steps] == list(range(1, 81))
    assert [h["step"] for h in steps if "dmd_loss" in h] == list(range(5, 81, 5))  # once every 5 critic steps
    assert all(h["generator_grad_norm"] > 0 for h in steps if "dmd_loss" in h)
    evals = [h for h in steps if "critic_eval_loss" in h]
    assert [h["step"] for h in evals] == [1, 40, 80]
    # the critic's loss on the generator's samples, at fixed timesteps and noise, falls: it learns the
    # generator's distribution, which the frozen teacher does not know
    assert evals[-1]["critic_eval_loss"] < evals[0]["critic_eval_loss"]
    assert evals[-1]["critic_eval_ratio"] < evals[0]["critic_eval_ratio"] and evals[-1]["critic_eval_ratio"] < 1
    rep = report(repo, "distill_dmd")
    assert rep["steps_run"] == 80 and rep["skipped_steps"] == 0 and "20 linear layers converted" in rep["conversion"]
    assert rep["memory_comparison"] == {"measured": False, "reason": "GPU memory is measured on CUDA devices only"}
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    metrics = client.get_run(rep["mlflow_run_id"]).data.metrics
    assert {"dmd_loss", "critic_loss", "generator_grad_norm", "critic_grad_norm", "peak_memory_mb",
            "latent_generated_std", "latent_teacher_std", "critic_eval_loss"} <= set(metrics)

    # models/dmd: a peft adapter that loads onto the AR model (config.json says what it is for)
    config = json.loads((repo / "models/dmd/config.json").read_text())
    assert config["sampling"]["steps"] == [1000, 946, 854, 681, 0] and config["adapter"]["rank"] == 16
    ar = load_dit(repo / "models/ar", DIT_CONFIGS["tiny"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(ar, str(repo / "models/dmd"))
    assert any(p.abs().max() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_merge_w4a4_writes_the_packed_model_that_the_loader_runs(demo_repro):
    repo = demo_repro
    config = json.loads((repo / "models/w4a4/config.json").read_text())
    assert config["format"] == "longlive-w4a4" and config["sampling"]["steps"] == [1000, 946, 854, 681, 0]
    qc = QuantizationConfig.model_validate(config["quantization_config"])  # compressed-tensors reads it
    assert qc.format == "nvfp4-pack-quantized"
    with safe_open(str(repo / "models/w4a4/model.safetensors"), "pt") as f:
        keys = set(f.keys())
    packed = {k.removesuffix(".weight_packed") for k in keys if k.endswith(".weight_packed")}
    assert len(packed) == 20 and not {f"{name}.weight" for name in packed} & keys  # no high-precision copy
    metrics = json.loads((repo / "reports/merge_w4a4/metrics.json").read_text())
    assert metrics["quantized_size_ratio"] > 3.5 and metrics["size_ratio"] > 1
    assert 0 < metrics["rel_error_w4a4_vs_bf16"] < metrics["max_rel_error"]  # checked by the stage itself
    assert metrics["rel_error_w4a4_vs_distilled"] > 0 and "disjoint" in metrics["inputs"]
    model, _ = load_model_folder(repo / "models/w4a4")
    assert sum(isinstance(m, PackedNVFP4Linear) for m in model.modules()) == 20
    with torch.no_grad():
        out = model(torch.randn(1, 48, 4, 4, 8, dtype=torch.bfloat16), torch.tensor([946.0]),
                    torch.randn(1, 6, 32, dtype=torch.bfloat16))
    assert out.shape == (1, 48, 4, 4, 8) and torch.isfinite(out).all()


def test_longlive_generate_runs_the_chains_w4a4_model_from_a_prompt_file(demo_repro, tmp_path):
    """The command a user runs after `dvc repro`, on what the chain made: two shots, a prompt change."""
    prompts = tmp_path / "story.txt"
    prompts.write_text("1.3\tA red kite over a beach\n+0.7\tThe kite dives\nA city street at night\n")
    out = tmp_path / "story.mp4"
    run(["longlive", "generate", "--model", "models/w4a4", "--prompts", str(prompts), "--out", str(out),
         "--kv", "nvfp4"], demo_repro)
    side = json.loads((tmp_path / "story.mp4.json").read_text())
    # 24 fps, 4-frame chunks of 4 latent frames = 2/3 s: 1.3 s -> 2 chunks, 0.7 s -> 1, the default 2 s -> 3
    assert [s["latent_frames"] for s in side["shots"]] == [12, 12]
    assert side["frames"] == 2 * (1 + 4 * 11) and side["recipe"] == "nvfp4" and side["kv"] == "nvfp4"
    sampling = json.loads((demo_repro / "models/w4a4/config.json").read_text())["sampling"]  # as distilled
    assert [side[k] for k in ("steps", "window", "global_sink", "shot_sink")] == [
        sampling[k] for k in ("steps", "window", "global_sink", "shot_sink")] == [[1000, 946, 854, 681, 0], 16, 4, 4]
    assert set(side["sampling_from"].values()) == {"model folder"}
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == side["frames"]


def test_evaluate_scores_every_suite_video_and_passes_with_no_champion(demo_repro):
    repo = demo_repro
    scores = json.loads((repo / "reports/evaluate/scores.json").read_text())
    suite = load_params(repo / "params.yaml")["evaluate"]["suite"]
    assert set(scores["videos"]) == set(suite)
    for name, video in scores["videos"].items():
        assert (repo / f"reports/evaluate/videos/{name}.mp4").is_file()
        assert (repo / f"reports/evaluate/sheets/{name}.png").is_file()
        side = json.loads((repo / f"reports/evaluate/videos/{name}.mp4.json").read_text())
        assert video["frames"] == side["frames"] == sum(s["video_frames"] for s in side["shots"])
        assert 0 < video["temporal_flickering"] <= 1 and 0 < video["within_shot_consistency"] <= 1
        assert video["shot_switch"]["asked"] and 0 <= video["shot_switch_accuracy"] <= 1
    assert scores["verdict"]["passed"] and "no champion registered" in scores["verdict"]["reasons"][-1]
    # the demo's model moves (randomly): its suite clears the demo's motion floor, which params set below it
    assert scores["aggregate"]["motion"] > load_params(repo / "params.yaml")["evaluate"]["min_motion"] > 0
    assert scores["verdict"]["reasons"][0].startswith("motion: ")
    assert set(scores["skipped"]) == {"imaging_quality", "subject_consistency", "fvd"}  # no weights in the demo: said
    assert "imaging_quality" not in scores["aggregate"]
    vbench = scores["vbench"]
    assert vbench["aggregate"] is None and "evaluate.vbench.python is null" in vbench["not_run"]["vbench"]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    run_id = report(repo, "evaluate")["mlflow_run_id"]
    logged = {a.path for a in client.list_artifacts(run_id, "videos/kite_city")}
    assert logged == {"videos/kite_city/kite_city.mp4", "videos/kite_city/kite_city.png"}
    assert client.get_run(run_id).data.metrics["verdict_passed"] == 1


def test_package_writes_a_verified_bundle_and_registers_it_as_candidate_and_champion(demo_repro):
    repo = demo_repro
    run(["longlive", "bundle", "verify", "dist"], repo)
    version = (repo / "dist/VERSION").read_text().strip()
    weights = hashlib.sha256((repo / "models/w4a4/model.safetensors").read_bytes()).hexdigest()
    assert version.endswith(f"-w{weights[:12]}")
    assert version.startswith(run(["git", "describe", "--tags", "--always"], repo).stdout.strip())
    card = (repo / "dist/README.md").read_text()
    assert "| kite_city |" in card and "Verdict: **pass**" in card and report(repo, "evaluate")["mlflow_run_id"] in card
    assert (repo / "dist/lora/adapter_model.safetensors").is_file() and not (repo / "dist/configs/params.yaml").exists()
    # each stage's params as it ran them (its dvc.yaml params), not params.yaml whole
    assert sorted(p.name for p in (repo / "dist/configs").iterdir()) == sorted(f"{s}.yaml" for s in CONFIG_STAGES)
    params = load_params(repo / "params.yaml")
    for stage in CONFIG_STAGES:
        bundled = (repo / f"dist/configs/{stage}.yaml").read_bytes()
        assert bundled == (repo / f"reports/{stage}/params.yaml").read_bytes(), stage
    train = yaml.safe_load((repo / "dist/configs/train_ar.yaml").read_text())
    assert train["train_ar"] == params["train_ar"] and train["encode_latents"]["vae"] == "tiny"
    assert "orchestration" not in train and "ingest" not in train
    assert "its encoders are the built-in tiny ones" in run(["longlive", "bundle", "verify", "dist"], repo).stdout
    # prompt enhancement's examples in the folder `longlive generate --model dist/model` reads: the train captions
    index = pd.read_parquet(repo / "data/latents/index.parquet")
    train = index.loc[index["split"] == "train", "caption"]
    captions = {(c or "").removeprefix(SCENE_TRANSITION).strip() for c in train}
    bank = ExampleBank.load(repo / "dist/model")
    assert bank is not None and set(bank.captions) == captions - {""} and len(bank.captions) == len(set(bank.captions))
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    champion = client.get_model_version_by_alias("longlive-2.0", "champion")  # no champion before: the verdict passed
    assert champion.tags["bundle.version"] == version
    assert str(client.get_model_version_by_alias("longlive-2.0", "candidate").version) == str(champion.version)
    assert champion.run_id == report(repo, "package")["mlflow_run_id"]
    assert report(repo, "package")["promoted"] and "against no champion" in report(repo, "package")["promotion"]
    scores = json.loads((repo / "reports/evaluate/scores.json").read_text())
    assert champion.tags["model.identity"] == scores["candidate_identity"]  # the model the verdict judged


def test_an_edit_of_params_package_does_not_read_leaves_package_up_to_date(demo_repro, tmp_path):
    """package depends on the params files of the stages it bundles and on its own params: where the
    stages run (orchestration) or how many workers ingest uses changes no bundle."""
    repo = workspace_copy(demo_repro, tmp_path / "repo")
    head, rest = (repo / "params.yaml").read_text().split("\norchestration:", 1)
    head = head.replace("\n  workers: 2\n", "\n  workers: 3\n", 1)  # ingest's, the first workers in the file
    edited = head + "\norchestration:" + rest.replace("  retries: 2 ", "  retries: 7 ", 1)
    params = yaml.safe_load(edited)
    assert (params["ingest"]["workers"], params["orchestration"]["retries"]) == (3, 7)
    (repo / "params.yaml").write_text(edited)
    status = run([sys.executable, "-m", "dvc", "status", "package"], repo)
    assert "up to date" in status.stdout, status.stdout
    (repo / "params.yaml").write_text(edited.replace("  register: true ", "  register: false ", 1))
    status = run([sys.executable, "-m", "dvc", "status", "package"], repo)  # a param it reads: it reruns
    assert re.search(r"params.yaml:\s+modified:\s+package\n", status.stdout), status.stdout


def test_train_ar_split_over_two_sp_ranks_encoding_online_gives_the_one_rank_losses(demo_repro, tmp_path):
    """Balanced SP through `dvc repro`: the demo's run on 2 sequence-parallel ranks (train_ar.sp 2,
    nproc 2), each VAE-encoding its own frames plus a halo from the clips (latent_source online),
    trains on the same latents, windows, noise, timesteps and recycled errors as the demo's one rank
    reading the cache: its first steps' losses, buffer fill and injections are the demo's (bf16
    compute: to rounding)."""
    variant = workspace_copy(demo_repro, tmp_path / "repo")
    params = (variant / "params.yaml").read_text()
    head, train = params.split("\ntrain_ar:", 1)
    for old, new in (("  nproc: 1 ", "  nproc: 2 "), ("  sp: 1 ", "  sp: 2 "), ("  steps: 120\n", "  steps: 5\n"),
                     ("  latent_source: cache ", "  latent_source: online ")):
        assert old in train
        train = train.replace(old, new, 1)
    (variant / "params.yaml").write_text(head + "\ntrain_ar:" + train)
    out = repro(variant, "train_ar")
    assert ran(out, "train_ar") and not ran(out, "encode_latents")
    split, one = history(variant), history(demo_repro)[:5]
    assert [h["step"] for h in split] == [1, 2, 3, 4, 5]
    for a, b in zip(split, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert all(a[k] == b[k] for k in ("error_buffer_fill", "injected_context", "injected_latent", "injected_noise"))
    assert sum(h["injected_context"] + h["injected_latent"] for h in split) > 0

    # what a rank encodes: a late slice of a shot, from its frames and a halo only, equals the cache's
    encode = stage_config(EncodeLatentsConfig, "encode_latents", load_params(demo_repro / "params.yaml"))
    source = OnlineSource(encode, demo_repro / "data/shots/shots.parquet", demo_repro / "data/shots/clips")
    online = source.open(torch.device("cpu"))
    index = pd.read_parquet(demo_repro / "data/latents/index.parquet")
    row = index.loc[index["latent_shape"].map(lambda s: s[1]).idxmax()]
    frames = int(row["latent_shape"][1])
    with safe_open(str(demo_repro / "data/latents/shards" / row["shard"]), "pt") as shard:
        cached = shard.get_slice(row["latents_key"])[:, frames - 4:frames]
    torch.testing.assert_close(online.read(row["video_id"], row["shot_index"], frames - 4, frames), cached,
                               rtol=1e-4, atol=1e-4)
    assert online.latents_encoded < frames or online.halo + 5 >= frames
