"""The encoders a model folder names: found beside the folder or from the current directory, checked
against the digests the folder records (a mismatch or a missing one is one line), their digests
memoised in the user's cache directory; and the bundle that carries them (package.include_encoders),
verified by `longlive bundle verify` and built by the package stage."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import yaml

from longlive_core.cli import main as longlive
from longlive_core.config import ConfigError
from longlive_core.models.encoders import check_encoders, resolve_encoder_path, user_cache_dir, user_memo
from longlive_core.models.folder import AdapterFolder, AdapterSettings, Encoder, Sampling, read_dit_folder, write_config
from longlive_core.models.weights import CheckpointError, weights_identity
from longlive_core.package.bundle import BundleError, verify_dir, write_sums
from longlive_core.package.config import PackageConfig
from longlive_core.package.encoders import bundle_encoders, verify_bundle_encoders

from .helpers.ar_model import folder_config


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """A user's cache directory and a working directory of their own, away from the repository."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_vae_dir(tmp_path_factory) -> Path:
    """The demo's tiny VAE saved in the Diffusers layout, as a real VAE folder is."""
    from longlive_core.models.vae import build_vae

    path = tmp_path_factory.mktemp("weights") / "vae"
    build_vae("tiny").save_pretrained(path, safe_serialization=True)
    return path


def text_encoder_dir(root: Path) -> Path:
    (root / "umt5").mkdir(parents=True)
    (root / "umt5/config.json").write_text('{"d_model": 32}')
    (root / "umt5/model.safetensors").write_bytes(b"\x01" * 4096)
    return root / "umt5"


def model_with(tmp_path: Path, vae: str, text: str, **changes) -> tuple[Path, object]:
    """A model folder (config.json only) naming these encoders with the digests train_ar records."""
    config = folder_config(vae=Encoder(vae, weights_identity(vae, None)),
                           text_encoder=Encoder(text, weights_identity(text, None), max_length=16), **changes)
    write_config(config, tmp_path / "model")
    return tmp_path / "model", config


def test_the_encoders_are_checked_and_their_digests_memoised_in_the_user_cache(tmp_path, user_cache, tiny_vae_dir):
    text = text_encoder_dir(tmp_path)
    model_dir, config = model_with(tmp_path, str(tiny_vae_dir), str(text))
    assert check_encoders(config, model_dir) == {"vae": str(tiny_vae_dir), "text_encoder": str(text)}
    assert user_memo() == user_cache / "longlive/weights_sha256.json"
    assert str(tiny_vae_dir.resolve() / "config.json") in json.loads(user_memo().read_text())
    assert not (tmp_path / "work/data").exists()  # nothing written where the user runs it

    (text / "model.safetensors").write_bytes(b"\x02" * 4096)  # other weights at the same path
    with pytest.raises(CheckpointError) as err:
        check_encoders(config, model_dir)
    message = str(err.value)
    assert "\n" not in message and f"the text encoder (umT5) at {text}" in message
    assert config.text_encoder.sha256 in message and weights_identity(text, None) in message
    assert "it is not the text encoder (umT5) the model was made with; put that one there" in message
    missing = dataclasses.replace(config, vae=Encoder(str(tmp_path / "gone"), config.vae.sha256))
    with pytest.raises(CheckpointError, match=r"names the VAE '.*gone', which is not there .*: put the VAE the "
                                              r"model was made with there \(weights identity [0-9a-f]{16}\)"):
        check_encoders(missing, model_dir)
    # skipped: the built-in tiny models, and a folder older than the digests (its loader says what is missing)
    unrecorded = folder_config(vae=Encoder(str(tmp_path / "gone"), None))
    assert check_encoders(unrecorded, model_dir) == {"vae": str(tmp_path / "gone"), "text_encoder": "tiny"}


