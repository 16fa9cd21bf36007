"""The model bundle: checksums that catch every change, S3 publishing against moto's server over
HTTP (verified by reading back, never overwritten, fetched whole), and the registry's aliases."""
from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from longlive_core.cli import main as longlive
from longlive_core.package.bundle import SUMS, BundleError, fetch, upload, verify_dir, verify_s3, write_sums
from longlive_core.package.config import registry_aliases
from longlive_core.tracking.mlflow_run import StageRun, TrackingConfig

from .helpers.moto import KEY_ID, REGION, moto_server, s3

SECRET = "s3cret-" + secrets.token_hex(8)
BUCKET = "models"


def make_bundle(root: Path, version: str = "v1-wabc") -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model/model.safetensors").write_bytes(secrets.token_bytes(20 * 2**20))  # multipart-sized
    (root / "model/config.json").write_text('{"format": "longlive-w4a4"}')
    (root / "README.md").write_text("# card\n")
    (root / "VERSION").write_text(version + "\n")
    write_sums(root)
    return root


@pytest.fixture(scope="module")
def endpoint():
    with moto_server(SECRET) as url:
        s3(url, SECRET).create_bucket(Bucket=BUCKET)
        yield url


@pytest.fixture(autouse=True)
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


def test_a_bundle_verifies_and_any_change_missing_or_extra_file_is_named(tmp_path):
    root = make_bundle(tmp_path / "b")
    assert verify_dir(root) == "v1-wabc"
    assert (root / SUMS).read_text().splitlines()[0].endswith("  README.md")  # sha256sum's format
    with open(root / "model/config.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(BundleError, match=r"model/config.json has changed"):
        verify_dir(root)
    (root / "model/config.json").write_text('{"format": "longlive-w4a4"}')
    (root / "extra.txt").write_text("x")
    with pytest.raises(BundleError, match=r"extra.txt is not in SHA256SUMS"):
        verify_dir(root)
    (root / "extra.txt").unlink()
    (root / "README.md").unlink()
    with pytest.raises(BundleError, match=r"README.md is missing"):
        verify_dir(root)
    assert longlive(["bundle", "verify", str(root)]) == 1


def test_publishing_verifies_by_reading_back_never_overwrites_and_fetches_whole(endpoint, tmp_path):
    client = s3(endpoint, SECRET)
    root = make_bundle(tmp_path / "b")
    published = upload(client, root, f"s3://{BUCKET}/longlive")
    assert published == f"s3://{BUCKET}/longlive/v1-wabc/"
    assert verify_s3(client, published) == "v1-wabc"
    with pytest.raises(BundleError, match="already holds a published bundle"):
        upload(client, root, f"s3://{BUCKET}/longlive")
    assert longlive(["bundle", "verify", published, "--endpoint-url", endpoint]) == 0
    dest = tmp_path / "fetched"
    assert longlive(["bundle", "fetch", published, str(dest), "--endpoint-url", endpoint]) == 0
    assert verify_dir(dest) == "v1-wabc"
    assert (dest / "model/model.safetensors").read_bytes() == (root / "model/model.safetensors").read_bytes()
    # an object changed after publishing: verification and fetching both refuse it, and fetch leaves nothing
    client.put_object(Bucket=BUCKET, Key="longlive/v1-wabc/README.md", Body=b"# edited\n")
    with pytest.raises(BundleError, match="README.md has changed"):
        verify_s3(client, published)
    with pytest.raises(BundleError, match="README.md has changed"):
        fetch(client, published, tmp_path / "again")
    assert not (tmp_path / "again").exists() and not list(tmp_path.glob(".again*"))


def test_candidate_always_moves_and_champion_only_on_a_passing_verdict(tmp_path):
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    bundle = make_bundle(tmp_path / "b")
    versions = {}
    for name, passed in (("first", True), ("second", False)):
        with StageRun(cfg, "package", repo_root=tmp_path) as run:
            versions[name] = run.register("longlive-2.0", bundle, registry_aliases({"passed": passed}),
                                          {"bundle.version": name})
            client = run._client
    assert versions == {"first": "1", "second": "2"}
    assert str(client.get_model_version_by_alias("longlive-2.0", "candidate").version) == "2"
    assert str(client.get_model_version_by_alias("longlive-2.0", "champion").version) == "1"
    assert client.get_model_version("longlive-2.0", "2").tags["bundle.version"] == "second"