def test_the_user_cache_directory_follows_xdg_and_a_relative_path_is_looked_up_beside_the_folder_first(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid by the XDG spec: ignored
    assert user_cache_dir() == tmp_path / "home/.cache/longlive"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert user_cache_dir() == tmp_path / "home/.cache/longlive"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bundle/model").mkdir(parents=True)
    (tmp_path / "bundle/encoders/vae").mkdir(parents=True)
    assert resolve_encoder_path("../encoders/vae", tmp_path / "bundle/model") == str(
        tmp_path / "bundle/model/../encoders/vae")
    assert resolve_encoder_path("weights/vae", tmp_path / "bundle/model") == "weights/vae"  # the training repo's
    assert resolve_encoder_path("tiny", tmp_path / "bundle/model") == "tiny"
    assert resolve_encoder_path("/abs/vae", tmp_path / "bundle/model") == "/abs/vae"


def bundle_of(tmp_path: Path, model_dir: Path, config, include: bool) -> Path:
    bundle = tmp_path / "bundle"
    bundle.mkdir(parents=True)
    if include:
        config = bundle_encoders(config, model_dir, bundle, None)
    write_config(config, bundle / "model")
    (bundle / "VERSION").write_text("v1\n")
    write_sums(bundle)
    return bundle


def test_bundled_encoders_load_from_the_bundle_and_verify_catches_one_that_differs(tmp_path, user_cache,
                                                                                   tiny_vae_dir, capsys):
    from longlive_core.models.vae import vae_from

    text = text_encoder_dir(tmp_path)
    model_dir, config = model_with(tmp_path, str(tiny_vae_dir), str(text))
    bundle = bundle_of(tmp_path, model_dir, config, include=True)
    bundled = read_dit_folder(bundle / "model")
    assert (bundled.vae.path, bundled.text_encoder.path) == ("../encoders/vae", "../encoders/text_encoder")
    assert (bundled.vae.sha256, bundled.text_encoder.sha256) == (config.vae.sha256, config.text_encoder.sha256)
    assert bundled.lineage["bundled_encoders_from"] == {"vae": str(tiny_vae_dir), "text_encoder": str(text)}
    paths = check_encoders(bundled, bundle / "model")  # what generate loads: inside the bundle
    assert all(Path(p).resolve().is_relative_to(bundle) for p in paths.values())
    assert vae_from(paths["vae"]).config.z_dim == 48  # a Diffusers VAE, loaded from the bundle
    assert longlive(["bundle", "verify", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "every file matches SHA256SUMS; VAE (encoders/vae) and text encoder (umT5) (encoders/text_encoder) " \
           "match the digests in model/config.json" in out

    # other weights put in with SHA256SUMS rewritten to match: the files verify, the encoder does not
    (bundle / "encoders/text_encoder/model.safetensors").write_bytes(b"\x03" * 4096)
    write_sums(bundle)
    assert verify_dir(bundle) == "v1"
    differs = (r"the text encoder \(umT5\) at .*encoders/text_encoder has weights identity [0-9a-f]{16}, but "
               r".*model/config.json records " + config.text_encoder.sha256)
    with pytest.raises(BundleError, match=differs):
        verify_bundle_encoders(bundle)
    assert longlive(["bundle", "verify", str(bundle)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it is not the text encoder (umT5) the model was made with" in err


def test_a_bundle_without_encoders_says_so_and_one_with_an_unrecorded_digest_is_not_made(tmp_path, user_cache,
                                                                                         tiny_vae_dir):
    text = text_encoder_dir(tmp_path)
    model_dir, config = model_with(tmp_path, str(tiny_vae_dir), str(text))
    bundle = bundle_of(tmp_path, model_dir, config, include=False)
    line = verify_bundle_encoders(bundle)
    assert line.startswith("the bundle holds no encoders (package.include_encoders was false)") and str(text) in line
    assert not (bundle / "encoders").exists()
    assert "built-in tiny" in verify_bundle_encoders(bundle_of(tmp_path / "t", model_dir, folder_config(), True))
    old = dataclasses.replace(config, vae=Encoder(str(tiny_vae_dir), None))
    with pytest.raises(CheckpointError, match="records no digest for its VAE .*set package.include_encoders: false"):
        bundle_encoders(old, model_dir, tmp_path / "b2", None)


def test_package_bundles_each_stages_params_and_with_include_encoders_the_encoders(tmp_path, user_cache,
                                                                                   tiny_vae_dir, monkeypatch):
    """The package stage's body on a minimal chain (the end-to-end tests run it on the demo's)."""
    import torch
    from safetensors.torch import save_file

    from longlive_core.models.encoders import ROLES
    from tasks import package
    from tasks.stage import params_path

    repo = tmp_path / "repo"
    text = text_encoder_dir(repo / "weights")
    shutil.copytree(tiny_vae_dir, repo / "weights/vae")
    monkeypatch.chdir(repo)  # a training repository names its encoders relative to its root, as params.yaml does
    w4a4 = folder_config(format="longlive-w4a4", stage="merge_w4a4", quantization_config={},
                         longlive_quantization={}, vae=Encoder("weights/vae", weights_identity("weights/vae", None)),
                         text_encoder=Encoder("weights/umt5", weights_identity(str(text), None), max_length=16))
    write_config(w4a4, "models/w4a4")
    save_file({"w": torch.zeros(4)}, "models/w4a4/model.safetensors")
    write_config(AdapterFolder("peft-lora", "distill_dmd", "models/ar", AdapterSettings(4, 4.0),
                               Sampling("few-step", (1000, 0)), {"steps": 2}), "models/dmd")
    (repo / "reports/evaluate").mkdir(parents=True)
    (repo / "reports/evaluate/scores.json").write_text(json.dumps({
        "aggregate": {"temporal_flickering": 0.9, "within_shot_consistency": 0.8, "shot_switch_accuracy": 1.0},
        "verdict": {"passed": True, "champion": None, "reasons": ["no champion registered"]}, "videos": {},
        "settings": {}}))
    for stage in package.CONFIG_STAGES:
        params_path(stage).parent.mkdir(parents=True, exist_ok=True)
        params_path(stage).write_text(yaml.safe_dump({stage: {"seed": 0}}))

    class Run:
        def log_metrics(self, metrics):
            pass

        def set_tags(self, tags):
            pass

    params = {"package": {"register": False, "include_encoders": True}}
    summary = package.body(package.prepare(params), Run())
    dist = repo / "dist"
    assert summary["version"] == verify_dir(dist)
    assert sorted(p.name for p in (dist / "configs").iterdir()) == sorted(f"{s}.yaml" for s in package.CONFIG_STAGES)
    assert (dist / "configs/train_ar.yaml").read_bytes() == params_path("train_ar").read_bytes()
    bundled = read_dit_folder(dist / "model")
    assert [getattr(bundled, r).path for r in ROLES] == ["../encoders/vae", "../encoders/text_encoder"]
    assert (dist / "encoders/vae/diffusion_pytorch_model.safetensors").read_bytes() == (
        repo / "weights/vae/diffusion_pytorch_model.safetensors").read_bytes()
    assert "match the digests" in verify_bundle_encoders(dist)
    card = (dist / "README.md").read_text()
    assert "`configs/<stage>.yaml`" in card and "`encoders/vae/` in this bundle" in card
    assert "configs/params.yaml" not in card
    # without it (the default), the bundle names the training repository's paths and says where to put them
    assert PackageConfig().include_encoders is False
    package.body(package.prepare({"package": {"register": False}}), Run())
    assert not (dist / "encoders").exists() and read_dit_folder(dist / "model").vae.path == "weights/vae"
    assert "not in this bundle: put it at `weights/vae`" in (dist / "README.md").read_text()
    params_path("distill_dmd").unlink()
    with pytest.raises(ConfigError, match=r"reports/distill_dmd/params.yaml is missing .*dvc repro distill_dmd"):
        package.prepare(params)
